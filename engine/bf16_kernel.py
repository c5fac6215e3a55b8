"""The C bf16 linear kernel for few rows (engine/bf16_matmul.c): loaded with ctypes, called by
`SmallBatchLinear` (engine/models/small_batch_linear.py).

Why our own kernel: torch's bf16 nn.Linear on the CPU (oneDNN) reads a decode's weights well below the
rate the machine streams them, and from a few rows on it adds the rows' arithmetic to that stream; ours
takes 0.37-0.63x its time for 1-4 rows and 0.56-0.99x for 48 over SmolLM2's and the Qwen2.5 pair's
layers (AMD EPYC, 2 threads; docs/bench/issue20-s39/results/bf16_rows.txt). Decodes, verification
windows and short prefill chunks (up to small_batch_linear.MAX_KERNEL_ROWS rows) take it; longer
prefill chunks keep oneDNN. It needs AVX512-BF16; elsewhere
(or with SPECSERVE_BF16_KERNEL=0, for A/B runs) every linear layer keeps torch's.
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

logger = logging.getLogger("specserve.engine")

SOURCE = Path(__file__).with_name("bf16_matmul.c")


@dataclass(frozen=True)
class Bf16Kernel:
    path: Path  # the loaded shared library
    function: Callable[..., int]  # bf16_matmul (ctypes, argtypes set)

    def __call__(
        self,
        x: torch.Tensor,  # [M, K] bf16, unit stride along K
        weight: torch.Tensor,  # [N, K] bf16, contiguous
        bias: torch.Tensor | None,  # [N] bf16
    ) -> torch.Tensor:  # [M, N] bf16
        rows, k = x.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
        self.function(
            x.data_ptr(),
            rows,
            k,
            x.stride(0),
            weight.data_ptr(),
            weight.shape[0],
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


def build_bf16_kernel(cache_dir: Path, compiler: str = "gcc", defines: tuple[str, ...] = ()) -> Bf16Kernel:
    """Compile (or reuse) and load the kernel. Raises KernelBuildError, also where the compiler does
    not target AVX512-BF16 (the only path the kernel has)."""
    target, library = build_library(SOURCE, cache_dir, compiler, defines)
    if not library.bf16_matmul_available():
        raise KernelBuildError("the bf16 kernel needs AVX512-BF16, which this compiler does not target")
    arguments: list[type] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    arguments += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    function = int_function(library, "bf16_matmul", *arguments)
    return Bf16Kernel(path=target, function=function)


@functools.cache
def default_bf16_kernel() -> Bf16Kernel | None:
    """The kernel for this process (`build_for_process`); None (one info line) where it cannot be
    built or the CPU lacks AVX512-BF16, or when SPECSERVE_BF16_KERNEL=0."""
    return build_for_process(
        "SPECSERVE_BF16_KERNEL",
        build_bf16_kernel,
        lambda e: logger.info("bf16 linear layers use torch's kernel: %s", e),
    )
