"""A model's weight bytes from its config alone, before a byte of the checkpoint is read.

Start-up compares this with the memory budget (engine/memory.py) and refuses a model whose weights
alone cannot fit, instead of being OOM-killed while it loads. The decoder is built on the meta device
(shapes, no storage) in the load dtype, so the count covers exactly the tensors the loader fills:
tied embeddings once, biases and norms included, plus the one rope table every layer shares. Linear
layers of an int8/int4 load count at their packed size (`quantized_linear_bytes`), except when the
first load quantizes from the float checkpoint: that load holds every float linear weight first.
"""

from __future__ import annotations

import torch
from torch import nn

from .models.arch import ArchConfig
from .models.gguf_linear import GGUF_GROUP
from .models.layers import make_rope
from .models.registry import build_decoder
from .quantization import quantized_linear_bytes


def estimate_weight_bytes(
    cfg: ArchConfig,
    dtype: torch.dtype,
    encoding: str | None = None,
    group_size: int = 64,
    *,
    float_linears: bool = True,
    from_gguf: bool = False,
    keep_float_linears: bool = False,
) -> int:
    """Peak bytes of the weights while loading, which is also what stays resident after it.

    `encoding` int8/int4 quantizes the linear layers; `float_linears` says the load reads them as float
    first (no packed cache, no GGUF to quantize from), so they count at full size. `from_gguf`: int4
    layers built from GGUF Q4 blocks keep the GGUF's 32-weight groups (more scales than a larger
    --int4-group-size), so they are counted that way: at worst a few percent above the real size.
    `keep_float_linears`: a quantized draft keeps the float linear weights beside the packed ones
    (engine/row_routed_linear.py), so both count (an upper bound: a shape whose float GEMM never
    wins drops its copy).
    """
    with torch.device("meta"):
        model = build_decoder(cfg).to(dtype)
        rope = make_rope(cfg)
    itemsize = dtype.itemsize
    quantize = encoding is not None and (keep_float_linears or not float_linears)
    total, seen = 0, set()
    for module in model.modules():
        if quantize and isinstance(module, nn.Linear) and not keep_float_linears:
            continue
        for param in module.parameters(recurse=False):
            if id(param) not in seen:  # a tied lm_head shares the embedding's weight
                seen.add(id(param))
                total += param.numel() * itemsize
    if quantize:
        assert encoding is not None
        group = min(group_size, GGUF_GROUP) if from_gguf and encoding == "int4" else group_size
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            bias = module.bias is not None
            packed = quantized_linear_bytes(module.out_features, module.in_features, bias, encoding, group)
            # No kernel fits the shape: the layer stays float (a tied lm_head gets its own copy).
            total += (
                packed
                if packed is not None
                else module.weight.numel() * itemsize + (module.out_features * itemsize if bias else 0)
            )
    # One rope table, shared by every layer (float32 cos and sin).
    total += sum(b.numel() * b.element_size() for b in rope.buffers())
    return total
