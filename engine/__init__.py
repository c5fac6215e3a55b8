"""specserve.engine: the speculative-decoding LLM engine."""

from .config import EngineConfig, ModelSpec
from .llm import LLM, CompletionOutput
from .sampling_params import InvalidParameterError, SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "InvalidParameterError", "ModelSpec", "SamplingParams"]
