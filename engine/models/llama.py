"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) for the paged KV cache.

The forward takes a flat ragged batch: `input_ids [T]`, `positions [T]` and an `AttentionMetadata`
that places every token in its sequence, so prefill chunks, decodes and verification windows of
different requests share one forward. The registry maps Mistral and Qwen onto this class with their
flags (attention bias, q/k norm).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from .arch import ArchConfig
from .decoder import CausalDecoder, KVCache
from .layers import DecoderLayer, RMSNorm, bind_attention, make_embedding, make_rope

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(CausalDecoder):
    plain_layer_stack = True  # the forward below: embeddings, the layers, the final norm

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.config = cfg
        rope = make_rope(cfg)
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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
        if self.decode_stack is not None:
            hidden = self.decode_stack(x, positions, kv_cache, meta)  # [T, hidden] or None
            if hidden is not None:
                return hidden if output_index is None else hidden.index_select(0, output_index)
        for layer, cache in zip(self.layers, kv_cache, strict=True):
            x = layer(x, positions, cache, meta)
        if output_index is not None:
            x = x.index_select(0, output_index)  # [N, hidden]: the final norm only on wanted rows
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()

    def bind(self, device: torch.device | str, attention_backend: AttentionBackend) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        bind_attention(self.layers, self.config, device, attention_backend)
