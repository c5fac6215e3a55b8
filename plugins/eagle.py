"""EAGLE proposer: a one-layer head drafts k tokens autoregressively in the target's feature space.

The head and its checkpoint layout are in eagle_head.py. Per request the proposer keeps
- the target's features it has not fed yet: the engine hands over the final-normed hidden state of
  every position the target verified (`on_hidden_states`; prefill chunks and accepted drafts alike),
- how many pairs (f_i, x_{i+1}) are in the head's KV cache. That KV lives in the request's own blocks
  (one layer, its own tensors, the target's slots), like the draft model's, so it is sized with the
  pool and freed with the request.

A proposal first feeds the pairs that are missing (the prompt the first time, then the last window's
accepted tokens) and reads the head's prediction for the newest position; every further draft feeds
(predicted feature, drafted token). Only pairs built on the target's real features count as cached:
the slots past them hold the head's own guesses and are overwritten next time, which is the whole
rollback. With prefix caching the target computes no features for a cached prefix; the head then
keeps whatever its KV holds there (written by the request that filled those blocks) and starts from
the first feature it gets. That costs acceptance at most, never exactness.

A head that was off for a while (the controller gave its request no drafts) catches up on at most
`max_catch_up` positions, the newest, and attends only from there on: a probe then costs a few rows of
one layer, not one per token generated since the last probe, and a request's buffered features stay
bounded by its prompt plus `max_catch_up`. The prompt itself is always fed whole (a proposal right
after prefill is the common case and the head's context matters there).

Exactness: greedy drafts are the argmax; a sampled draft is drawn from q = softmax of the head's
logits under the request's sampling parameters, over the draft vocabulary when the head has one
(zero elsewhere), and q is what the proposer reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.memory import module_bytes
from specserve.engine.proposer import ProposalRequest, Proposals, Proposer, ProposerContext, ProposerError
from specserve.engine.random_streams import Purpose
from specserve.engine.request import Request
from specserve.engine.runner import SequenceInput, ragged_batch
from specserve.engine.sampler import draft_choices
from specserve.plugins.eagle_head import load_eagle_head

# Most pairs a proposal feeds to catch up after the request's decode steps went without drafts. Chosen
# to cover a few verification windows (the head's recent context) while keeping a probe well under a
# target step: 32 rows of one layer on Qwen2.5-1.5B is ~1/28 of a 32-row target forward.
MAX_CATCH_UP = 32


@dataclass
class _RequestFeatures:
    num_pairs: int = 0  # pairs (f_i, x_{i+1}) for i < num_pairs are in the head's KV cache
    start: int = 0  # position of features[0]
    features: list[torch.Tensor] = field(default_factory=list)  # consecutive [n, hidden] chunks
    context_start: int = 0  # the head attends to positions from here on (after a bounded catch-up)

    def end(self) -> int:
        return self.start + sum(f.shape[0] for f in self.features)


class EagleProposer(Proposer):
    name = "eagle"
    needs_all_hidden_states = True

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        path = ctx.config.speculative_head_path
        if not path:
            raise ProposerError("--speculative-method eagle needs --speculative-head-path")
        head, _, draft_ids = load_eagle_head(Path(path), ctx.target.config)
        self.head = head.to(device=ctx.device, dtype=ctx.dtype).eval().requires_grad_(False)
        self.head.layer.self_attn.rope = self.head.layer.self_attn.rope.to(ctx.device)
        embed = getattr(ctx.target, "embed_tokens", None)
        if not isinstance(embed, nn.Embedding):
            raise ProposerError(
                f"--speculative-method eagle: {type(ctx.target).__name__} has no token embedding"
            )
        self.embed = embed
        self.vocab_size = ctx.vocab_size
        self.block_size = ctx.block_size
        self.device = ctx.device
        self.dtype = ctx.dtype
        # [N] target ids of the draft vocabulary's rows; None: the target's whole vocabulary
        self.draft_ids = None if draft_ids is None else draft_ids.to(ctx.device)
        self._draft_lm = self._draft_lm_head(ctx.target)  # [N, hidden] or None (full LM head)
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._requests: dict[str, _RequestFeatures] = {}
        # Never fewer than two full windows: a request that drafts every step is never cut short.
        self.max_catch_up = max(MAX_CATCH_UP, 2 * ((ctx.config.num_speculative_tokens or 0) + 1))

    def _draft_lm_head(self, target: nn.Module) -> torch.Tensor | None:
        """The LM head's rows of the draft vocabulary (FR-Spec): the head then scores N tokens, not V."""
        if self.draft_ids is None:
            return None
        lm_head = getattr(target, "lm_head", None)
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            return None  # a quantized LM head: score the full vocabulary and pick the rows
        return weight.detach().index_select(0, self.draft_ids).contiguous()

    # --- memory ------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return self.head.arch.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)

    def weight_bytes(self) -> int:
        return module_bytes(self.head)

    def bind_kv_cache(self, num_slots: int) -> None:
        self.kv_cache = self.head.allocate_kv_cache(num_slots, self.dtype, self.device)

    # --- lifecycle ---------------------------------------------------------------------------------
    def on_hidden_states(self, request: Request, start_position: int, hidden: torch.Tensor) -> None:
        st = self._requests.setdefault(request.request_id, _RequestFeatures())
        if not st.features or st.end() != start_position:  # first chunk, or a gap (a cached prefix)
            st.features, st.start = [], start_position
        st.features.append(hidden.detach().to(self.dtype))
        behind = st.end() - max(st.num_pairs, st.start)  # pairs the next proposal would feed
        if behind > self.max_catch_up and st.end() > len(request.prompt_token_ids):
            # Past the prompt and off for a while: keep only the newest positions; older ones become
            # a gap the head no longer attends to (its KV there is stale or its own old guesses).
            end = st.end()
            st.features = [torch.cat(st.features)[-self.max_catch_up :]]  # [max_catch_up, hidden]
            st.start = st.context_start = end - self.max_catch_up

    def on_preempted(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)

    def on_finished(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)

    # --- drafting ----------------------------------------------------------------------------------
    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        # Requests whose features reach their last verified position (N - 2: the last token, N - 1,
        # has not been through the target yet).
        active = [i for i, b in enumerate(batch) if self._ready(b.request)]
        if not active:
            return Proposals(drafts, [None] * len(batch))
        firsts = {i: self._first_pairs(batch[i].request) for i in active}
        predicted: dict[int, torch.Tensor] = {}  # request index -> [hidden] f^ at its newest position
        step = 0
        while active:
            seqs = []
            for i in active:
                req = batch[i].request
                if step == 0:
                    start, feats, tokens = firsts[i]
                else:
                    start = req.num_tokens - 2 + step
                    feats, tokens = predicted[i].unsqueeze(0), [drafts[i][-1]]
                context_start = self._requests[req.request_id].context_start
                seqs.append((SequenceInput(tokens, start, req.block_ids, 1, context_start), feats))
            out = self._forward(seqs)  # [len(active), hidden]: f^ after each sequence's last pair
            logits = self._logits(out)  # [len(active), N or V] float32
            argmax, row_probs = draft_choices(logits, [batch[i].request.params for i in active])
            for row, i in enumerate(active):
                item = batch[i]
                predicted[i] = out[row]
                dist = row_probs[row]
                if dist is None:  # greedy
                    token = argmax[row]
                else:
                    if item.random is None:
                        raise ValueError(
                            f"request {item.request.request_id}: sampled drafts need ProposalRequest.random"
                        )
                    position = len(item.request.output_token_ids) + step  # keyed by output position
                    token = item.random.sample(dist, position, Purpose.DRAFT)
                    probs[i].append(self._to_target_vocab(dist))
                drafts[i].append(token if self.draft_ids is None else int(self.draft_ids[token]))
            step += 1
            active = [i for i in active if len(drafts[i]) < batch[i].num_speculative_tokens]
        for i in firsts:  # only now: a failure midway leaves the previous (still true) state
            req = batch[i].request
            st = self._requests[req.request_id]
            st.num_pairs, st.start, st.features = req.num_tokens - 1, req.num_tokens - 1, []
        return Proposals(drafts, [torch.stack(p) if p else None for p in probs])

    def _ready(self, req: Request) -> bool:
        st = self._requests.get(req.request_id)
        return st is not None and bool(st.features) and req.num_tokens >= 2 and st.end() == req.num_tokens - 1

    def _first_pairs(self, req: Request) -> tuple[int, torch.Tensor, list[int]]:
        """(first position, [n, hidden] features, n tokens): the pairs the head's KV is missing."""
        st = self._requests[req.request_id]
        features = torch.cat(st.features)  # positions [st.start, N - 1)
        start = max(st.num_pairs, st.start)  # a gap before st.start: a cached prefix (see above)
        last = req.num_tokens - 2  # the newest position with a real feature
        return start, features[start - st.start :], req.all_token_ids[start + 1 : last + 2]

    def _forward(self, seqs: list[tuple[SequenceInput, torch.Tensor]]) -> torch.Tensor:
        """(the pairs' tokens and positions, their [n, hidden] features) per request -> [B, hidden]:
        the head's prediction after each request's last pair."""
        pad_slot = self.kv_cache[0][0].shape[0] - 1
        inputs = [seq for seq, _ in seqs]
        ids, positions, last_rows, meta = ragged_batch(inputs, self.block_size, self.device, pad_slot)
        with torch.inference_mode():
            features = torch.cat([f.to(self.device) for _, f in seqs])  # [T, hidden]
            embeds = self.embed(ids).to(self.dtype)  # [T, hidden]
            out = self.head.forward_paged(embeds, features, positions, self.kv_cache[0], meta)
            return out.index_select(0, last_rows)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, hidden] -> [B, N or V] float32
        with torch.inference_mode():
            if self._draft_lm is not None:
                return F.linear(hidden, self._draft_lm).float()
            logits = self.ctx.target.compute_logits(hidden)[:, : self.vocab_size]
            return logits if self.draft_ids is None else logits.index_select(1, self.draft_ids)

    def _to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:  # [N] -> [V]
        """q over the whole vocabulary: the draft distribution, zero outside the draft vocabulary."""
        if self.draft_ids is None:
            return probs
        full = torch.zeros(self.vocab_size, dtype=probs.dtype, device=probs.device)
        full[self.draft_ids] = probs
        return full
