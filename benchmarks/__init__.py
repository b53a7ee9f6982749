"""Benchmarks for paged against HF transformers (static and continuous batching); see README.md."""
