"""Paged attention over a flat ragged batch, with torch SDPA.

The KV cache of one layer is a flat slot array `[num_blocks * block_size, kv_heads, head_dim]`;
slot = block_id * block_size + offset. Each step writes the new tokens' K/V through `slot_mapping`,
then gathers every sequence's context through `context_slots` into a padded batch so that prefills,
decodes and (k+1)-token verification windows of different requests run in ONE SDPA call per layer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot for each new token
    context_slots: torch.Tensor  # [S, C] int64: slot of each context position per sequence (pad -> pad_slot)
    query_index: torch.Tensor  # [S, Q] int64: flat token index of each query row (pad -> 0)
    attn_mask: torch.Tensor  # [S, 1, Q, C] bool: True where query may attend
    output_index: torch.Tensor  # [T] int64: row of each flat token inside the padded [S * Q] output
    # True when every sequence has the same query length: the flat batch is already [S, Q] and the
    # query/output gathers can be skipped (the common all-decode and single-sequence steps).
    uniform_queries: bool = False

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        pad_slot: int = 0,
    ) -> AttentionMetadata:
        """Build metadata for sequences whose last `query_lens[i]` of `context_lens[i]` tokens are new.

        Context positions past a sequence's length read `pad_slot` under the mask. Masked or not, a
        NaN there would reach the output (softmax weight 0 times NaN is NaN), so the engine passes a
        reserved slot that is never written and stays zero: one request's bad numbers cannot leak
        into another's attention through padding."""
        num_seqs = len(query_lens)
        max_q, max_c = max(query_lens), max(context_lens)
        slot_mapping: list[int] = []
        context_slots = torch.full((num_seqs, max_c), pad_slot, dtype=torch.int64)
        query_index = torch.zeros(num_seqs, max_q, dtype=torch.int64)
        q_positions = torch.full((num_seqs, max_q), -1, dtype=torch.int64)
        output_index: list[int] = []
        flat = 0
        for i, (q_len, c_len, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
            positions = torch.arange(c_len)
            blocks = torch.tensor(table, dtype=torch.int64)[positions // block_size]
            slots = blocks * block_size + positions % block_size
            context_slots[i, :c_len] = slots
            slot_mapping.extend(slots[c_len - q_len :].tolist())
            query_index[i, :q_len] = torch.arange(flat, flat + q_len)
            q_positions[i, :q_len] = torch.arange(c_len - q_len, c_len)
            output_index.extend(range(i * max_q, i * max_q + q_len))
            flat += q_len
        ctx_len = torch.tensor(context_lens).view(num_seqs, 1, 1)
        key_pos = torch.arange(max_c).view(1, 1, max_c)
        # Causal within the sequence; padding queries (position -1) see key 0 so no row is all -inf.
        mask = (key_pos <= q_positions.clamp(min=0).unsqueeze(-1)) & (key_pos < ctx_len)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            context_slots=context_slots.to(device),
            query_index=query_index.to(device),
            attn_mask=mask.unsqueeze(1).to(device),
            output_index=torch.tensor(output_index, dtype=torch.int64, device=device),
            uniform_queries=len(set(query_lens)) == 1,
        )


def _write_and_gather(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Store the new K/V, then gather padded per-sequence tensors: q [S, Q, H, D], k/v [S, C, KVH, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    num_seqs, max_q = meta.query_index.shape
    max_c = meta.context_slots.shape[1]
    flat_slots = meta.context_slots.view(-1)
    # index_select on the flat slot array is much cheaper than 2-D advanced indexing on CPU.
    keys = k_cache.index_select(0, flat_slots).view(num_seqs, max_c, *k_cache.shape[1:]).to(q.dtype)
    values = v_cache.index_select(0, flat_slots).view(num_seqs, max_c, *v_cache.shape[1:]).to(q.dtype)
    if meta.uniform_queries:
        queries = q.view(num_seqs, max_q, *q.shape[1:])
    else:
        queries = q.index_select(0, meta.query_index.view(-1)).view(num_seqs, max_q, *q.shape[1:])
    return queries, keys, values


def _flatten_output(out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[S, Q, H, D] padded output -> [T, H * D] rows of the real query tokens."""
    num_seqs, max_q = out.shape[:2]
    out = out.reshape(num_seqs * max_q, -1)
    return out if meta.uniform_queries else out.index_select(0, meta.output_index)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """The reference backend: torch SDPA (CPU and CUDA), GQA handled by SDPA itself."""
    queries, keys, values = _write_and_gather(q, k, v, k_cache, v_cache, meta)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [S, H, Q, D]
        keys.transpose(1, 2),  # [S, KVH, C, D]
        values.transpose(1, 2),
        attn_mask=meta.attn_mask,
        scale=scale,
        enable_gqa=True,
    )  # [S, H, Q, D]
    return _flatten_output(out.transpose(1, 2), meta)


def xformers_paged_attention(q, k, v, k_cache, v_cache, meta, scale) -> torch.Tensor:  # [T, H * D]
    """CUDA backend through xformers' memory-efficient attention (same gather, same mask as SDPA)."""
    import xformers.ops as xops

    queries, keys, values = _write_and_gather(q, k, v, k_cache, v_cache, meta)
    group = queries.shape[2] // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2)  # [S, C, H, D]: GQA expanded
    values = values.repeat_interleave(group, dim=2)
    num_seqs, max_q, heads, _ = queries.shape
    max_c = keys.shape[1]
    # xformers wants an additive bias whose last dim is 8-aligned in memory: allocate padded, then slice.
    padded_c = -(-max_c // 8) * 8
    bias = torch.full((num_seqs, heads, max_q, padded_c), float("-inf"), dtype=queries.dtype, device=q.device)
    bias = bias[..., :max_c]
    bias.masked_fill_(meta.attn_mask.expand(num_seqs, heads, max_q, max_c), 0.0)
    out = xops.memory_efficient_attention(queries, keys, values, attn_bias=bias, scale=scale)  # [S, Q, H, D]
    return _flatten_output(out, meta)


AttentionBackend = Callable[..., torch.Tensor]


def select_attention_backend(device: torch.device | str) -> tuple[str, AttentionBackend]:
    """torch SDPA everywhere; xformers on CUDA when it is installed."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("xformers") is not None:
        return "xformers", xformers_paged_attention
    return "torch_sdpa", paged_attention
