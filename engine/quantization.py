"""Weight-only int8 / int4 quantization of a loaded decoder, on PyTorch's CPU weight-only kernels.

Decoding is memory-bound: every step reads every weight once, so bytes per weight set the speed.
`quantize_model` replaces each `nn.Linear` (lm_head included) with a module that keeps the weight
packed and multiplies with a fused kernel that dequantizes in registers; activations stay bfloat16.

- int8: symmetric, one scale per output channel, `w = q * s`, q in [-127, 127];
  kernel `aten._weight_int8pack_mm(x [M, K] bf16, q [N, K] int8, s [N] bf16)`.
- int4: asymmetric, one (scale, zero) per group of `group_size` input channels per output channel,
  `w = (q - 8) * scale + zero`, q in [0, 15] (the "tinygemm" convention of the kernel). Where our C
  kernel runs (AVX512-BF16; engine/int4_kernel.py) layers are `Int4TiledLinear`: our tiled layout,
  multiplied by engine/int4_matmul.c, 0.48-0.70x the time of PyTorch's kernel at 1-256 rows on the
  Qwen2.5-0.5B shapes (docs/bench/int4-kernel). Elsewhere `Int4Linear`: packed by
  `aten._convert_weight_to_int4pack_for_cpu`, multiplied by `aten._weight_int4pack_mm_for_cpu`.

Every one of these kernels computes each output row independently of the other rows in the batch
(checked in the tests), so a verification window [last, d1..dk] gets the same logits row by row as k+1 single-token
steps: speculation stays lossless with respect to the quantized model.

Measured here (Xeon with AVX512/AMX, 2 cores, torch 2.13), M=1 decode rows, time vs bf16 nn.Linear:
int8 ~0.4-0.7x, int4 ~0.35x (lm_head 151936x1536: bf16 23 ms, int8 16 ms, int4 8 ms). At M=6 (a
verification window) both kernels cost ~3x their M=1 time while bf16 (AMX GEMM) is flat, so a
quantized *target* gains most in plain decode; a quantized *draft* (M=1 per draft step) always gains.
Group sizes 32/64/128 run at the same speed (--int4-group-size). Default 64: on the 0.5B Qwen draft (1.5B target, code
prompt, k=5) acceptance was 0.73 at 128 and 0.80 at 64 (32: 0.76, one prompt), for 0.5 extra bit/weight.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import nn

from .config import INT4_GROUP_SIZES, QUANTIZED_ENCODINGS
from .int4_kernel import Int4Kernel, default_int4_kernel, pack_int4_tiles

logger = logging.getLogger("specserve.engine")

QUANT_DTYPE = torch.bfloat16  # activations, scales and zeros: the kernels' fast path
DEFAULT_INT4_GROUP_SIZE = 64
_N_ALIGN = 16  # the int4 packer needs out_features % 16 == 0: pad rows, slice the output
_K_ALIGN = 16  # the bf16 int8 kernel gives wrong results (or crashes) unless in_features % 16 == 0
_CHUNK_ROWS = 8192  # quantize large weights in row chunks to bound the float32 temporaries


# ---------------------------------------------------------------------------------------------------
# Pure quantize / dequantize functions (the tests' reference and the modules' constructors)
# ---------------------------------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8, scales [N] bf16). Scales are rounded to bf16 *before* q is
    computed, so q is the best code for the scale the kernel will actually use."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(QUANT_DTYPE)  # [N]
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q [N, K] int8, scales [N]) -> [N, K] float32."""
    return q.float() * scales.float()[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int32 in [0, 15], scales_and_zeros [K/g, N, 2] bf16).

    Per group: min-max asymmetric, scale = (max - min) / 15, zero = min + 8 * scale (the kernel
    computes (q - 8) * scale + zero). Scale and zero are rounded to bf16 first, as above."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)  # [N, G, g]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scales = ((hi - lo) / 15).clamp(min=1e-10).to(QUANT_DTYPE)
    zeros = (lo + 8 * scales.float()).to(QUANT_DTYPE)
    s, lo_eff = scales.float(), zeros.float() - 8 * scales.float()  # what the kernel reconstructs
    q = torch.round((w - lo_eff[..., None]) / s[..., None]).clamp_(0, 15).to(torch.int32)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return q.reshape(n, k), sz


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q [N, K] in [0, 15], scales_and_zeros [K/g, N, 2]) -> [N, K] float32."""
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
    qg = q.float().reshape(n, k // group_size, group_size)
    return ((qg - 8) * sz[..., 0:1] + sz[..., 1:2]).reshape(n, k)


def int4_from_affine(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Per-group affine codes `w = q * scale + min` (GGUF's Q4_0/Q4_1/Q4_K convention; scales and
    mins [N, G]) -> the kernel's scales_and_zeros [G, N, 2] bf16 for the same codes q.

    The kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale. Both are rounded to bf16;
    centring on q = 8 keeps the rounding error at most 8 |scale - scale_bf16| + |zero - zero_bf16|."""
    zeros = mins.float() + 8 * scales.float()
    return torch.stack([scales.to(QUANT_DTYPE), zeros.to(QUANT_DTYPE)], dim=-1).transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------


