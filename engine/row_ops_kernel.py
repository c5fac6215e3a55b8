"""The C row operations of a bf16 decoder layer (engine/row_ops.c): RMSNorm with the residual add
before it, rotary embedding, SiLU(gate) * up. Loaded with ctypes; the layers (engine/models/layers.py,
rope.py) call them for bf16 CPU tensors when the loader has installed the kernel (`use_row_ops`).

Why our own: in torch each is five to twelve small ops, and for a decode's few rows each op's dispatch
and allocation is the cost. A one-row step of the Qwen2.5-Coder-0.5B int4 draft took 0.935x the time
with ours (4 rows 0.920x), one of the Qwen2.5-Coder-1.5B target 0.970x (4 rows 0.982x; AMD EPYC, 2
threads; docs/bench/issue20-s40/results/row_ops.txt). The results are torch's, rounding for rounding,
but for the RMSNorm's sum order and SiLU's exp (see the C file): at most one bf16 step, near rounding
boundaries. Float32 models keep torch's ops (the tests'
exact references are float32). SPECSERVE_ROW_OPS_KERNEL=0 turns it off (A/B runs).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .c_library import build_for_process, build_library, int_function

logger = logging.getLogger("specserve.engine")

SOURCE = Path(__file__).with_name("row_ops.c")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernel computes on these tensors: bf16 on the CPU."""
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


@dataclass(frozen=True)
class RowOpsKernel:
    path: Path  # the loaded shared library
    add_rms_norm_function: Callable[..., int]  # ctypes, argtypes set
    rope_function: Callable[..., int]
    silu_mul_function: Callable[..., int]

    def rms_norm(
        self,
        x: torch.Tensor,  # [..., D] bf16, unit stride along D
        weight: torch.Tensor,  # [D] bf16, contiguous
        eps: float,
    ) -> torch.Tensor:  # [..., D] bf16, contiguous
        x2 = _rows(x)
        out = torch.empty(x2.shape, dtype=torch.bfloat16)
        self._norm(x2, None, None, weight, out, eps)
        return out.view(x.shape)

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [T, D] bf16: the residual stream
        delta: torch.Tensor,  # [T, D] bf16: what a sublayer adds to it
        weight: torch.Tensor,  # [D] bf16
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x + delta, rms_norm(x + delta)), [T, D] bf16 each
        x2, delta2 = _rows(x), _rows(delta)
        total = torch.empty(x2.shape, dtype=torch.bfloat16)
        normed = torch.empty(x2.shape, dtype=torch.bfloat16)
        self._norm(x2, delta2, total, weight, normed, eps)
        return total.view(x.shape), normed.view(x.shape)

    def _norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        total: torch.Tensor | None,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
    ) -> None:
        rows, dim = x.shape
        if weight.numel() != dim or not weight.is_contiguous():
            raise ValueError(f"rms_norm: weight of {weight.numel()} for rows of {dim}")
        self.add_rms_norm_function(
            x.data_ptr(),
            x.stride(0),
            None if delta is None else delta.data_ptr(),
            0 if delta is None else delta.stride(0),
            None if total is None else total.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )

    def rope(
        self,
        q: torch.Tensor,  # [T, H, D] bf16, heads and D contiguous within a row
        k: torch.Tensor,  # [T, KVH, D] bf16, likewise
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [P, D] float32, contiguous
        signed_sin: torch.Tensor,  # [P, D] float32: sin with its first half negated
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated q [T, H, D], k [T, KVH, D], contiguous
        rows, heads, dim = q.shape
        if not (_heads_contiguous(q) and _heads_contiguous(k)):
            raise ValueError("rope: q and k need contiguous heads within a row")
        if not (cos.is_contiguous() and signed_sin.is_contiguous() and cos.shape[1] == dim):
            raise ValueError(f"rope: tables {tuple(cos.shape)} for heads of {dim}")
        positions = positions.to(torch.int64).contiguous()  # the C side reads int64
        q_out, k_out = torch.empty(q.shape, dtype=torch.bfloat16), torch.empty(k.shape, dtype=torch.bfloat16)
        rc = self.rope_function(
            q.data_ptr(),
            q.stride(0),
            heads,
            k.data_ptr(),
            k.stride(0),
            k.shape[1],
            dim,
            positions.data_ptr(),
            rows,
            cos.data_ptr(),
            signed_sin.data_ptr(),
            cos.shape[0],
            q_out.data_ptr(),
            k_out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:  # torch's index_select raises IndexError here too
            raise IndexError(f"rope: a position outside the table's {cos.shape[0]} rows")
        return q_out, k_out

    def silu_mul(
        self,
        gate_up: torch.Tensor,  # [T, 2 I] bf16: gate, then up; unit stride along the last dim
        intermediate: int,  # I
    ) -> torch.Tensor:  # [T, I] bf16: silu(gate) * up
        x = _rows(gate_up)
        if x.shape[1] != 2 * intermediate:
            raise ValueError(f"silu_mul: rows of {x.shape[1]} for an intermediate size of {intermediate}")
        out = torch.empty(x.shape[0], intermediate, dtype=torch.bfloat16)
        self.silu_mul_function(
            x.data_ptr(), x.stride(0), x.shape[0], intermediate, out.data_ptr(), torch.get_num_threads()
        )
        return out.view(*gate_up.shape[:-1], intermediate)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit stride along D (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _heads_contiguous(x: torch.Tensor) -> bool:  # [T, H, D]: each row's H * D values in one run
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def build_row_ops_kernel(
    cache_dir: Path, compiler: str = "gcc", defines: tuple[str, ...] = ()
) -> RowOpsKernel:
    """Compile (or reuse) and load the kernel. Raises KernelBuildError."""
    target, library = build_library(SOURCE, cache_dir, compiler, defines)
    return RowOpsKernel(
        path=target,
        add_rms_norm_function=int_function(
            library, "add_rms_norm", _P, _I, _P, _I, _P, _P, _P, _I, _I, _F, ctypes.c_int
        ),
        rope_function=int_function(
            library, "rope", _P, _I, _I, _P, _I, _I, _I, _P, _I, _P, _P, _I, _P, _P, ctypes.c_int
        ),
        silu_mul_function=int_function(library, "silu_mul", _P, _I, _I, _I, _P, ctypes.c_int),
    )


@functools.cache
def default_row_ops_kernel() -> RowOpsKernel | None:
    """The kernel for this process (`build_for_process`); None (one info line) where it cannot be
    built, or when SPECSERVE_ROW_OPS_KERNEL=0."""
    return build_for_process(
        "SPECSERVE_ROW_OPS_KERNEL",
        build_row_ops_kernel,
        lambda e: logger.info("bf16 row operations use torch's ops: %s", e),
    )
