"""Run one model over a flat ragged batch with the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .models import CausalDecoder, KVCache


@dataclass
class SequenceInput:
    token_ids: list[int]  # the new tokens fed this step
    start_position: int  # absolute position of token_ids[0]; tokens before it are already cached
    block_ids: list[int]
    num_outputs: int  # hidden states wanted for the last `num_outputs` fed tokens
    context_start: int = 0  # attend to positions from here on (a draft head that skipped older ones)


def forward_sequences(
    model: CausalDecoder,
    kv_cache: KVCache,
    seqs: list[SequenceInput],
    block_size: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [sum(num_outputs), hidden]
    """Feed every sequence's new tokens through `model` in one forward.

    The cache's last slot is reserved for attention padding (see `padded_num_slots`)."""
    ids, positions, output_rows, meta = ragged_batch(
        seqs, block_size, device, pad_slot=kv_cache[0][0].shape[0] - 1
    )
    with torch.inference_mode():
        return model(ids, positions, kv_cache, meta, output_rows)


def ragged_batch(
    seqs: list[SequenceInput], block_size: int, device: torch.device | str, pad_slot: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The flat inputs of one forward over `seqs`: token ids [T], absolute positions [T], the flat rows
    whose outputs are wanted [sum(num_outputs)], and the attention metadata placing every token in its
    sequence and cache slots (also for a proposer's own one-layer forward, plugins/eagle.py)."""
    ids: list[int] = []
    positions: list[int] = []
    output_rows: list[int] = []
    for seq in seqs:
        start = len(ids)
        ids += seq.token_ids
        positions += range(seq.start_position, seq.start_position + len(seq.token_ids))
        output_rows += range(start + len(seq.token_ids) - seq.num_outputs, start + len(seq.token_ids))
    meta = AttentionMetadata.build(
        [len(s.token_ids) for s in seqs],
        [s.start_position + len(s.token_ids) for s in seqs],
        [s.block_ids for s in seqs],
        block_size,
        device,
        pad_slot=pad_slot,
        context_starts=[s.context_start for s in seqs] if any(s.context_start for s in seqs) else None,
    )
    return (
        torch.tensor(ids, device=device),
        torch.tensor(positions, device=device),
        torch.tensor(output_rows, dtype=torch.long, device=device),
        meta,
    )


def padded_num_slots(num_slots: int) -> int:
    """Slots to allocate for a KV cache of `num_slots` usable slots: one more, at the end, that no
    block covers. It is never written and stays zero; padded attention positions read it."""
    return num_slots + 1