class _QuantLinearBase(nn.Module):
    """Shared plumbing: any leading shape, any float input dtype (cast to bf16 for the kernel and
    back, so a float32 model or a float32 caller works), bias kept in bf16 and added after."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None
    qweight: torch.Tensor  # registered buffers (typed for the checker)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bf16 contiguous -> [M, N] bf16
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(QUANT_DTYPE).contiguous()  # [M, K]
        out = self._matmul(x2)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*lead, self.out_features)


class Int8Linear(_QuantLinearBase):
    """Built from packed buffers (`from_float` quantizes a float weight; the packed cache restores)."""

    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scales", scales.to(QUANT_DTYPE))  # [N] bf16
        self.register_buffer("bias", None if bias is None else bias.detach().to(QUANT_DTYPE).clone())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        qs = [quantize_int8(chunk) for chunk in weight.detach().split(_CHUNK_ROWS)]
        return cls(torch.cat([q for q, _ in qs]), torch.cat([s for _, s in qs]), bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantized_weight(self) -> torch.Tensor:  # [N, K] float32, for tests and debugging
        return dequantize_int8(self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def pack_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] codes in [0, 15], any int dtype; scales_and_zeros [K/g, N, 2]) -> the kernel's
    (qweight [N_pad, K/2] uint8, scales_and_zeros [K/g, N_pad, 2] bf16).

    Rows are padded to a multiple of 16 (the packer's tile); padded rows have scale and zero 0, so
    they output 0 and are sliced off. Packing goes in row chunks: the int32 copy the packer wants is
    4 bytes per weight (~1 GB for a 152k x 1536 lm_head at once)."""
    pad = -q.shape[0] % _N_ALIGN
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad), value=8)
        scales_and_zeros = torch.nn.functional.pad(scales_and_zeros, (0, 0, 0, pad))
    # _CHUNK_ROWS % 16 == 0: the packer is row-block local. innerKTiles (the 1) only matters to the
    # CUDA layout; the CPU packer ignores it.
    packed = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk.to(torch.int32), 1)
        for chunk in q.split(_CHUNK_ROWS)
    ]
    return torch.cat(packed), scales_and_zeros.to(QUANT_DTYPE).contiguous()


