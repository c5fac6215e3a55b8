"""The target's hidden states for head training, computed once per sequence by the engine's decoder.

A Medusa head reads what the engine hands the proposer: `CausalDecoder.forward`'s output, the
hidden state after the final norm, at the position that produced the last token. So the features are
that same output, from the same decoder the engine loads (specserve.engine.LLM), for every position
of a teacher-forced sequence, with no grad. They are kept in bfloat16 (what a bf16 target hands the
heads at inference, and half the memory), so that a second epoch costs only the heads.
"""

from __future__ import annotations

import time

import torch

from specserve.engine.models import CausalDecoder
from specserve.engine.runner import SequenceInput, forward_sequences, padded_num_slots

BLOCK_SIZE = 16


class FeatureCache:
    """Hidden states per sequence key, computed in ragged batches on first use."""

    def __init__(
        self, model: CausalDecoder, device: torch.device, kv_dtype: torch.dtype, max_bytes: int = 4 << 30
    ):
        self.model = model
        self.device = device
        self.kv_dtype = kv_dtype
        self.max_bytes = max_bytes  # past this, features are recomputed instead of kept
        self.features: dict[tuple[str, int], torch.Tensor] = {}  # key -> [len, hidden] bf16
        self.bytes = 0
        self.tokens_computed = 0  # target forward tokens (a cost measure for the report)
        self.seconds = 0.0
        self._kv = None
        self._kv_slots = 0

    def get(self, keys: list[tuple[str, int]], sequences: list[list[int]]) -> list[torch.Tensor]:
        """[len(seq), hidden] bf16 features for each sequence; the missing ones in one forward."""
        missing = [i for i, k in enumerate(keys) if k not in self.features]
        computed: dict[int, torch.Tensor] = {}
        if missing:
            start = time.perf_counter()
            rows = self._forward([sequences[i] for i in missing])
            for i, feats in zip(missing, rows, strict=True):
                computed[i] = feats
                if self.bytes + feats.numel() * feats.element_size() <= self.max_bytes:
                    self.features[keys[i]] = feats
                    self.bytes += feats.numel() * feats.element_size()
            self.seconds += time.perf_counter() - start
        return [computed[i] if i in computed else self.features[k] for i, k in enumerate(keys)]

    def _forward(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        blocks = [-(-len(s) // BLOCK_SIZE) for s in sequences]
        self._ensure_kv(sum(blocks) * BLOCK_SIZE)
        inputs, first = [], 0
        for seq, n in zip(sequences, blocks, strict=True):
            inputs.append(SequenceInput(seq, 0, list(range(first, first + n)), len(seq)))
            first += n
        hidden = forward_sequences(self.model, self._kv, inputs, BLOCK_SIZE, self.device)  # [T, hidden]
        self.tokens_computed += hidden.shape[0]
        return [h.to(torch.bfloat16).cpu() for h in hidden.split([len(s) for s in sequences])]

    def _ensure_kv(self, slots: int) -> None:
        """A private KV cache (the engine's stays untouched), grown to the largest batch seen."""
        if slots > self._kv_slots:
            self._kv = self.model.allocate_kv_cache(padded_num_slots(slots), self.kv_dtype, self.device)
            self._kv_slots = slots
