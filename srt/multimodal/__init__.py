"""Multimodal (vision-language) input in the main process: reading request images (image_io) and
turning them into what the model's vision tower and placeholder tokens need."""
