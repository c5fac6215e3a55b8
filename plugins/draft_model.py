"""Draft-model proposer: a smaller model of the same vocabulary guesses k tokens autoregressively.

Its KV lives in the same blocks as the target's (same block table, its own tensors). The proposer
remembers per request how many of its tokens are in the draft cache; a proposal first feeds whatever
is missing (the prompt the first time, then the last accepted tokens), then one token per further
draft step. `on_accepted` clamps that count to the verified length, which is the whole rollback:
stale slots beyond it are simply overwritten next time. `on_preempted` forgets it (the blocks are gone).
"""

from __future__ import annotations

import torch

from specserve.engine.builder import load_model
from specserve.engine.cost_profile import profile_draft_cost
from specserve.engine.memory import module_bytes
from specserve.engine.proposer import ProposalRequest, Proposals, Proposer, ProposerContext, ProposerError
from specserve.engine.random_streams import Purpose, RequestRandom
from specserve.engine.request import Request
from specserve.engine.row_routed_linear import float_copy_bytes
from specserve.engine.runner import SequenceInput, forward_sequences
from specserve.engine.sampler import draft_choices
from specserve.engine.spec_controller import Preview
from specserve.engine.step_cost_model import DraftCostProfile
from specserve.engine.tokenizer import Tokenizer


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        spec = ctx.config.draft
        if spec is None or spec.model_path is None:
            raise ProposerError("--speculative-method draft_model needs --draft-model-path")
        # The target is loaded already: on a shared device its weights count against the budget too.
        loaded = load_model(
            spec,
            ctx.config.cache_dir,
            memory_utilization=ctx.config.device_memory_utilization,
            resident_bytes=module_bytes(ctx.target) if spec.device == ctx.device else 0,
            what="the draft model's weights",
            # A quantized draft's catch-up on a prompt is many rows, which its kernels pay by the row.
            draft=True,
        )
        self.model = loaded.model
        self.device = spec.device
        self.dtype = spec.dtype
        self.block_size = ctx.block_size
        self.target_vocab = ctx.vocab_size
        _check_same_vocabulary(ctx.extra.get("tokenizer"), Tokenizer(loaded.directory), spec.model_path)
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._num_blocks = 0  # blocks of the bound KV cache
        # request id -> tokens [0, n) of the request are in the draft KV cache
        self._num_cached: dict[str, int] = {}

    def kv_bytes_per_token(self) -> int:
        return self.model.config.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)

    def weight_bytes(self) -> int:
        return module_bytes(self.model)

    def step_weight_bytes(self) -> int:
        # A draft step is a row per request: the quantized weights, not the float copies kept for
        # catch-ups on a prompt.
        return module_bytes(self.model) - float_copy_bytes(self.model)

    def bind_kv_cache(self, num_slots: int) -> None:
        self.kv_cache = self.model.allocate_kv_cache(num_slots, self.dtype, self.device)
        self._num_blocks = num_slots // self.block_size

    def profile_cost(self, max_requests: int) -> DraftCostProfile:
        return profile_draft_cost(
            self.model, self.kv_cache, self.block_size, self._num_blocks, self.device, max_requests
        )

    def preview(self, request: Request, max_drafts: int) -> Preview:
        """A model cannot tell its proposal for free, but it can tell what it must first feed: the
        tokens of the request its KV does not hold yet (the prompt, the first time)."""
        missing = request.num_tokens - self._num_cached.get(request.request_id, 0)
        return Preview(max_drafts, 0, setup_tokens=max(0, missing), stops_unsure=True)

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        # Draft KV past the target's verified length holds rejected drafts: mark it stale.
        rid = request.request_id
        if rid in self._num_cached:
            self._num_cached[rid] = min(self._num_cached[rid], request.num_computed_tokens)

    def on_preempted(self, request: Request) -> None:
        self._num_cached.pop(request.request_id, None)

    def on_finished(self, request: Request) -> None:
        self._num_cached.pop(request.request_id, None)

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        active = list(range(len(batch)))
        # Cached lengths after this proposal; stored only once every forward succeeded, so a failure
        # midway leaves the previous (still true) counts.
        num_cached = [self._num_cached.get(b.request.request_id, 0) for b in batch]
        # Per request the draft's own probability that every draft so far is accepted (the product
        # of its probabilities of its drafts): a window ends after the draft that takes it below
        # the request's stop_below (Preview.stops_unsure).
        chain = [1.0] * len(batch)
        step = 0
        while active:
            seqs = []
            for i in active:
                req = batch[i].request
                if step == 0:
                    start = num_cached[i]
                    tokens = req.all_token_ids[start:]
                else:
                    start = req.num_tokens + step - 1
                    tokens = [drafts[i][-1]]
                seqs.append(SequenceInput(tokens, start, req.block_ids, 1))
            hidden = forward_sequences(self.model, self.kv_cache, seqs, self.block_size, self.device)
            with torch.inference_mode():
                logits = self.model.compute_logits(hidden).cpu()[:, : self.target_vocab]  # [B, V]
            argmax, row_probs = draft_choices(logits, [batch[i].request.params for i in active])
            confidence = _greedy_confidence(logits, [batch[i].stop_below > 0 for i in active], row_probs)
            for row, i in enumerate(active):
                item = batch[i]
                dist = row_probs[row]
                if dist is None:  # greedy
                    token = argmax[row]
                    sure = confidence[row]
                else:
                    # Keyed by the output position this draft is for, so the same seed drafts the
                    # same token whatever the window or batch looks like.
                    token = _stream(item).sample(
                        dist, len(item.request.output_token_ids) + step, Purpose.DRAFT
                    )
                    probs[i].append(dist)
                    sure = float(dist[token]) if item.stop_below > 0 else None
                if sure is not None:
                    chain[i] *= sure
                drafts[i].append(token)
                num_cached[i] = item.request.num_tokens + step
            step += 1
            active = [
                i
                for i in active
                if len(drafts[i]) < batch[i].num_speculative_tokens and chain[i] >= batch[i].stop_below
            ]
        for item, n in zip(batch, num_cached, strict=True):
            self._num_cached[item.request.request_id] = n
        return Proposals(
            token_ids=drafts,
            probs=[torch.stack(p) if p else None for p in probs],
        )


