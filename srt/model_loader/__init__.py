"""Model loading: ``get_model`` and the streaming weight iterators (see ``loader.py``)."""

from srt.model_loader.loader import get_model

__all__ = ["get_model"]
