"""vLLM's module paths, so `python -m vllm.entrypoints.openai.api_server` habits carry over."""