def _greedy_confidence(
    logits: torch.Tensor, wanted: list[bool], row_probs: list[torch.Tensor | None]
) -> list[float | None]:
    """[B, V] logits -> per row the draft's probability of its argmax, for the greedy rows `wanted`
    (None elsewhere: a sampled row reads its own distribution, and rows without a stop need none).
    One logsumexp over the wanted rows, not a softmax over the vocabulary per row."""
    rows = [r for r, w in enumerate(wanted) if w and row_probs[r] is None]
    out: list[float | None] = [None] * len(wanted)
    if rows:
        picked = logits[torch.tensor(rows, dtype=torch.long)].float()  # [R, V]
        top = picked.max(dim=-1).values - torch.logsumexp(picked, dim=-1)  # [R] log p(argmax)
        for r, value in zip(rows, top.exp().tolist(), strict=True):
            out[r] = value
    return out


def _stream(item: ProposalRequest) -> RequestRandom:
    if item.random is None:
        raise ValueError(f"request {item.request.request_id}: sampled drafts need ProposalRequest.random")
    return item.random


def _check_same_vocabulary(target: Tokenizer | None, draft: Tokenizer, draft_path: str) -> None:
    """Draft and target must tokenize identically; extra padding rows in an embedding are fine."""
    if target is None:
        return
    t_vocab, d_vocab = target.hf.get_vocab(), draft.hf.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab.items()) - set(d_vocab.items()))
        only_d = len(set(d_vocab.items()) - set(t_vocab.items()))
        raise ProposerError(
            f"draft model {draft_path} does not share the target's vocabulary ({len(t_vocab)} vs"
            f" {len(d_vocab)} tokens; {only_t} target and {only_d} draft entries differ)"
        )
