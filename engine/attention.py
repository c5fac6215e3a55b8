"""Paged attention over a flat ragged batch: torch SDPA, and on the CPU matmuls for short queries.

The KV cache of one layer is a flat slot array `[num_blocks * block_size, kv_heads, head_dim]`;
slot = block_id * block_size + offset. Each step writes the new tokens' K/V through `slot_mapping`,
then gathers every sequence's context through `context_slots` into a padded batch so that prefills,
decodes and (k+1)-token verification windows of different requests run in one SDPA call per layer,
or one per group of sequences with similar query lengths (`grouped`): padded to the longest query of
the batch, one 9-token window made every decode of a 16-request SmolLM2 batch attend 9 query rows
(steps 0.13 s instead of 0.10 s with 16% more rows), a 500-token prefill chunk 500. On the CPU,
groups of decodes and verification windows skip SDPA and the gather: the paged-decode kernel reads each
sequence's context in place (`kernel_paged_attention`, engine/paged_decode.c), or, where it cannot be
built, two matmuls over a gathered copy (`cpu_paged_attention`).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import torch
import torch.nn.functional as F

from .paged_decode_kernel import PagedDecodeKernel, default_paged_decode

AttentionBackend: TypeAlias = Callable[..., torch.Tensor]


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
    # Set when the sequences are attended in groups of similar query length: (first, end, that group's
    # metadata) per group, where [first, end) are the group's places in the batch's tokens laid out
    # group after group. The padded fields above are then empty: every backend (`grouped`) runs each
    # group on its own.
    groups: tuple[tuple[int, int, AttentionMetadata], ...] = ()
    # With groups: the flat token index at each place of that layout ([T] int64), and the place of each
    # flat token (its inverse); None when the batch's own order already is group after group (a step's
    # decodes, then the prompts it admitted): the groups are then slices of the batch, no gather.
    group_order: torch.Tensor | None = None
    group_places: torch.Tensor | None = None
    # Per sequence: its first query row in the flat batch, its query rows, its context length and its
    # first visible context position ([S, 4] int64, the paged-decode kernel's view); None with groups.
    seq_info: torch.Tensor | None = None
    # head_major_rows' indices per KV head count, built on first use: every layer of the step shares them.
    _head_rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    # query_blocks' blocks per block size, built on first use (the mask is every layer's).
    _query_blocks: dict[int, list[tuple[int, int, int]]] = field(
        default_factory=dict, repr=False, compare=False
    )
    # merged_short_queries' result per row bound, built on first use (every layer's).
    _merged: dict[int, AttentionMetadata | None] = field(default_factory=dict, repr=False, compare=False)

    def merged_short_queries(self, max_rows: int) -> AttentionMetadata | None:
        """A grouped step whose groups all have at most `max_rows` query rows (decodes and windows) as
        one ungrouped metadata in the batch's own token order, for a backend that needs no padding (the
        paged-decode kernel): slot_mapping, context_slots (each group's, widened to the longest) and
        seq_info only. None when a group is longer (a prefill chunk) or the step is not grouped."""
        if max_rows in self._merged:
            return self._merged[max_rows]
        merged = None
        parts = [sub for _, _, sub in self.groups]
        if parts and all(sub.seq_info is not None and sub.query_index.shape[1] <= max_rows for sub in parts):
            width = max(sub.context_slots.shape[1] for sub in parts)
            infos = []
            for first, _, sub in self.groups:
                assert sub.seq_info is not None
                info = sub.seq_info.clone()
                info[:, 0] += first  # the sequence's first token, in the group-after-group layout
                infos.append(info)
            seq_info = torch.cat(infos)
            slot_mapping = torch.cat([sub.slot_mapping for sub in parts])  # group-after-group order
            if self.group_order is not None:  # back to the batch's order
                seq_info[:, 0] = self.group_order[seq_info[:, 0]]
                assert self.group_places is not None
                slot_mapping = slot_mapping.index_select(0, self.group_places)
            empty = torch.empty(0, dtype=torch.int64, device=slot_mapping.device)
            merged = AttentionMetadata(
                slot_mapping=slot_mapping,
                context_slots=torch.cat(
                    [F.pad(sub.context_slots, (0, width - sub.context_slots.shape[1])) for sub in parts]
                ),
                query_index=empty,
                attn_mask=torch.empty(0, dtype=torch.bool, device=slot_mapping.device),
                output_index=empty,
                seq_info=seq_info,
            )
        self._merged[max_rows] = merged
        return merged

    def head_major_rows(self, kv_heads: int) -> torch.Tensor:  # [S, KVH, C] int64
        """The row of each (sequence, KV head, context position) in a cache viewed as [num_slots * KVH,
        D]: one index_select with them gathers K or V straight into the [S, KVH, C, D] layout the
        attention matmuls take, where a gather by slot gives [S, C, KVH, D] and a permuted copy must
        follow (8 SmolLM2 decodes at 490 keys, bf16, EPYC VM: 178 instead of 225 us a layer alone; a
        whole decode step 0.975-1.00x, docs/bench/issue20-tail-s33/attention_ab.py)."""
        rows = self._head_rows.get(kv_heads)
        if rows is None:
            heads = torch.arange(kv_heads, device=self.context_slots.device).view(1, kv_heads, 1)
            rows = self.context_slots.unsqueeze(1) * kv_heads + heads
            self._head_rows[kv_heads] = rows
        return rows

    def query_blocks(self, rows: int) -> list[tuple[int, int, int]]:
        """The padded query rows in blocks of `rows`: (first row, end row, keys the block sees), where
        no row of the block, in any sequence, may attend a key at or past that end (`attn_mask`)."""
        blocks = self._query_blocks.get(rows)
        if blocks is None:
            mask = self.attn_mask[:, 0]  # [S, Q, C]
            num_q, num_c = mask.shape[1:]
            keys = torch.arange(num_c, device=mask.device)
            last = torch.where(mask, keys, -1).amax(dim=-1).amax(dim=0)  # [Q] last key any sequence sees
            ends = (last.cummax(dim=0).values + 1).tolist()
            blocks = [
                (q0, min(q0 + rows, num_q), ends[min(q0 + rows, num_q) - 1]) for q0 in range(0, num_q, rows)
            ]
            self._query_blocks[rows] = blocks
        return blocks

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        pad_slot: int = 0,
        context_starts: list[int] | None = None,
    ) -> AttentionMetadata:
        """Build metadata for sequences whose last `query_lens[i]` of `context_lens[i]` tokens are new.
        With `context_starts`, sequence i's queries see only positions >= context_starts[i] (a draft
        head that skipped older positions: their cache slots hold nothing of this request).

        Context positions past a sequence's length read `pad_slot` under the mask. Masked or not, a
        NaN there would reach the output (softmax weight 0 times NaN is NaN), so the engine passes a
        reserved slot that is never written and stays zero: one request's bad numbers cannot leak
        into another's attention through padding."""
        groups = query_groups(query_lens)
        if len(groups) > 1:
            return cls._grouped(
                groups, query_lens, context_lens, block_tables, block_size, device, pad_slot, context_starts
            )
        num_seqs = len(query_lens)
        max_q, max_c = max(query_lens), max(context_lens)
        slot_mapping: list[int] = []
        context_slots = torch.full((num_seqs, max_c), pad_slot, dtype=torch.int64)
        query_index = torch.zeros(num_seqs, max_q, dtype=torch.int64)
        q_positions = torch.full((num_seqs, max_q), -1, dtype=torch.int64)
        output_index: list[int] = []
        seq_info: list[tuple[int, int, int, int]] = []
        flat = 0
        for i, (q_len, c_len, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
            seq_info.append((flat, q_len, c_len, context_starts[i] if context_starts is not None else 0))
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
        if context_starts is not None:
            starts = torch.tensor(context_starts).view(num_seqs, 1, 1)
            mask &= (key_pos >= starts) | (q_positions.unsqueeze(-1) < 0)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            context_slots=context_slots.to(device),
            query_index=query_index.to(device),
            attn_mask=mask.unsqueeze(1).to(device),
            output_index=torch.tensor(output_index, dtype=torch.int64, device=device),
            uniform_queries=len(set(query_lens)) == 1,
            seq_info=torch.tensor(seq_info, dtype=torch.int64, device=device),
        )

    @classmethod
    def _grouped(
        cls,
        groups: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        pad_slot: int,
        context_starts: list[int] | None,
    ) -> AttentionMetadata:
        firsts = [0]
        for q_len in query_lens:
            firsts.append(firsts[-1] + q_len)  # flat index of each sequence's first token
        parts = []
        order: list[int] = []  # flat token indices, group after group
        for members in groups:
            first = len(order)
            order.extend(t for i in members for t in range(firsts[i], firsts[i + 1]))
            meta = cls.build(
                [query_lens[i] for i in members],
                [context_lens[i] for i in members],
                [block_tables[i] for i in members],
                block_size,
                device,
                pad_slot,
                [context_starts[i] for i in members] if context_starts is not None else None,
            )
            parts.append((first, len(order), meta))
        group_order = group_places = None
        if order != list(range(len(order))):
            group_order = torch.tensor(order, dtype=torch.int64)
            group_places = torch.empty_like(group_order)
            group_places[group_order] = torch.arange(len(order))
            group_order, group_places = group_order.to(device), group_places.to(device)
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return cls(
            empty,
            empty,
            empty,
            torch.empty(0, dtype=torch.bool, device=device),
            empty,
            groups=tuple(parts),
            group_order=group_order,
            group_places=group_places,
        )