class Int4Linear(_QuantLinearBase):
    """Built from the kernel's packed buffers; `from_float` quantizes a float weight, `from_codes`
    takes codes and scales made elsewhere (e.g. read straight from GGUF Q4 blocks)."""

    LAYOUT = "torch"  # the packed layout's name in the packed-layer cache (engine/quantized_loading.py)
    scales_and_zeros: torch.Tensor

    def __init__(
        self,
        qweight: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        out_features: int,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.out_features = out_features
        self.in_features = self._num_groups(scales_and_zeros) * group_size
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # [N_pad, K/2] uint8 here; the layout's own elsewhere
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/g, N_pad, 2] bf16 here
        self.register_buffer("bias", None if bias is None else bias.detach().to(QUANT_DTYPE).clone())

    @staticmethod
    def _num_groups(scales_and_zeros: torch.Tensor) -> int:
        return scales_and_zeros.shape[0]  # [K/g, N_pad, 2]

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> Int4Linear:
        """q [N, K] in [0, 15], scales_and_zeros [K/g, N, 2]: w = (q - 8) * scale + zero."""
        if q.shape[1] != scales_and_zeros.shape[0] * group_size or q.shape[0] != scales_and_zeros.shape[1]:
            raise ValueError(f"codes {tuple(q.shape)} do not match scales {tuple(scales_and_zeros.shape)}")
        return cls._pack(q, scales_and_zeros, group_size, bias)

    @classmethod
    def _pack(
        cls, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None
    ) -> Int4Linear:
        return cls(*pack_int4(q, scales_and_zeros), group_size, q.shape[0], bias)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = DEFAULT_INT4_GROUP_SIZE
    ) -> Int4Linear:
        parts = [quantize_int4(chunk, group_size) for chunk in weight.detach().split(_CHUNK_ROWS)]
        q = torch.cat([p[0].to(torch.uint8) for p in parts])  # [N, K]
        return cls.from_codes(q, torch.cat([p[1] for p in parts], dim=1), group_size, bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.qweight, self.group_size, self.scales_and_zeros
        )  # [M, N_pad]
        return out[:, : self.out_features] if out.shape[1] != self.out_features else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features},"
            f" int4 group_size={self.group_size}"
        )


class Int4TiledLinear(Int4Linear):
    """The same int4 weights in our kernel's tiled layout, multiplied by engine/int4_matmul.c, which
    reads each weight once for every row of a call (PyTorch's kernel rereads it every few rows).

    Buffers: qweight [T, K/8, 16] int32, scales_and_zeros [T, K/g, 2, 16] bf16 (T = ceil(N / 16);
    see `pack_int4_tiles`). Outputs are exact in float32 up to the summation order, then rounded to
    bf16 once, so they match `Int4Linear`'s within a bf16 rounding."""

    LAYOUT = "tiles"

    def __init__(
        self,
        qweight: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        out_features: int,
        bias: torch.Tensor | None,
        kernel: Int4Kernel,
    ):
        super().__init__(qweight, scales_and_zeros, group_size, out_features, bias)
        self.kernel = kernel

    @staticmethod
    def _num_groups(scales_and_zeros: torch.Tensor) -> int:
        return scales_and_zeros.shape[1]  # [T, K/g, 2, 16]

    @classmethod
    def _pack(
        cls, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None
    ) -> Int4TiledLinear:
        kernel = default_int4_kernel()
        if kernel is None:
            raise RuntimeError("the int4 kernel is not available on this machine (see default_int4_kernel)")
        if group_size % 16:  # the kernel sums a group 16 inputs at a time
            raise ValueError(f"the int4 kernel takes groups of a multiple of 16 inputs, not {group_size}")
        return cls(*pack_int4_tiles(q, scales_and_zeros), group_size, q.shape[0], bias, kernel)

    int8_activations = False  # set by `round_draft_activations`: a draft's layers only

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(
            x, self.qweight, self.scales_and_zeros, self.out_features, self.group_size, self.int8_activations
        )

    def extra_repr(self) -> str:
        return (
            super().extra_repr() + ", tiled kernel" + (", int8 activations" if self.int8_activations else "")
        )


def round_draft_activations(model: nn.Module) -> int:
    """Let a draft's tiled int4 layers round their inputs to int8 (per row and group of inputs) and
    multiply in int8 (engine/int4_matmul.c's VNNI path): 0.62-0.83x the bf16-activation time at 2-256
    rows on the Qwen2.5-0.5B MLP shapes, 8-256 for the LM head (fewer rows are bound by memory: the
    same), and the draft agrees with the target as often (docs/bench/int4-kernel). Only for a draft,
    whose numbers decide what it proposes, never what the target emits. Returns the number of layers
    switched (0 where the CPU lacks VNNI, or with SPECSERVE_DRAFT_INT8_ACTIVATIONS=0)."""
    if os.environ.get("SPECSERVE_DRAFT_INT8_ACTIVATIONS", "1") == "0":
        return 0
    layers = [m for m in model.modules() if isinstance(m, Int4TiledLinear) and m.kernel.function_q8]
    for layer in layers:
        layer.int8_activations = True
    return len(layers)


