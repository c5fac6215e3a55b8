"""The target's hidden states for head training: exactly what the engine hands a draft head.

A Medusa head reads `ProposalRequest.last_hidden`: the target's hidden state after the final norm
(`CausalDecoder.forward`'s output) at the position that produced the request's last token. Two ways to
get the same thing for training text, both through the engine's own decoder:
- `HiddenStateRecorder`, a proposer that drafts nothing and keeps every `last_hidden` the engine gives
  it: the target's own answers (distillation) come with their features from the forward that generated
  them, so they cost no second pass.
- `FeatureCache`: one no-grad prefill forward per teacher-forced sequence (code), in ragged batches.
Features are kept in bfloat16 (what a bf16 target hands the heads at inference, and half the memory),
so that a second epoch costs only the heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specserve.engine.models import CausalDecoder
from specserve.engine.proposer import ProposalRequest, Proposals, Proposer, ProposerContext
from specserve.engine.request import Request
from specserve.engine.runner import SequenceInput, forward_sequences, padded_num_slots

BLOCK_SIZE = 16
RECORDER = "specserve.plugins.medusa_features:HiddenStateRecorder"  # as --speculative-method


@dataclass
class RecordedAnswer:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # [rows, hidden] bf16: row j produced output token j (position len(prompt) - 1 + j)
    features: torch.Tensor


class HiddenStateRecorder(Proposer):
    """Drafts nothing; records the hidden state behind every output token of every request. Run it
    under the static policy (the engine then calls `propose` at every decode step)."""

    name = "hidden_state_recorder"
    needs_hidden_states = True

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        self._live: dict[str, dict[int, torch.Tensor]] = {}  # request id -> output position -> [hidden]
        self._finished: list[RecordedAnswer] = []

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        for item in batch:
            if item.last_hidden is not None:
                # last_hidden produced the last output token: its index is the output length - 1.
                position = len(item.request.output_token_ids) - 1
                rows = self._live.setdefault(item.request.request_id, {})
                rows[position] = item.last_hidden.to(torch.bfloat16).cpu()
        return Proposals([[] for _ in batch], [None] * len(batch))

    def on_finished(self, request: Request) -> None:
        rows = self._live.pop(request.request_id, {})
        n = 0
        while n in rows:  # the contiguous prefix (the last step or two are never proposed for)
            n += 1
        if n:
            feats = torch.stack([rows[j] for j in range(n)])
            self._finished.append(
                RecordedAnswer(list(request.prompt_token_ids), list(request.output_token_ids), feats)
            )

    def pop_finished(self) -> list[RecordedAnswer]:
        out, self._finished = self._finished, []
        return out


class FeatureCache:
    """Feature rows per example key: precomputed ones put in, the rest computed in ragged batches on
    first use (rows from the example's start position on)."""

    def __init__(
        self, model: CausalDecoder, device: torch.device, kv_dtype: torch.dtype, max_bytes: int = 4 << 30
    ):
        self.model = model
        self.device = device
        self.kv_dtype = kv_dtype
        self.max_bytes = max_bytes  # past this, features are recomputed instead of kept
        self.features: dict[tuple[str, int], torch.Tensor] = {}  # key -> [rows, hidden] bf16
        self.bytes = 0
        self.tokens_computed = 0  # target forward tokens (a cost measure for the report)
        self.seconds = 0.0
        self._kv = None
        self._kv_slots = 0

    def put(self, key: tuple[str, int], features: torch.Tensor) -> None:
        self.features[key] = features
        self.bytes += features.numel() * features.element_size()

    def get(
        self, keys: list[tuple[str, int]], sequences: list[list[int]], starts: list[int]
    ) -> list[torch.Tensor]:
        """[len(seq) - start, hidden] bf16 features per sequence; the missing ones in one forward."""
        missing = [i for i, k in enumerate(keys) if k not in self.features]
        computed: dict[int, torch.Tensor] = {}
        if missing:
            began = time.perf_counter()
            rows = self._forward([sequences[i] for i in missing])
            for i, feats in zip(missing, rows, strict=True):
                computed[i] = feats[starts[i] :]
                if self.bytes + computed[i].numel() * computed[i].element_size() <= self.max_bytes:
                    self.put(keys[i], computed[i])
            self.seconds += time.perf_counter() - began
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
