"""specserve.engine: the speculative-decoding LLM engine.

The public names load lazily (PEP 562): importing any specserve.engine.X runs this file first, and
`.llm` pulls in torch and transformers (seconds). The CLI imports engine.config and engine.sampling_params
to build its parser, and a usage error (`specserve serve --bad-flag`) must not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import EngineConfig, ModelSpec
    from .llm import LLM, CompletionOutput
    from .sampling_params import InvalidParameterError, SamplingParams
else:
    # Not seen by type checkers: they read the imports above, and a module-level __getattr__ would
    # make every misspelt name on this package type-check as Any.
    def __getattr__(name: str):
        if name in ("EngineConfig", "ModelSpec"):
            from . import config as module
        elif name in ("LLM", "CompletionOutput"):
            from . import llm as module
        elif name in ("InvalidParameterError", "SamplingParams"):
            from . import sampling_params as module
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(module, name)
        globals()[name] = value  # once per name: later reads are plain module attributes
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


__all__ = ["LLM", "CompletionOutput", "EngineConfig", "InvalidParameterError", "ModelSpec", "SamplingParams"]
