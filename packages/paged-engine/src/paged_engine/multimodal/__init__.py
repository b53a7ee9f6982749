"""Image inputs: the host turns images into placeholders and pixel values (processor.py,
inputs.py; M-RoPE positions for Qwen2-VL, qwen2_vl.py); the worker's vision encoder (archs.py
picks it: llava.py, llava_next.py, qwen2_vl.py) embeds them."""
