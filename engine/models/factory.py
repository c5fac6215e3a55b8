"""Build a decoder from an HF-layout directory (config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..attention import select_attention_backend
from .arch import ArchConfig
from .llama import LlamaForCausalLM
from .weights import load_safetensors_weights


def load_decoder(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    load_linear_weights: bool = True,
) -> LlamaForCausalLM:
    """The decoder with the checkpoint's weights. `load_linear_weights=False` leaves the nn.Linear
    weights unread (allocated, never touched, so never resident) for a caller that replaces those
    layers anyway (quantized loading from a GGUF or the packed cache)."""
    cfg = ArchConfig.from_directory(directory)
    # Build on the meta device in the final dtype, then materialise empty storage: no wasted random
    # init of large weights, and no float32 copy of the model on the way to bf16.
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Non-persistent rope buffers were on meta too: rebuild them for real.
    from .rope import RotaryEmbedding

    rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling).to(
        device
    )
    _, backend = select_attention_backend(device)
    for layer in model.layers:
        layer.self_attn.rope = rope
        layer.self_attn.attention_backend = backend
    skip = set()
    if not load_linear_weights:
        skip = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    load_safetensors_weights(model, directory, skip=skip)
    # RMSNorm weights stay in the model dtype; the norm itself computes in float32.
    return model.eval().requires_grad_(False)
