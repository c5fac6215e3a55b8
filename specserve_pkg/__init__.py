"""specserve: lossless speculative decoding behind an OpenAI-compatible API."""

__version__ = "0.1.0"
