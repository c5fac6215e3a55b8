"""Build a decoder from an HF-layout directory (config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..attention import select_attention_backend
from ..bf16_kernel import default_bf16_kernel
from ..row_ops_kernel import default_row_ops_kernel
from .arch import ArchConfig
from .decoder import CausalDecoder
from .layers import use_row_ops
from .registry import build_decoder, family_of
from .row_invariant_linear import make_linears_row_invariant
from .small_batch_linear import use_small_batch_kernel
from .weights import load_safetensors_weights


def load_decoder(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    load_linear_weights: bool = True,
    batch_invariant: bool = False,
) -> CausalDecoder:
    """The registered family's decoder with the checkpoint's weights. `load_linear_weights=False`
    leaves the nn.Linear weights unread (allocated, never touched, so never resident) for a caller
    that replaces those layers anyway (quantized loading from a GGUF or the packed cache).
    `batch_invariant` selects attention and linear layers whose rows do not depend on the rest of the
    batch."""
    cfg = ArchConfig.from_directory(directory)
    # Build on the meta device in the final dtype, then materialise empty storage: no wasted random
    # init of large weights, and no float32 copy of the model on the way to bf16.
    with torch.device("meta"):
        model = build_decoder(cfg).to(dtype)
    model = model.to_empty(device=device)
    _, backend = select_attention_backend(device, batch_invariant)
    model.bind(device, backend)  # rope tables were on meta, and to_empty unties tied weights
    skip = set()
    if not load_linear_weights:
        skip = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    load_safetensors_weights(model, directory, family_of(cfg).weight_layout, skip=skip)
    bf16_cpu = dtype == torch.bfloat16 and torch.device(device).type == "cpu"
    if batch_invariant:  # and linear layers whose lone rows round as rows in a batch do
        make_linears_row_invariant(model)
    elif bf16_cpu:
        kernel = default_bf16_kernel()  # decodes and verification windows on our kernel
        if kernel is not None:
            use_small_batch_kernel(model, kernel)
    if bf16_cpu:
        row_ops = default_row_ops_kernel()  # norms, rope, silu * up: one C call each, row-invariant
        if row_ops is not None:
            use_row_ops(model, row_ops)
    # Norm weights stay in the model dtype; the norms themselves compute in float32.
    return model.eval().requires_grad_(False)
