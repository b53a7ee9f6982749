"""OpenAI-compatible entry points (vLLM's layout)."""
