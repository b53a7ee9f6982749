"""Image inputs: the host turns images into placeholders and pixel values (processor.py,
inputs.py); the worker's vision encoder (llava.py, vision_transformer.py) embeds them."""
