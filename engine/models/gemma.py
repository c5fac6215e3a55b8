"""Gemma (v1, `GemmaForCausalLM`) for the paged KV cache.

What differs from Llama, all of it here:
  - the embedding output is scaled by sqrt(hidden_size), the factor rounded to the model dtype first;
  - RMSNorm scales by (1 + weight) and multiplies in float32 before casting back (Llama casts first);
  - the MLP is GeGLU with tanh-approximated GELU (configs saying "gelu" mean that too);
  - head_dim is its own number (256 in the released models), not hidden_size / num_heads;
  - lm_head is tied to the embedding unless config.json says otherwise.
The checkpoint names are Llama's, so the registry gives it the standard weight layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from .arch import ArchConfig, UnsupportedArchitectureError
from .decoder import CausalDecoder, KVCache
from .layers import DecoderLayer, bind_attention, make_embedding, make_rope


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in float32 and cast back once at the end (transformers #29402)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # stored as the offset from 1
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaForCausalLM(CausalDecoder):
    @classmethod
    def config_fields(cls, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        if hf_config.get("use_bidirectional_attention"):
            raise UnsupportedArchitectureError("Gemma with bidirectional attention is not a causal decoder")
        # Older transformers read `hidden_activation`; the released configs' "gelu" means the tanh form.
        act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
        return {
            "hidden_act": "gelu_pytorch_tanh" if act == "gelu" else act,
            "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", True)),
        }

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.config = cfg
        rope = make_rope(cfg)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, GemmaRMSNorm) for _ in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        output_index: torch.Tensor | None = None,  # [N] flat rows whose hidden state is wanted
    ) -> torch.Tensor:  # [N, hidden] final-normed hidden states
        x = self.embed_tokens(input_ids)  # [T, hidden]
        # transformers rounds the factor to the weights' dtype before multiplying: so do we.
        x = x * x.new_tensor(self.embed_scale)
        for layer, cache in zip(self.layers, kv_cache, strict=True):
            x = layer(x, positions, cache, meta)
        if output_index is not None:
            x = x.index_select(0, output_index)  # [N, hidden]
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()

    def bind(self, device: torch.device | str, attention_backend: AttentionBackend) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        bind_attention(self.layers, self.config, device, attention_backend)
