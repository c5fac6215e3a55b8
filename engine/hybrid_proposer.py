"""Several proposers behind one: per request per step, the one expected to get the most accepted.

`--speculative-method ngram,draft_model` builds each named proposer and this wrapper. Proposers are
listed cheapest first. Each step every proposer but the last is asked first (n-gram lookup is free);
a request takes the first proposal whose expected accepted length (its own recent acceptance with that
proposer, times the drafts it got) is at least what the next proposer is expected to give; the rest go
on down the list, so the draft model only runs for requests the cheap proposers could not serve well.

For a request the speculation controller decides (adaptive policy), that choice is made a step
earlier, in `preview`: the first proposer whose free preview satisfies the same rule is planned for
the request, and the preview says which proposer and which of its classes (an n-gram match of 4
tokens is accepted far more often than one of 1) the drafts will come from, so the controller
chooses k from that class's acceptance; `propose` then keeps to the plan. A proposer that cannot
preview (a draft model) ends the look-ahead: it is planned when reached, with the drafts asked for.

Each proposer's drafts keep their own distribution (one-hot for n-gram, q for a draft model), so the
verification stays exact whichever proposer a request's drafts came from. Every lifecycle hook goes
to every proposer: a draft model that skipped a request for a few steps catches up from its own
cached length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .proposer import ProposalRequest, Proposals, Proposer, ProposerContext
from .request import Request
from .spec_controller import Preview
from .step_cost_model import DraftCostProfile

INITIAL_ACCEPTANCE = 0.5  # a proposer's acceptance rate before a request has tried it
ACCEPTANCE_ALPHA = 0.3  # weight of the newest verification in a request's per-proposer rate
# Per step a proposer is not used for a request, its rate there drifts this far back to the
# proposer's global rate, so a proposer that failed once is tried again when content changes.
RECOVERY = 0.05
# A previewed class is reported as proposer index * HINT_STRIDE + the proposer's own class, so the
# controller keeps the n-gram match lengths and the draft model apart.
HINT_STRIDE = 1 << 16


def expected_accepted(rate: float, num_drafts: int) -> float:
    """Expected accepted drafts out of num_drafts when each is accepted with `rate` given the ones before."""
    return sum(rate**m for m in range(1, num_drafts + 1))


@dataclass
class _RequestChoice:
    proposer: int = -1  # index of the proposer whose drafts the request got this step, -1: none
    num_drafts: int = 0
    rates: dict[int, float] = field(default_factory=dict)  # proposer index -> acceptance rate
    planned: int = -1  # proposer index the last preview chose for the next proposal, -1: none


class HybridProposer(Proposer):
    def __init__(self, ctx: ProposerContext, proposers: list[Proposer]):
        if len(proposers) < 2:
            raise ValueError("a hybrid proposer needs at least two proposers")
        super().__init__(ctx)
        self.proposers = proposers
        self.name = ",".join(p.name for p in proposers)
        self.needs_hidden_states = any(p.needs_hidden_states for p in proposers)
        self.needs_all_hidden_states = any(p.needs_all_hidden_states for p in proposers)
        self._global = [INITIAL_ACCEPTANCE] * len(proposers)
        self._requests: dict[str, _RequestChoice] = {}

    def _rate(self, choice: _RequestChoice, index: int) -> float:
        return choice.rates.get(index, self._global[index])

    def _prefers(self, choice: _RequestChoice, index: int, num_drafts: int, max_drafts: int) -> bool:
        """Whether `num_drafts` drafts of proposer `index` are expected to get at least as many
        accepted as the next proposer's `max_drafts`."""
        here = expected_accepted(self._rate(choice, index), num_drafts)
        return here >= expected_accepted(self._rate(choice, index + 1), max_drafts)

    def preview(self, request: Request, max_drafts: int) -> Preview | None:
        choice = self._requests.setdefault(request.request_id, _RequestChoice())
        choice.planned = -1
        for index, proposer in enumerate(self.proposers):
            seen = proposer.preview(request, max_drafts)
            last = index == len(self.proposers) - 1
            if seen is None and not last:
                return None  # cannot tell what this one would give: decided in propose, as unplanned
            drafts = max_drafts if seen is None else seen.max_drafts
            if drafts > 0 and (last or self._prefers(choice, index, drafts, max_drafts)):
                choice.planned = index
                hint = index * HINT_STRIDE + (seen.hint if seen is not None else 0)
                if seen is None:
                    return Preview(drafts, hint)
                return Preview(drafts, hint, seen.drafts, seen.free, seen.setup_tokens, seen.stops_unsure)
        return Preview(0, 0)

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        token_ids: list[list[int]] = [[] for _ in batch]
        probs: list[torch.Tensor | None] = [None] * len(batch)
        planned: dict[int, int] = {}  # batch row -> proposer index its preview chose
        for i, item in enumerate(batch):
            choice = self._requests.setdefault(item.request.request_id, _RequestChoice())
            if choice.planned >= 0:
                planned[i], choice.planned = choice.planned, -1
        pending = list(range(len(batch)))
        for index, proposer in enumerate(self.proposers):
            asked = [i for i in pending if planned.get(i, index) == index]  # the others wait for theirs
            if not asked:
                continue
            last = index == len(self.proposers) - 1
            sub = [batch[i] for i in asked]
            for i in asked:  # give a stale rate its drift back towards the proposer's global rate
                choice = self._requests[batch[i].request.request_id]
                if index in choice.rates and choice.proposer != index:
                    choice.rates[index] += RECOVERY * (self._global[index] - choice.rates[index])
            result = proposer.propose(sub)
            still = [i for i in pending if planned.get(i, index) != index]
            for row, i in enumerate(asked):
                item = batch[i]
                choice = self._requests[item.request.request_id]
                drafts = list(result.token_ids[row]) if row < len(result.token_ids) else []
                if not drafts:
                    planned.pop(i, None)  # the plan gave nothing after all: the next proposers try
                    still.append(i)
                    continue
                unplanned = i not in planned
                if (
                    unplanned
                    and not last
                    and not self._prefers(choice, index, len(drafts), item.num_speculative_tokens)
                ):
                    still.append(i)
                    continue
                token_ids[i] = drafts
                probs[i] = result.probs[row] if result.probs else None
                choice.proposer, choice.num_drafts = index, len(drafts)
            pending = still
        for i in pending:
            self._requests[batch[i].request.request_id].proposer = -1
        return Proposals(token_ids=token_ids, probs=probs)

    # --- memory: every proposer's KV shares the request's slots -----------------------------------
    def kv_bytes_per_token(self) -> int:
        return sum(p.kv_bytes_per_token() for p in self.proposers)

    def weight_bytes(self) -> int:
        return sum(p.weight_bytes() for p in self.proposers)

    def step_weight_bytes(self) -> int:
        return sum(p.step_weight_bytes() for p in self.proposers)

    def bind_kv_cache(self, num_slots: int) -> None:
        for p in self.proposers:
            if p.kv_bytes_per_token() > 0:
                p.bind_kv_cache(num_slots)

    def profile_cost(self, max_requests: int) -> DraftCostProfile | None:
        """The proposers that timed themselves, added up (a lookup times nothing: its drafts are
        priced as free, Preview.free). None when none did, or when their counts differ."""
        profiles = [p for p in (q.profile_cost(max_requests) for q in self.proposers) if p is not None]
        if len(profiles) <= 1:
            return profiles[0] if profiles else None
        counts = {tuple(n for n, _ in p.step_seconds) for p in profiles}
        if len(counts) != 1:
            return None
        steps = tuple(
            (n, sum(p.step_seconds[i][1] for p in profiles)) for i, n in enumerate(next(iter(counts)))
        )
        return DraftCostProfile(steps, sum(p.catch_up_token_seconds for p in profiles))

    # --- lifecycle ----------------------------------------------------------------------------------
    def on_accepted(self, request: Request, num_accepted: int) -> None:
        choice = self._requests.get(request.request_id)
        if choice is not None and choice.proposer >= 0 and choice.num_drafts > 0:
            index, rate = choice.proposer, num_accepted / choice.num_drafts
            old = self._rate(choice, index)
            choice.rates[index] = old + ACCEPTANCE_ALPHA * (rate - old)
            self._global[index] += 0.05 * (rate - self._global[index])
            choice.proposer, choice.num_drafts = -1, 0
        for p in self.proposers:
            p.on_accepted(request, num_accepted)

    def on_hidden_states(self, request: Request, start_position: int, hidden: torch.Tensor) -> None:
        for p in self.proposers:
            if p.needs_all_hidden_states:
                p.on_hidden_states(request, start_position, hidden)

    def on_preempted(self, request: Request) -> None:
        for p in self.proposers:
            p.on_preempted(request)

    def on_finished(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        for p in self.proposers:
            p.on_finished(request)
