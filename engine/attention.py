"""Paged attention over a flat ragged batch, with torch SDPA.

The KV cache of one layer is a flat slot array `[num_blocks * block_size, kv_heads, head_dim]`;
slot = block_id * block_size + offset. Each step writes the new tokens' K/V through `slot_mapping`,
then gathers every sequence's context through `context_slots` into a padded batch so that prefills,
decodes and (k+1)-token verification windows of different requests run in ONE SDPA call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot for each new token
    context_slots: torch.Tensor  # [S, C] int64: slot of each context position per sequence (pad -> 0)
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
    ) -> AttentionMetadata:
        """Build metadata for sequences whose last `query_lens[i]` of `context_lens[i]` tokens are new."""
        num_seqs = len(query_lens)
        max_q, max_c = max(query_lens), max(context_lens)
        slot_mapping: list[int] = []
        context_slots = torch.zeros(num_seqs, max_c, dtype=torch.int64)
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


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    num_seqs, max_q = meta.query_index.shape
    max_c = meta.context_slots.shape[1]
    flat_slots = meta.context_slots.view(-1)
    # index_select on the flat slot array is much cheaper than 2-D advanced indexing on CPU.
    keys = k_cache.index_select(0, flat_slots).view(num_seqs, max_c, *k_cache.shape[1:]).transpose(1, 2)
    values = v_cache.index_select(0, flat_slots).view(num_seqs, max_c, *v_cache.shape[1:]).transpose(1, 2)
    if meta.uniform_queries:
        queries = q.view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)  # [S, H, Q, D]
    else:
        queries = (
            q.index_select(0, meta.query_index.view(-1)).view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)
        )
    out = F.scaled_dot_product_attention(
        queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.attn_mask, scale=scale, enable_gqa=True
    )  # [S, H, Q, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, -1)  # [S * Q, H * D]
    return out if meta.uniform_queries else out.index_select(0, meta.output_index)
