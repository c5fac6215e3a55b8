"""One compact Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) for the paged KV cache.

The forward takes a flat ragged batch: `input_ids [T]`, `positions [T]` and an `AttentionMetadata`
that places every token in its sequence, so prefill chunks, decodes and verification windows of
different requests share one forward. q/k/v and gate/up projections are fused at load time: on CPU one
larger matmul is cheaper than three small ones.
"""

from __future__ import annotations

import math
import mmap

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata, paged_attention
from .arch import ArchConfig
from .rope import RotaryEmbedding

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k [slots, KVH, D], v [slots, KVH, D])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers does, then cast back before the weight.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.scale = cfg.head_dim**-0.5
        self.attention_backend: AttentionBackend = paged_attention  # set per device by the loader

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = self.attention_backend(q, k, v, cache[0], cache[1], meta, self.scale)  # [T, H * D]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.config = cfg
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
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
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_cache, strict=True):
            x = layer(x, positions, cache, meta)
        if output_index is not None:
            x = x.index_select(0, output_index)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()

    def allocate_kv_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (num_slots, self.config.num_kv_heads, self.config.head_dim)
        return [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(self.config.num_layers)
        ]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed KV storage. On CPU it is backed by an anonymous mmap: the kernel supplies zero pages on
    first touch, so allocating a pool sized for the whole memory budget costs nothing up front and RSS
    grows only with the slots actually written (torch.zeros would memset, i.e. touch, every page:
    ~3 s and 6 GiB resident for SmolLM2's default pool before the first request). Zeros, not
    torch.empty: padded attention reads unwritten slots under a mask, and 0 x NaN garbage is NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))  # anonymous, private, zero-filled
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # keeps `buffer` alive
