"""The C int4 matmul (engine/int4_matmul.c): our packed layout, its packer, and the call.

Why our own kernel: PyTorch's packed int4 CPU kernel dequantizes the weight again for every few rows
of its input, so its cost grows with the rows (Qwen2.5-0.5B shapes, AMD EPYC, 2 threads: 4 rows 1.7x
one row, 16 rows 5.8x; docs/bench/issue20-s36/results/int4_rows.txt). A draft step over several
requests, an int4 target's verification windows and every int4 prefill are many rows. This kernel
decodes each tile of weights once per four rows and keeps a row's output independent of its batch.
It needs AVX512-BF16; elsewhere (or with SPECSERVE_INT4_KERNEL=0, for A/B runs) int4 layers keep
PyTorch's kernel (`Int4Linear`).
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

SOURCE = Path(__file__).with_name("int4_matmul.c")
TILE = 16  # output channels per tile (one float32 vector); N is padded to it
_K_PER_WORD = 8  # input channels per packed 32-bit word (4 pairs)


@dataclass(frozen=True)
class Int4Kernel:
    path: Path  # the loaded shared library
    function: Callable[..., int]  # int4_matmul (ctypes, argtypes set)
    # int4_matmul_q8: activations rounded to int8, for drafts only; None where the CPU lacks VNNI
    function_q8: Callable[..., int] | None

    def function_for(self, int8_activations: bool) -> Callable[..., int] | None:
        """The C function a call with these activations runs (None: int8 without the VNNI path); also
        what engine/decode_stack.c calls for a layer."""
        return self.function_q8 if int8_activations else self.function

    def __call__(
        self,
        x: torch.Tensor,  # [M, K] bf16, contiguous
        packed: torch.Tensor,  # [T, K/8, 16] int32, from pack_int4_tiles
        scales_and_zeros: torch.Tensor,  # [T, K/g, 2, 16] bf16
        out_features: int,
        group_size: int,
        int8_activations: bool = False,
    ) -> torch.Tensor:  # [M, N] bf16
        """x @ W^T. With `int8_activations` (a draft's layers; needs `function_q8`) each row is
        rounded to int8 per group first (8 bits an input: a larger error), 0.62-0.83x the time where
        the dot products bound it (from 2-8 rows on; docs/bench/int4-kernel/results/int4_rows.txt)."""
        rows, k = x.shape
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        function = self.function_for(int8_activations)
        if function is None:
            raise RuntimeError("int8 activations need the kernel's VNNI path, which this CPU lacks")
        rc = function(
            x.data_ptr(),
            rows,
            k,
            packed.data_ptr(),
            scales_and_zeros.data_ptr(),
            out_features,
            group_size,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("int4 kernel: could not allocate its scratch")
        return out


def build_int4_kernel(cache_dir: Path, compiler: str = "gcc", defines: tuple[str, ...] = ()) -> Int4Kernel:
    """Compile (or reuse) and load the kernel. Raises KernelBuildError, also where the compiler does
    not target AVX512-BF16 (the only path the kernel has)."""
    target, library = build_library(SOURCE, cache_dir, compiler, defines)
    if not library.int4_matmul_available():
        raise KernelBuildError("the int4 kernel needs AVX512-BF16, which this compiler does not target")
    arguments: list[type] = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    arguments += [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    functions = [int_function(library, name, *arguments) for name in ("int4_matmul", "int4_matmul_q8")]
    q8 = functions[1] if library.int4_matmul_q8_available() else None
    return Int4Kernel(path=target, function=functions[0], function_q8=q8)


@functools.cache
def default_int4_kernel() -> Int4Kernel | None:
    """The kernel for this process (`build_for_process`); None (one info line) where it cannot be
    built or the CPU lacks AVX512-BF16, or when SPECSERVE_INT4_KERNEL=0."""
    return build_for_process(
        "SPECSERVE_INT4_KERNEL",
        build_int4_kernel,
        lambda e: logger.info("int4 layers use PyTorch's kernel: %s", e),
    )


def pack_int4_tiles(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] codes in [0, 15], any int dtype; scales_and_zeros [K/g, N, 2]) -> the kernel's
    (packed [T, K/8, 16] int32, tiled [T, K/g, 2, 16] bf16), T = ceil(N / 16). Padded channels get
    code 0, scale 0 and zero 0: they compute 0 and are never stored.

    Word (t, b, j) holds channel 16t + j's codes for inputs 8b..8b+7: input 8b + 2i in bits 4i..4i+3,
    input 8b + 2i + 1 in bits 16 + 4i..19 + 4i (so that masking the word shifted by 4i leaves one bf16
    pair per 32-bit lane; see engine/int4_matmul.c)."""
    n, k = q.shape
    if k % _K_PER_WORD:
        raise ValueError(f"in_features {k} is not a multiple of {_K_PER_WORD}")
    pad = -n % TILE
    q = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, pad))  # [N_pad, K]
    tiles = (n + pad) // TILE
    codes = q.reshape(tiles, TILE, k // _K_PER_WORD, 4, 2).permute(0, 2, 1, 3, 4)  # [T, K/8, 16, i, pair]
    shifts = 4 * torch.arange(4, dtype=torch.int32)[:, None] + torch.tensor([0, 16], dtype=torch.int32)
    packed = (codes << shifts).sum(dim=(-2, -1), dtype=torch.int32)  # disjoint bits: the sum is an OR
    sz = torch.nn.functional.pad(scales_and_zeros, (0, 0, 0, pad))  # [G, N_pad, 2]
    tiled = sz.reshape(sz.shape[0], tiles, TILE, 2).permute(1, 0, 3, 2)  # [T, G, 2, 16]
    return packed.contiguous(), tiled.to(torch.bfloat16).contiguous()
