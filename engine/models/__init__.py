"""Model definitions and weight loading. A model family is a `CausalDecoder` subclass in its own module
plus one line in registry.py (docs/models.md)."""

from .arch import SUPPORTED_ARCHITECTURES, ArchConfig, UnsupportedArchitectureError
from .decoder import CausalDecoder, KVCache

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "CausalDecoder",
    "KVCache",
    "UnsupportedArchitectureError",
]
