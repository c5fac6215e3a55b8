"""Model definitions and weight loading."""

from .arch import SUPPORTED_ARCHITECTURES, ArchConfig, UnsupportedArchitectureError
from .llama import KVCache, LlamaForCausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "KVCache",
    "LlamaForCausalLM",
    "UnsupportedArchitectureError",
]
