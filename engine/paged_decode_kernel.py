"""The C paged-decode kernel (engine/paged_decode.c): built with the machine's C compiler at first use
(engine/c_library.py), loaded with ctypes.

Why our own kernel: decodes and verification windows attend a few query rows each against their own
context in the paged cache. torch has no paged attention for the CPU, so the matmul path gathers every
sequence's keys and values into a padded copy first and computes scores in bf16; this kernel reads the
cache in place, skips the padding and keeps scores and softmax in float32. One layer, bf16, AMD EPYC
(AVX512-BF16), 2 threads, against the matmul path (docs/bench/issue20-s35/decode_kernel.py): 0.27-0.49x
the time for 1-32 decodes of SmolLM2 and Qwen2.5-1.5B at 100-800 keys, 0.75-0.93x for verification
windows; mean distance from a float64 answer 0.21-0.33x the matmul path's. A whole SmolLM2 decode
forward of 4-32 sequences 1.23-1.44x faster (bench_attention). vLLM's CPU backend does the same with its
own C++ kernels; there is no maintained library that attends over our cache layout.

Where no compiler is found or the build fails, `default_paged_decode` logs one warning and returns None, and
attention keeps the torch path. `SPECSERVE_PAGED_DECODE=0` turns the kernel off (A/B runs).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .c_library import KernelBuildError, build_for_process, build_library, int_function

__all__ = ["KernelBuildError", "PagedDecodeKernel", "build_paged_decode", "default_paged_decode"]

logger = logging.getLogger("specserve.engine")

SOURCE = Path(__file__).with_name("paged_decode.c")
# Head sizes asked of the library at load (paged_decode_vector_head): every size a model may have.
_HEAD_SIZES_ASKED = range(1, 1025)


@dataclass(frozen=True)
class PagedDecodeKernel:
    path: Path  # the loaded shared library
    vector_heads: frozenset[int]  # head sizes the AVX512-BF16 path takes (empty: not compiled in)
    function: Callable[..., int]  # paged_decode in the library (ctypes, argtypes set)

    @property
    def vector_bf16(self) -> bool:
        """Compiled with the AVX512-BF16 path."""
        return bool(self.vector_heads)

    def supports(self, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
        """float32 always; bf16 where the vector path takes the head size. Elsewhere (bf16 without
        AVX512-BF16, other dtypes) the kernel's plain loops are slower than torch's matmuls."""
        if dtype != cache_dtype:
            return False
        if dtype == torch.float32:
            return True
        return dtype == torch.bfloat16 and head_dim in self.vector_heads

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_slots, KVH, D]
        v_cache: torch.Tensor,  # [num_slots, KVH, D]
        seq_info: torch.Tensor,  # [S, 4] int64: first query row, query rows, context length, first visible
        context_slots: torch.Tensor,  # [S, C] int64
        scale: float,
    ) -> torch.Tensor:  # [T, H * D]
        q = q.contiguous()
        out = torch.empty_like(q)
        num_tokens, heads, dim = q.shape
        rc = self.function(
            int(q.dtype == torch.bfloat16),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            seq_info.data_ptr(),
            context_slots.data_ptr(),
            context_slots.shape[1],
            seq_info.shape[0],
            heads,
            k_cache.shape[1],
            dim,
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged-decode kernel: could not allocate its scratch")
        return out.view(num_tokens, heads * dim)


def build_paged_decode(
    cache_dir: Path, compiler: str = "gcc", defines: tuple[str, ...] = ()
) -> PagedDecodeKernel:
    """Compile (or reuse) the kernel under `cache_dir`/kernels and load it. `defines` are extra -D
    macros (SPECSERVE_GENERIC builds the plain loops only). Raises KernelBuildError."""
    target, library = build_library(SOURCE, cache_dir, compiler, defines)
    arguments = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]
    function = int_function(library, "paged_decode", *arguments)
    vector_head = int_function(library, "paged_decode_vector_head", ctypes.c_int64)
    heads = frozenset(d for d in _HEAD_SIZES_ASKED if vector_head(d))
    return PagedDecodeKernel(path=target, vector_heads=heads, function=function)


@functools.cache
def default_paged_decode() -> PagedDecodeKernel | None:
    """The kernel for this process (`build_for_process`); None (one warning) where it cannot be
    built, or when SPECSERVE_PAGED_DECODE=0."""
    return build_for_process(
        "SPECSERVE_PAGED_DECODE",
        build_paged_decode,
        lambda e: logger.warning("paged-decode kernel unavailable, decodes use torch matmuls: %s", e),
    )