def int4_layer_class() -> type[Int4Linear]:
    """Our tiled kernel's layer where it runs on this machine, else PyTorch's."""
    return Int4TiledLinear if default_int4_kernel() is not None else Int4Linear


# ---------------------------------------------------------------------------------------------------
# Whole-model replacement
# ---------------------------------------------------------------------------------------------------


def int4_group_for(in_features: int, group_size: int) -> int | None:
    """The int4 group a layer gets: `group_size`, or a smaller one that divides in_features (e.g.
    SmolLM2's 576 -> 64); None when none does."""
    fitting = [g for g in sorted(INT4_GROUP_SIZES, reverse=True) if g <= group_size and in_features % g == 0]
    return fitting[0] if fitting else None


def quantized_linear_bytes(
    out_features: int, in_features: int, bias: bool, encoding: str, group_size: int
) -> int | None:
    """Bytes of the layer `quantize_weight` makes of an [N, K] weight (buffers as the kernels keep
    them), or None where it stays float. Start-up sizes the model with this before loading it."""
    n, k = out_features, in_features
    bias_bytes = n * QUANT_DTYPE.itemsize if bias else 0
    group = int4_group_for(k, group_size) if encoding == "int4" else None
    if group is not None:
        n_pad = n + (-n % _N_ALIGN)
        return n_pad * k // 2 + (k // group) * n_pad * 2 * QUANT_DTYPE.itemsize + bias_bytes
    if k % _K_ALIGN == 0:
        return n * k + n * QUANT_DTYPE.itemsize + bias_bytes  # int8 codes + per-row scales
    return None


def quantize_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, encoding: str, group_size: int
) -> nn.Module | None:
    """The quantized layer for a float weight [N, K], or None where no kernel fits its shape."""
    n, k = weight.shape
    if encoding == "int4":
        group = int4_group_for(k, group_size)
        if group is not None:
            return int4_layer_class().from_float(weight, bias, group)
        logger.warning("int4: in_features %d fits no group size; using int8 for a [%d, %d] layer", k, n, k)
    if k % _K_ALIGN == 0:
        return Int8Linear.from_float(weight, bias)
    logger.warning(
        "in_features %d is not a multiple of %d; [%d, %d] layer left unquantized", k, _K_ALIGN, n, k
    )
    return None


def check_encoding(encoding: str, group_size: int) -> None:
    if encoding not in QUANTIZED_ENCODINGS:
        raise ValueError(f"weight-only quantization is int8 or int4, not {encoding!r}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")


# (name of an nn.Linear in the model, the layer) -> its replacement
LinearReplacer = Callable[[str, nn.Linear], nn.Module]


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    encoding: str,
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    replace: LinearReplacer | None = None,
) -> nn.Module:
    """Replace every nn.Linear of `model` in place by its int8/int4 weight-only version; returns `model`.

    By default each layer is quantized from its own float weight; `replace` lets a loader build
    layers from another source (GGUF blocks mapped straight to int4). A tied lm_head gets its own
    quantized copy: the embedding stays a plain table, since a lookup reads one row and gains nothing
    from packing. Layers are replaced one at a time so the float weight of each is freed before the
    next is quantized (peak memory ~ model + one layer).
    """
    check_encoding(encoding, group_size)

    def from_own_weight(name: str, linear: nn.Linear) -> nn.Module:
        return quantize_weight(linear.weight.detach(), linear.bias, encoding, group_size) or linear

    build = replace or from_own_weight
    # A float32-loaded model keeps float32 norms/embedding; quantized layers cast at their boundary.
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:  # hold no list of modules: each float weight is freed once replaced
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, attr)
        if linear.weight.device.type != "cpu":
            raise NotImplementedError("the int8/int4 kernels are wired for CPU only")
        setattr(parent, attr, build(name, linear))
        del linear
    return model