# A group's longest query may be this many times its shortest: padding to it wastes at most that
# factor of the group's query rows. Single-token decodes always form their own group: SDPA's CPU
# kernel costs 2.4x more per sequence from 2 query rows on (16 sequences, 400 keys: 0.48 ms a layer
# at 1 row, 1.18 ms at 2, 1.33 ms at 9), so one 2-token window padding every decode to 2 rows made a
# 16-request SmolLM2 step 27% slower.
MAX_QUERY_SPREAD = 2


def query_groups(query_lens: list[int]) -> list[list[int]]:
    """Sequence indices in groups of similar query length (decodes, windows, prefill chunks apart),
    each in batch order; one group when the lengths are all alike."""
    order = sorted(range(len(query_lens)), key=lambda i: query_lens[i])
    groups: list[list[int]] = []
    for i in order:
        shortest = query_lens[groups[-1][0]] if groups else 0
        if (
            groups
            and shortest > 1
            and query_lens[i] <= MAX_QUERY_SPREAD * shortest
            or query_lens[i] == shortest == 1
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def grouped(backend: AttentionBackend) -> AttentionBackend:
    """Let `backend` take a grouped metadata: it runs on each group of sequences (their tokens are
    disjoint, so each group writes and reads only its own sequences' cache slots)."""

    @functools.wraps(backend)
    def run(
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_slots, KVH, D]
        v_cache: torch.Tensor,  # [num_slots, KVH, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H * D]
        if not meta.groups:
            return backend(q, k, v, k_cache, v_cache, meta, scale)
        # Laid out group after group, each group's rows are a slice: one gather of q, k and v and one
        # of the output for the whole step (none when the batch is in that order already), rather
        # than three and a scatter per group. In one process, alternated with the per-group copies
        # (SmolLM2 bf16, EPYC VM; docs/bench/issue20-tail-s33/attention_ab.py): steps of 7 decodes
        # and an admitted prompt 0.2-2.7 ms faster (of 50-133 ms), decodes with windows -0.5 / +0.6
        # ms; outputs equal. Small, and one code path for every grouped step.
        order = meta.group_order
        if order is not None:
            q, k, v = q.index_select(0, order), k.index_select(0, order), v.index_select(0, order)
        out = torch.cat(
            [backend(q[a:b], k[a:b], v[a:b], k_cache, v_cache, sub, scale) for a, b, sub in meta.groups]
        )  # [T, H * D], group after group
        return out if meta.group_places is None else out.index_select(0, meta.group_places)

    return run


def _write_and_gather(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Store the new K/V, then gather padded per-sequence tensors: q [S, Q, H, D], k/v [S, C, KVH, D]."""
    _write_new_kv(k, v, k_cache, v_cache, meta)
    keys = _gather_context(k_cache, meta.context_slots).to(q.dtype)
    values = _gather_context(v_cache, meta.context_slots).to(q.dtype)
    return _padded_queries(q, meta), keys, values


def _write_new_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
) -> None:
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor,  # [num_slots, KVH, D]
    context_slots: torch.Tensor,  # [S, C] slot of each context position (pad -> pad_slot)
) -> torch.Tensor:  # [S, C, KVH, D] in the cache's dtype
    # index_select on the flat slot array is much cheaper than 2-D advanced indexing on CPU.
    return cache.index_select(0, context_slots.reshape(-1)).view(*context_slots.shape, *cache.shape[1:])


def _padded_queries(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, H, D] -> [S, Q, H, D]
    num_seqs, max_q = meta.query_index.shape
    if meta.uniform_queries:
        return q.view(num_seqs, max_q, *q.shape[1:])
    return q.index_select(0, meta.query_index.view(-1)).view(num_seqs, max_q, *q.shape[1:])


def _flatten_output(out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[S, Q, H, D] padded output -> [T, H * D] rows of the real query tokens."""
    num_seqs, max_q = out.shape[:2]
    out = out.reshape(num_seqs * max_q, -1)
    return out if meta.uniform_queries else out.index_select(0, meta.output_index)


@grouped
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
    return _sdpa_attention(q, k, v, k_cache, v_cache, meta, scale)


def _sdpa_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,  # one group
    scale: float,
) -> torch.Tensor:  # [T, H * D]
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


# Keys are padded to a multiple of this, so the shapes the matmul kernels see vary in whole tiles only.
_INVARIANT_KEY_TILE = 64
# Query rows per attention tile: bounds the float32 scores at [S, H, 256, C'] for long prefills.
INVARIANT_QUERY_TILE = 256


@grouped
def batch_invariant_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """Attention whose result for a query row does not depend on the rest of the batch.

    SDPA's CPU kernel picks its key blocking from the padded context length and reduces row sums
    in an order that depends on it, so a row's output changes (by an ulp or two) with the number of
    rows and requests that share the step: a verification window's rows see the window's later
    keys as masked padding, a decode sees the longest context of the batch. Greedy speculation then
    drifts from plain decoding in bf16. Here every reduction has an order fixed by the row alone:
    - q.k and p.v are bf16 matmuls: on the CPU (oneDNN, AMX or AVX-512) a row's result is the same
      for any number of rows and for any zero-padded key length (tested in
      tests/engine/test_batch_invariance.py); float32 matmuls are not (MKL changes kernels with M);
    - the softmax max is order-free; its sum is a cumsum (a sequential scan: masked keys, all after a
      row's last visible key, add exact zeros at the end) instead of a vectorised sum whose lane
      split moves with the row length.
    Precision is that of transformers' eager attention (bf16 scores and probabilities, float32
    softmax). Scores are materialised per tile of sequences and query rows ([S, H, Q, C'] bounded by
    `SCORE_TILE_ELEMENTS` or one sequence's tile of `INVARIANT_QUERY_TILE` rows), unlike SDPA.
    """
    return _invariant_attention(q, k, v, k_cache, v_cache, meta, scale)


# Query groups of at most this many rows (decodes, verification windows) take the matmul path of the
# default CPU backend; prefill chunks take SDPA.
SMALL_QUERY_ROWS = 16
# Score elements ([S, H, Q, C]) one tile of the matmul paths materialises at most (more only where a
# single sequence's query tile needs it), 12 bytes each at most (bf16 and float32 copies): ~50 MB.
SCORE_TILE_ELEMENTS = 1 << 22
# K and V elements one tile of the matmul path gathers (one sequence's where that alone is more):
# 4 MB of bf16, which glibc serves from its heap rather than fresh mappings.
GATHER_TILE_ELEMENTS = 1 << 21


@grouped
def cpu_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """The default CPU backend: a group of decodes or verification windows (up to `SMALL_QUERY_ROWS`
    query rows) as two matmuls and a softmax, a group with longer queries (prefill chunks) through
    SDPA.

    Why: torch's CPU SDPA kernel is built for long queries; for a few query rows against a long
    context it costs many times the two matmuls it stands for, and more so the more sequences share
    the call. On the AMD EPYC (AVX-512 BF16, no AMX, 2 threads), one Qwen2.5-1.5B layer's decode of
    4 sequences at 600 keys took 3.7 ms in SDPA and 0.5 ms as matmuls (benchmarks/bench_attention.py);
    a whole plain decode forward of 4 sequences took 1.3-1.7x as long with SDPA as without, and the
    0.5B draft's 2x, once per drafted token. (The default where the paged-decode kernel cannot be
    built; `kernel_paged_attention` otherwise.)"""
    return _cpu_group_attention(q, k, v, k_cache, v_cache, meta, scale)


def _cpu_group_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,  # one group
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """One group the torch way: prefill chunks through blocked SDPA, decodes and windows as matmuls."""
    if meta.query_index.shape[1] > SMALL_QUERY_ROWS:
        return _blocked_sdpa_attention(q, k, v, k_cache, v_cache, meta, scale)
    return _matmul_attention(q, k, v, k_cache, v_cache, meta, scale)


def paged_decode_view(meta: AttentionMetadata) -> AttentionMetadata | None:
    """The metadata the paged-decode kernel attends a whole step with: the step's own, or its decodes
    and windows merged back into the batch's order (the kernel pads nothing, so one call a layer
    takes them all, with no gathers). None when a sequence has more than `SMALL_QUERY_ROWS` query
    rows (a prefill chunk): such a step attends group by group."""
    if meta.groups:
        return meta.merged_short_queries(SMALL_QUERY_ROWS)
    if meta.seq_info is None or meta.query_index.shape[1] > SMALL_QUERY_ROWS:
        return None
    return meta


def _kernel_group_attention(
    kernel: PagedDecodeKernel,
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,  # one group
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    if meta.query_index.shape[1] > SMALL_QUERY_ROWS or meta.seq_info is None:
        return _cpu_group_attention(q, k, v, k_cache, v_cache, meta, scale)
    _write_new_kv(k, v, k_cache, v_cache, meta)
    return kernel(q, k_cache, v_cache, meta.seq_info, meta.context_slots, scale)


class KernelPagedAttention:
    """The default CPU backend where the paged-decode kernel builds (engine/paged_decode_kernel.py):
    decodes and verification windows read the paged cache in place, with no gathered or padded copy;
    prefill chunks run as in `cpu_paged_attention`, and so do dtypes and head sizes the kernel does
    not take. A class, not a closure, so that engine/decode_stack.py can tell a layer bound to it and
    call the same kernel."""

    def __init__(self, kernel: PagedDecodeKernel):
        self.kernel = kernel
        self._per_group = grouped(functools.partial(_kernel_group_attention, kernel))

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_slots, KVH, D]
        v_cache: torch.Tensor,  # [num_slots, KVH, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H * D]
        if not self.kernel.supports(q.dtype, k_cache.dtype, q.shape[-1]):  # the model's, for every group
            return cpu_paged_attention(q, k, v, k_cache, v_cache, meta, scale)
        view = paged_decode_view(meta)
        if view is None:
            return self._per_group(q, k, v, k_cache, v_cache, meta, scale)
        _write_new_kv(k, v, k_cache, v_cache, view)
        assert view.seq_info is not None
        return self.kernel(q, k_cache, v_cache, view.seq_info, view.context_slots, scale)


def kernel_paged_attention(kernel: PagedDecodeKernel) -> KernelPagedAttention:
    """The paged-decode kernel's backend (`KernelPagedAttention`)."""
    return KernelPagedAttention(kernel)


# Prefill chunks attend in blocks of this many query rows, each block to the keys its rows may see.
PREFILL_QUERY_BLOCK = 64


def _blocked_sdpa_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,  # one group
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """SDPA over blocks of `PREFILL_QUERY_BLOCK` query rows, each against the keys up to the last one
    its rows may attend (`AttentionMetadata.query_blocks`), so a causal prompt skips the keys above
    its diagonal instead of scoring them and masking them off.

    Why: torch's CPU SDPA kernel scores the masked keys of a prompt too, and skips them with
    is_causal only in whole blocks of several hundred keys (not at all for a chunk after a cached
    prefix). One SmolLM2 layer's fresh prompt (bf16, EPYC VM, 2 threads;
    docs/bench/issue20-s34/prefill_blocks.py): 484 tokens 4.3 ms in one call, 3.2 ms in blocks of 64
    rows; 1024 tokens 15.6 and 11.5 ms; 104 tokens 0.93x. A whole 484-token prompt's forward 0.88x, a
    wave of six prompts 0.90x; prompts of 53-104 tokens level. Each row is the same maths as in one
    call (the keys cut off were masked), rounded as the kernel's key blocks fall.
    """
    queries, keys, values = _write_and_gather(q, k, v, k_cache, v_cache, meta)  # [S, Q, H, D], [S, C, KVH, D]
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [S, KVH, C, D]
    out = torch.empty_like(queries)  # [S, Q, H, D]
    for q0, q1, c1 in meta.query_blocks(PREFILL_QUERY_BLOCK):
        out[:, q0:q1] = F.scaled_dot_product_attention(
            queries[:, q0:q1].transpose(1, 2),  # [S, H, q1 - q0, D]
            keys[:, :, :c1],
            values[:, :, :c1],
            attn_mask=meta.attn_mask[:, :, q0:q1, :c1],
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
    return _flatten_output(out, meta)


def _matmul_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,  # one group
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    """softmax(q k^T) v with the query heads of one KV head as the rows of one matmul (GQA without
    repeating K/V); scores in the model dtype, softmax in float32, as transformers' eager attention.

    A few sequences at a time: each tile gathers only its own context, so no temporary grows with the
    batch. Gathered whole, 32 SmolLM2 decodes at 1024 keys made 12.6 MB K and V tensors (and copies)
    per layer, which glibc mapped afresh and faulted in every layer: their forward took 0.74-0.81 s,
    SDPA's 0.51-0.72 s."""
    _write_new_kv(k, v, k_cache, v_cache, meta)
    queries = _padded_queries(q, meta)  # [S, Q, H, D]
    num_seqs, max_q, heads, dim = queries.shape
    max_c, kv_heads = meta.context_slots.shape[1], k_cache.shape[1]
    group = heads // kv_heads
    rows = queries.permute(0, 2, 1, 3).reshape(num_seqs, kv_heads, group * max_q, dim)  # rows (g, q)
    out = queries.new_empty(num_seqs, kv_heads, group * max_q, dim)
    per_seq = max(heads * max_q * max_c, 2 * kv_heads * max_c * dim)  # scores, or gathered K and V
    s_tile = max(1, min(SCORE_TILE_ELEMENTS, GATHER_TILE_ELEMENTS) // per_seq)
    # Contiguous [n, KVH, C, D] operands: a matmul over a permuted gather takes a strided path that
    # cost 2-3x a copy and the contiguous matmul together, so K and V are gathered in that layout.
    head_rows = meta.head_major_rows(kv_heads)  # [S, KVH, C]
    k_rows, v_rows = k_cache.view(-1, dim), v_cache.view(-1, dim)  # [num_slots * KVH, D]
    for s0 in range(0, num_seqs, s_tile):
        s1 = min(s0 + s_tile, num_seqs)
        n = s1 - s0
        index = head_rows[s0:s1].reshape(-1)
        keys = k_rows.index_select(0, index).view(n, kv_heads, max_c, dim).to(q.dtype)
        values = v_rows.index_select(0, index).view(n, kv_heads, max_c, dim).to(q.dtype)
        scores = torch.matmul(rows[s0:s1], keys.transpose(-1, -2)).float().mul_(scale)  # [n, KVH, G*Q, C]
        scores = scores.view(n, kv_heads, group, max_q, max_c)
        scores.masked_fill_(~meta.attn_mask[s0:s1].view(n, 1, 1, max_q, max_c), float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(values.dtype).view(n, kv_heads, group * max_q, max_c)
        out[s0:s1] = torch.matmul(weights, values)  # [n, KVH, G * Q, D]
    out = out.view(num_seqs, heads, max_q, dim).transpose(1, 2)  # [S, Q, H, D]
    return _flatten_output(out, meta)


def _invariant_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,  # one group
    scale: float,
) -> torch.Tensor:  # [T, H * D]
    queries, keys, values = _write_and_gather(q, k, v, k_cache, v_cache, meta)
    num_seqs, max_q, heads, dim = queries.shape
    kv_heads, max_c = keys.shape[2], keys.shape[1]
    padded_c = -(-max_c // _INVARIANT_KEY_TILE) * _INVARIANT_KEY_TILE
    mask = meta.attn_mask  # [S, 1, Q, C]
    if padded_c != max_c:
        pad = padded_c - max_c
        keys = F.pad(keys, (0, 0, 0, 0, 0, pad))  # zero keys, masked below
        values = F.pad(values, (0, 0, 0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=False)
    dtype = torch.bfloat16 if queries.dtype in (torch.bfloat16, torch.float16) else queries.dtype
    # Query heads grouped by the KV head they share: [S, KVH, G, Q, D].
    grouped = queries.to(dtype).permute(0, 2, 1, 3).view(num_seqs, kv_heads, heads // kv_heads, max_q, dim)
    # Contiguous operands: the matmul kernel for a strided (permuted) operand depends on the shapes.
    keys = keys.to(dtype).permute(0, 2, 1, 3).contiguous()  # [S, KVH, C', D]
    values = values.to(dtype).permute(0, 2, 1, 3).contiguous()  # [S, KVH, C', D]
    out = torch.empty_like(grouped)  # [S, KVH, G, Q, D]
    # Sequences and query rows are independent, so tiling them bounds the [.., Q, C'] scores of a
    # long prefill or of many decodes without changing any row's result.
    q_tile = min(max_q, INVARIANT_QUERY_TILE)
    s_tile = max(1, SCORE_TILE_ELEMENTS // (heads * q_tile * padded_c))
    # A tile of query rows takes only the keys they may see (a prompt's first rows not its last keys),
    # in whole key tiles: no row's result changes with zero-padded keys cut off (the premise above).
    # One SmolLM2 layer, a fresh prompt (EPYC VM): 484 tokens 5.2 -> 3.5 ms, 1024 tokens 21 -> 11 ms,
    # outputs bitwise the same (docs/bench/issue20-s34/invariant_prefill.py).
    tiles = [
        (q0, q1, min(padded_c, -(-end // _INVARIANT_KEY_TILE) * _INVARIANT_KEY_TILE))
        for q0, q1, end in meta.query_blocks(q_tile)
    ]
    for s0 in range(0, num_seqs, s_tile):
        s1 = min(s0 + s_tile, num_seqs)
        for q0, q1, seen in tiles:
            tile_keys, tile_values = keys[s0:s1], values[s0:s1]
            if seen < padded_c:
                tile_keys, tile_values = (
                    tile_keys[:, :, :seen].contiguous(),
                    tile_values[:, :, :seen].contiguous(),
                )
            out[s0:s1, :, :, q0:q1] = _invariant_rows(
                grouped[s0:s1, :, :, q0:q1], tile_keys, tile_values, mask[s0:s1, ..., q0:q1, :seen], scale
            )
    out = out.view(num_seqs, heads, max_q, dim).transpose(1, 2).to(q.dtype)  # [S, Q, H, D]
    return _flatten_output(out, meta)


def _invariant_rows(
    queries: torch.Tensor,  # [S, KVH, G, Qt, D]
    keys: torch.Tensor,  # [S, KVH, C', D] contiguous
    values: torch.Tensor,  # [S, KVH, C', D] contiguous
    mask: torch.Tensor,  # [S, 1, Qt, C'] bool
    scale: float,
) -> torch.Tensor:  # [S, KVH, G, Qt, D]
    num_seqs, kv_heads, group, rows, dim = queries.shape
    padded_c = keys.shape[2]
    flat = queries.reshape(num_seqs, kv_heads, group * rows, dim)  # a contiguous copy, rows (g, q)
    scores = torch.matmul(flat, keys.transpose(-1, -2))  # [S, KVH, G * Qt, C']
    scores = scores.float().mul_(scale).view(num_seqs, kv_heads, group, rows, padded_c)
    scores.masked_fill_(~mask.view(num_seqs, 1, 1, rows, padded_c), float("-inf"))
    weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # [S, KVH, G, Qt, C'] float32
    weights = weights.div_(weights.cumsum(dim=-1)[..., -1:])
    out = torch.matmul(weights.to(keys.dtype).view(num_seqs, kv_heads, group * rows, padded_c), values)
    return out.view(num_seqs, kv_heads, group, rows, dim)  # from [S, KVH, G * Qt, D]


@grouped
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


def select_attention_backend(
    device: torch.device | str, batch_invariant: bool = False
) -> tuple[str, AttentionBackend]:
    """Batch-invariant attention when asked (CPU); else on the CPU SDPA for prefill chunks and the
    paged-decode kernel for decodes and windows (`kernel_paged_attention`), or matmuls where the
    kernel cannot be built (`cpu_paged_attention`); on CUDA xformers if installed, else SDPA."""
    if batch_invariant:
        return "batch_invariant", batch_invariant_paged_attention
    kind = torch.device(device).type
    if kind == "cuda" and importlib.util.find_spec("xformers") is not None:
        return "xformers", xformers_paged_attention
    if kind == "cpu":
        kernel = default_paged_decode()
        if kernel is not None:
            return "cpu_sdpa_prefill_kernel_decode", kernel_paged_attention(kernel)
        return "cpu_sdpa_prefill_matmul_decode", cpu_paged_attention
    return "torch_sdpa", paged_attention
