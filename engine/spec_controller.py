"""The speculation controller: every step, for every running request, how many tokens to draft.

Pure Python (no torch): the scheduler calls it. Three parts, each replaceable on its own, each in
its own module:

- `AcceptanceModel` (engine/acceptance_model.py): per request and draft position, the chance that a
  draft is accepted given that the ones before it were; the tokens k drafts are expected to emit.
- `StepCostModel` (engine/step_cost_model.py): what a step costs given what it holds, from start-up
  profiles calibrated online per batch-size bucket, and what drafting steps delivered.
- `SpeculationController.choose`: the k vector that maximises expected emitted tokens per second of
  step time (goodput) under the token budget. k = 0 for a request, or the whole batch, when drafting
  does not pay. A request that is not drafting keeps learning: when its proposer previews the tokens
  it would draft (n-gram lookup), they are judged against the tokens the request emits next, which is
  what verifying them would have found (`_Shadow`), at no cost. Otherwise its estimate, where below
  every request's, drifts back up to it (`AcceptanceModel.relax`), and it is probed with one draft
  now and then (the interval doubles while probes fail), so a change of content switches it back on.
  Probes are paid from a budget: PROBE_BUDGET of the server's step time, so that when speculation
  never pays, probing it costs at most that share (a probe's price is the extra verification row plus
  what the proposer spent on the last probes, which includes a draft model's or head's catch-up).
  And a probe is bought only where its answer could change a decision: where the request's drafts,
  every one accepted, would join the plan chosen (see `choose`).

Requests under the static policy get their cap (today's behaviour); the controller optimises the
adaptive ones around them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .acceptance_model import RELAX_DECAY, AcceptanceModel, GainCalibration, expected_tokens
from .catch_up_payback import CatchUpPayback
from .step_cost_model import SETUP_MIN_TOKENS, Promise, StepCostModel, batch_bucket

# Plugin API (docs/plugins.md): a proposer's start-up timing is imported from here.
from .step_cost_model import DraftCostProfile as DraftCostProfile

FIRST_PROBE_INTERVAL = 8  # decode steps without drafts before the first probe
MAX_PROBE_INTERVAL = 128
# Share of the step time probes may cost: with speculation off for good, the server runs at least
# (1 - PROBE_BUDGET) of its speed without speculation. Without it, probing every request at its first
# decode step and then at 8, 16, 32... steps cost 3-4% at 8-32 clients on SmolLM2 (one extra row each).
PROBE_BUDGET = 0.01
# The budget saved while nobody needs a probe buys at most this many probes at once.
MAX_SAVED_PROBES = 2.0
# Drafting must beat not drafting by this much: the cost model's error should not turn into a loss.
MIN_GAIN = 1.02
# Drafting's margin over plain decode below which a stale plain price (StepCostModel.plain_is_stale)
# is measured again before drafting on (one step without drafts).
REFRESH_MARGIN = 1.25
# A catch-up is paid back over the drafting steps its request has next, and those run at the server's
# load, not at the batch of the step that caught up: at 4 Qwen-pair clients (AMD EPYC) a request left
# alone for a step between two waves (its wave finished, the next one's requests not yet admitted)
# was caught up on 52-494 tokens (0.32-1.18 s) by the payback of one-client cells (~45 tokens drafted
# after a catch-up), drafted once, and stopped drafting when the next wave made the batch 4 again;
# the policy's work came to 0.962x of off's over four pairs. So the payback record a catch-up is
# priced with and counted in is the bucket of the recent batch size (exponentially weighted, memory
# ~1 / LOAD_ALPHA steps), or of this step's batch where that is larger.
LOAD_ALPHA = 0.1
# A decision that cannot come out differently is not weighed again: after a decode-only step decided
# to draft nothing, probe nothing, with its best drafting plan under QUIET_HEADROOM of the bar, the
# next QUIET_STEPS steps of the same requests at the same batch draft nothing without being weighed
# (`quiet_decision`), as long as their previews bring no proposal that promises more than the best
# one of its kind the decision weighed (a longer n-gram match, a match where none was weighed) and no
# probe the savings pay for falls due. Previews still run, so undrafted proposals keep teaching their
# acceptance (_Shadow). What is left to change is that acceptance and the prices, and a plan 5% short
# (7% below plain decode's goodput, with MIN_GAIN) does not close in a few steps. Only where weighing
# costs QUIET_SHARE of a plain step or more: at 16 SmolLM2 sequences in one process (AMD EPYC)
# `choose` took 0.33 ms of a 29 ms step, its best drafting plan at 0.84-0.90 of the bar, while a
# Qwen-pair step of 100 ms or more has nothing worth a delay to save. Previews run in quiet steps
# because a step without any proposal starts a spell too: skipping them made one SmolLM2 request at a
# time 0.950x as fast, its lookups' next matches waiting out the spell (docs/bench/issue20-s46).
QUIET_HEADROOM = 0.95
QUIET_STEPS = 3
QUIET_SHARE = 0.005
# Memory of the controller's own time per decision (exponentially weighted).
DECIDE_ALPHA = 0.2


# --- the decision ----------------------------------------------------------------------------------
@dataclass
class Candidate:
    """A running request in decode this step."""

    request_id: str
    cap: int  # most drafts it may get (request cap, config K_max, tokens left, drafts available); 0 = none
    static: bool = False  # static policy: gets its cap, not optimised
    hint: int | None = None  # the proposal's class, from the proposer's free preview (None: no preview)
    drafts: tuple[int, ...] = ()  # the previewed proposal's tokens, when the proposer could tell them
    free: bool = False  # drafting it costs no model work (a lookup): no draft steps priced
    setup_tokens: int = 0  # tokens the proposer feeds before its first draft (Preview.setup_tokens)
    tokens_left: int | None = None  # output tokens the request may still emit (None: unknown)
    stops_unsure: bool = False  # its proposer can end a window where its chain turns unsure (Preview)


@dataclass(frozen=True)
class Preview:
    """What a proposer can tell about its next proposal for a request without drafting (n-gram
    lookup: whether the context has a match, how long it is, how many tokens follow it)."""

    max_drafts: int  # drafts it would propose now (0: none, so the request is not drafted or probed)
    hint: int  # the proposal's class: acceptance is estimated per class (n-gram: matched length)
    # The tokens it would propose, for a proposal that is one-hot and the same whenever it is asked
    # (n-gram lookup). The controller then learns their acceptance without drafting them: an undrafted
    # request's next tokens are what verification would have compared them with (see _Shadow).
    drafts: tuple[int, ...] = ()
    # Drafting it needs no model (n-gram lookup: ~0.2 ms against ~50 ms for a draft step of the Qwen
    # pair's 0.5B draft), so only its verification rows are priced. In a hybrid both kinds share one
    # step: priced alike, the lookups' near-zero times pulled the draft model's measured step cost
    # down by a third, and the draft model's price kept cheap matches from being drafted.
    free: bool = False
    # Tokens the proposer must feed before it can draft for the request: a draft model catching up on
    # what it has not seen (the prompt, the first time; everything since, after steps without drafts).
    # Priced once, spread over the drafting steps the request has left (at most the tokens requests
    # caught up at this batch size went on to draft, CatchUpPayback): at 8-32 clients the Qwen
    # pair's requests drafted now and then, and each time their draft caught up on hundreds of tokens
    # for one or two drafts, in a step that held every other request too (ITL p99 4-11 s vs 0.4-8 s).
    setup_tokens: int = 0
    # The proposer ends a window after the first draft at which the chance that every draft so far
    # is accepted, by its own probabilities, falls below the threshold the controller gives it
    # (ProposalRequest.stop_below): a draft model knows where it is unsure, the controller's
    # per-position estimate does not (see Decision.stop_below).
    stops_unsure: bool = False


@dataclass
class Decision:
    k: dict[str, int]  # request id -> drafts to propose (absent: 0)
    predicted_tokens: float  # expected tokens the decode requests emit
    predicted_seconds: float  # expected step time
    promise: Promise  # the same prediction, its parts kept apart
    probed: list[str] = field(default_factory=list)
    free: frozenset[str] = frozenset()  # requests whose drafts cost no draft steps (Preview.free)
    setup_tokens: int = 0  # catch-up tokens the drafting requests' proposals feed first
    static_drafts: bool = False  # some drafts were a static request's cap, not the controller's choice
    quiet: bool = False  # nothing weighed: a quiet spell's step (SpeculationController.quiet_decision)
    # Why it drafted what it did, for the step log (None in a quiet step): the best drafting plan's
    # goodput over the bar it had to clear (>= 1: a plan paid; 0: nothing to draft), how much more
    # than plain decode drafting had to promise at this batch (`required_gain`: MIN_GAIN x the
    # realized-goodput guard), and what the costly proposals' chosen drafts delivered against their
    # expectation (`GainCalibration.factor`, which scales that expectation).
    headroom: float | None = None
    required_gain: float | None = None
    gain_factor: float | None = None
    # Requests whose proposer ends their window where its own chain turns unsure (Preview.stops_unsure):
    # request id -> the chain probability below which the next draft costs more than it is expected
    # to earn (a draft's price x plain decode's goodput, _let_unsure_chains_end). Their k is raised to
    # their cap: the proposer, not the per-position estimate, decides where the window ends.
    stop_below: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Drafts:
    """What the static requests' drafts add up to: the adaptive ones are weighed on top of them."""

    tokens: int  # draft tokens (verification rows beyond each request's own)
    gain: float  # expected accepted tokens
    steps: int  # draft steps (the most any costly proposal takes)
    drafting: int  # requests whose proposals cost draft steps


@dataclass(frozen=True)
class _CatchUp:
    """A request's catch-up (Preview.setup_tokens), paid once before its first draft and charged to
    the drafting steps it pays for: a step that is expected to emit `e` of the request's `tokens_left`
    tokens bears e / tokens_left of it (all of it when it may finish the request). Charged by the
    drafts weighed, not by the most the request could draft: priced at its cap of 8 (expected 3.2
    tokens at 0.7 acceptance), a 480-token catch-up looked 26% dearer per step than at the 2-3 drafts
    that paid (2.1-2.5 tokens). A Qwen-pair request with that prompt ran 23 plain steps, then a probe
    caught up and its drafts were accepted at 0.96 (47 tokens in 13.6 s); charged by the drafts
    weighed, it drafted from its first decode step (11.5 s, in a slower spell of the machine;
    AVX-512 Xeon, one client). `tokens_left` is the most the request can pay it back with: its tokens
    left, or fewer where catch-ups at this batch size were followed by fewer drafted tokens
    (CatchUpPayback)."""

    seconds: float
    tokens_left: float

    def charge(self, expected_tokens: float) -> float:
        return self.seconds * min(1.0, expected_tokens / self.tokens_left)


@dataclass
class _ProbeState:
    steps_without_drafts: int = 0
    interval: int = FIRST_PROBE_INTERVAL


@dataclass
class _QuietSpell:
    """Steps that draft nothing without being weighed, after a decision that could not have gone
    otherwise (QUIET_HEADROOM): for these requests, at this batch size, while their proposals promise
    no more than the best one that decision weighed."""

    proposals: dict[str, tuple[int | None, int, bool]]  # request id -> (class, cap, free) weighed
    # The most tokens a proposal weighed was expected to emit, by kind (free or not; 1 for a kind
    # none was of: a free proposal costs less than a draft model's of the same promise).
    best_expected: dict[bool, float]
    num_sequences: int
    steps_left: int


@dataclass
class _Shadow:
    """A previewed proposal that was not drafted, judged against the tokens the request emits next.

    For a one-hot draft d the rejection sampler accepts d with probability p(d) (the target's
    probability after the accepted prefix), and the target's own next token is d with the same
    probability, greedy or sampled. So comparing the previewed drafts with the next emitted tokens is
    a verification the step did not pay for: a request that is not drafting keeps learning the
    acceptance of each class of its proposals, without probes. Before shadows, a request whose content
    differed from everyone's (math answers: a 1-token n-gram match accepted ~0.37 against ~0.21 over
    all answers) was judged by the global rates until probes, a few per request, corrected them."""

    hint: int | None
    drafts: tuple[int, ...]
    matched: int = 0  # drafts already equal to emitted tokens


class SpeculationController:
    def __init__(
        self,
        k_max: int,
        cost: StepCostModel,
        acceptance: AcceptanceModel | None = None,
        quiet_share: float = QUIET_SHARE,
    ):
        self.k_max = k_max
        self.cost = cost
        self.acceptance = acceptance or AcceptanceModel(k_max)
        self._probes: dict[str, _ProbeState] = {}
        self._probe_savings = 0.0  # seconds of step time saved up for probes (see _probe)
        self._hints: dict[str, int | None] = {}  # request id -> class of its drafts this step
        self._previewed: dict[str, tuple[int, ...]] = {}  # request id -> previewed drafts this step
        self._shadows: dict[str, list[_Shadow]] = {}  # request id -> undrafted previews being judged
        # What chosen drafts delivered against their expectation (GainCalibration), for costly
        # proposals (False) and free ones (True); and this step's chosen requests' rates to judge.
        self.gain_calibration = {False: GainCalibration(), True: GainCalibration()}
        self._chosen: dict[str, tuple[list[float], bool, float]] = {}  # rates, free, own share
        self.payback = CatchUpPayback()
        self._load: float | None = None  # recent batch size (LOAD_ALPHA)
        self.quiet_share = quiet_share
        self._decide_seconds: float | None = None  # what `choose` takes (DECIDE_ALPHA)
        self._quiet: _QuietSpell | None = None
        self._savings_cap = 0.0  # the last `_probe`'s cap on the probe savings

    def choose(
        self,
        candidates: Sequence[Candidate],
        num_sequences: int,
        base_tokens: int,
        token_budget: int,
    ) -> Decision:
        """k per candidate for a step that also runs `base_tokens` tokens over `num_sequences`
        sequences (every decode request's last token and any prefill chunks), with at most
        `token_budget` draft tokens in all."""
        start = time.perf_counter()
        decision, headroom = self._decide(candidates, num_sequences, base_tokens, token_budget)
        took = time.perf_counter() - start
        self._decide_seconds = (
            took
            if self._decide_seconds is None
            else self._decide_seconds + DECIDE_ALPHA * (took - self._decide_seconds)
        )
        quiet = (
            headroom < QUIET_HEADROOM
            and base_tokens == num_sequences == len(candidates)
            and not decision.probed
            and not any(decision.k.values())
            and not any(c.static for c in candidates)
            and self._decide_seconds
            >= self.quiet_share * self.cost.step_seconds(num_sequences, num_sequences, 0, 0)
        )
        self._quiet = None
        if quiet:
            proposals = {c.request_id: (c.hint, c.cap, c.free) for c in candidates}
            best: dict[bool, float] = {}
            for c in candidates:
                best[c.free] = max(best.get(c.free, 1.0), self._expected(c))
            self._quiet = _QuietSpell(proposals, best, num_sequences, QUIET_STEPS)
        return decision

    def _expected(self, c: Candidate) -> float:
        """Tokens a verification of the candidate's proposal is expected to emit, drafted in full."""
        if c.cap <= 0:
            return 1.0
        return expected_tokens(self.acceptance.rates(c.request_id, None, c.hint), min(c.cap, self.k_max))

    def quiet_decision(
        self, candidates: Sequence[Candidate], num_sequences: int, base_tokens: int
    ) -> Decision | None:
        """No drafts, without weighing, for a decode-only step of a quiet spell's requests and batch
        (QUIET_HEADROOM) whose proposals are those its decision weighed or promise no more than the
        best of them; None where the step must be weighed (`choose`). What a weighed step without
        drafts keeps up is kept up: the recent load, the previews to judge, probe states' steps
        without drafts, the probe savings, and the promise its time is judged against."""
        spell = self._quiet
        if (
            spell is None
            or spell.steps_left <= 0
            or not (base_tokens == num_sequences == spell.num_sequences == len(candidates))
        ):
            return None
        for c in candidates:
            weighed = spell.proposals.get(c.request_id)
            if weighed is None or c.static:
                return None
            changed = c.cap > 0 and (c.hint != weighed[0] or c.cap > weighed[1] or c.free != weighed[2])
            # A proposal the decision did not weigh (a new n-gram match, a longer one): weighed, unless
            # it promises no more than the best one of its kind that did not pay.
            if changed and self._expected(c) > spell.best_expected.get(c.free, 1.0):
                return None
        previewed = {c.request_id: c.drafts[: c.cap] for c in candidates if c.cap > 0 and c.drafts}
        counted = [
            (c, self._probes[c.request_id])
            for c in candidates
            if c.cap > 0 and c.request_id not in previewed and c.request_id in self._probes
        ]
        seconds = self.cost.step_seconds(num_sequences, base_tokens, 0, 0, 0)
        savings = self._savings_after(seconds, self._savings_cap)
        for c, state in counted:
            due = state.steps_without_drafts + 1 >= state.interval
            if due and self._probe_price(c, num_sequences, base_tokens, c.free) <= savings:
                return None  # a probe the savings pay for is due: `_probe` decides it
        spell.steps_left -= 1
        for _, state in counted:
            state.steps_without_drafts += 1
        self._note_load(num_sequences)
        self._hints = {c.request_id: c.hint for c in candidates}
        self._previewed, self._chosen = previewed, {}
        self._probe_savings = savings
        promise = Promise(float(num_sequences), seconds)
        k = {c.request_id: 0 for c in candidates}
        self._age_unchosen(candidates, costly_chosen=False)
        self._relax_unjudged(candidates, k)
        return Decision(k, promise.predicted_tokens(self._gain_factors()), seconds, promise, quiet=True)

    def _relax_unjudged(self, candidates: Sequence[Candidate], k: dict[str, int]) -> None:
        """A request's costly proposal that this step neither drafts nor judges from a preview
        (_Shadow): an estimate of it below its class's global rate drifts up (RELAX_DECAY). Lookups
        are judged from their previews whenever they have a proposal."""
        for c in candidates:
            unjudged = c.cap > 0 and not k.get(c.request_id) and c.request_id not in self._previewed
            if unjudged and not (c.static or c.free):
                self.acceptance.relax(c.request_id, c.hint, RELAX_DECAY)

    def _age_unchosen(self, candidates: Sequence[Candidate], costly_chosen: bool) -> None:
        """Costly proposals (a draft model's) that adaptive requests had this step, none of them
        chosen: their gain calibration forgets a step's worth (GainCalibration.age). Free ones
        (lookups) are left alone: their previews keep teaching their acceptance while undrafted, and
        where their drafting steps only break even (4-8 SmolLM2 clients) a calibration held low is
        the caution that keeps them from costing. Aged too, two runs there put the policy's work at
        0.951 / 0.982 of off's at 4 clients and 0.964 / 0.980 at 8, against 0.987 / 0.982 in a run
        without it back to back with the second (s47: 0.979-0.990 / 0.984): not shown to cost, not
        shown not to (docs/bench/issue20-s49)."""
        if costly_chosen:
            return
        if any(c.cap > 0 and not c.static and not c.free for c in candidates):
            self.gain_calibration[False].age()

    def _note_load(self, num_sequences: int) -> None:
        self._load = (
            float(num_sequences)
            if self._load is None
            else self._load + LOAD_ALPHA * (num_sequences - self._load)
        )

    def _decide(
        self,
        candidates: Sequence[Candidate],
        num_sequences: int,
        base_tokens: int,
        token_budget: int,
    ) -> tuple[Decision, float]:
        """`choose`'s decision, and the best drafting plan's goodput over the bar it had to clear
        (0 when there was nothing to draft)."""
        k = {c.request_id: 0 for c in candidates}
        self._note_load(num_sequences)
        priors = {h: self.acceptance.global_rate(h) for h in {c.hint for c in candidates}}
        rates = {
            c.request_id: self.acceptance.rates(c.request_id, priors[c.hint], c.hint) for c in candidates
        }
        self._hints = {c.request_id: c.hint for c in candidates}
        self._previewed = {
            c.request_id: c.drafts[: c.cap] for c in candidates if not c.static and c.cap > 0 and c.drafts
        }
        budget = max(0, token_budget)
        # Static requests first: their drafts are fixed, the adaptive ones are chosen around them.
        tokens, gain, max_steps, drafting = 0, 0.0, 0, 0
        for c in candidates:
            if c.static and c.cap > 0:
                n = min(c.cap, budget - tokens)
                if n > 0:
                    k[c.request_id] = n
                    tokens += n
                    gain += expected_tokens(rates[c.request_id], n) - 1.0
                    max_steps, drafting = max(max_steps, n), drafting + 1
        free = frozenset(c.request_id for c in candidates if c.free and not c.static)
        # What the controller's drafts of each kind delivered against their expectation (<= 1).
        factors = self._gain_factors()  # (costly, free): indexed by whether a request's proposal is free
        factor = {rid: factors[rid in free] for rid in k}
        # Every adaptive draft slot, by its marginal expected tokens (non-increasing along a request,
        # so any prefix of this order gives each request a prefix of its drafts).
        slots: list[tuple[float, int, str]] = []
        for c in candidates:
            if not c.static and c.cap > 0:
                p = 1.0
                for j, a in enumerate(rates[c.request_id][: min(c.cap, self.k_max)]):
                    p *= a
                    slots.append((p * factor[c.request_id], j, c.request_id))
        slots.sort(key=lambda s: (-s[0], s[1]))
        fixed = _Drafts(tokens, gain, max_steps, drafting)
        n_decode = len(candidates)

        # The step's price by (tokens, drafting requests, draft steps): a handful of distinct
        # shapes, asked for once per slot of every plan weighed (see the catch-ups below).
        prices: dict[tuple[int, int, int], float] = {}
        # Drafts are weighed by what they add to the step against what plain decode steps of this
        # batch emit in that time, so a step that also prefills is priced as the decode step it
        # would be (its decode requests' share of one) plus what the drafts add to a decode step.
        # By its own tokens per second a prefill step is slow, and any drafts that beat it looked
        # worth it: at 16-32 Qwen-pair clients (AMD EPYC) steps with prompts admitted took catch-ups
        # of thousands of tokens whose drafts emitted fewer tokens a second than plain decode steps
        # did. And a draft row costs there what it costs in a decode step, not what a prompt's token
        # does (SmolLM2 bf16 at 16-32 clients on the EPYC VM: ~1.9 ms against ~2.0-2.2 in decode
        # steps and ~1.0 for a prompt's token; priced along the prefill steps' curve, drafts there
        # cost half their price).
        plain_seconds = self.cost.step_seconds(num_sequences, num_sequences, 0, 0)
        offset = plain_seconds * n_decode / max(num_sequences, 1) - plain_seconds

        pricer = self.cost.step_pricer(num_sequences)

        def goodput(tokens: int, drafting: int, steps: int, gain: float, setup: float) -> float:
            shape = (tokens, drafting, steps)
            seconds = prices.get(shape)
            if seconds is None:
                seconds = pricer(num_sequences + tokens, drafting, steps) + offset
                prices[shape] = seconds
            return (n_decode + gain) / max(seconds + setup, 1e-9)

        # A catch-up of a few tokens is the proposal's own first forward (what the last step
        # accepted), already in a draft step's price.
        catch_ups = {
            c.request_id: self._catch_up(c, num_sequences)
            for c in candidates
            if c.setup_tokens >= SETUP_MIN_TOKENS and not c.static and c.request_id not in free
        }

        # The best goodput any plan with drafts reached (QUIET_HEADROOM), over the plans weighed.
        drafting_top = [0.0]

        def best_prefix(order: list[tuple[float, int, str]]) -> tuple[float, int]:
            """(goodput, length) of the best prefix of `order` within the token budget."""
            tokens, gain, steps, drafting, setup = fixed.tokens, fixed.gain, fixed.steps, fixed.drafting, 0.0
            drafting_adaptive: set[str] = set()
            expected: dict[str, float] = {}  # request id -> expected tokens of its slots so far
            best, best_n = goodput(tokens, drafting, steps, gain, setup), 0
            top = 0.0
            for n, (p, j, rid) in enumerate(order, start=1):
                if tokens >= budget:
                    break
                tokens += 1
                gain += p
                if rid not in free:  # a free proposal's slot adds its row, no draft step
                    if rid not in drafting_adaptive:  # static requests are never in `slots`
                        drafting += 1
                        drafting_adaptive.add(rid)
                    steps = max(steps, j + 1)
                    catch_up = catch_ups.get(rid)
                    if catch_up is not None:  # its charge grows with the tokens its slots expect
                        before = expected.get(rid)
                        expected[rid] = (before or 1.0) + p
                        setup += catch_up.charge(expected[rid])
                        setup -= catch_up.charge(before) if before is not None else 0.0
                g = goodput(tokens, drafting, steps, gain, setup)
                top = max(top, g)
                if g > best:
                    best, best_n = g, n
            drafting_top[0] = max(drafting_top[0], top)
            return best, best_n

        no_adaptive_drafts = goodput(fixed.tokens, fixed.drafting, fixed.steps, fixed.gain, 0.0)

        def best_plan(order: list[tuple[float, int, str]]) -> tuple[float, int, list[tuple[float, int, str]]]:
            """(goodput, length, order) of the best prefix over the candidate orders of these slots. By
            marginal tokens alone a draft model's slot can come before a free one of the same value,
            and every prefix then pays a draft step; the free slots first is the other order."""
            orders = [order]
            if free and len(free) < len({rid for _, _, rid in order}):
                orders.append([s for s in order if s[2] in free] + [s for s in order if s[2] not in free])
            return max(((*best_prefix(o), o) for o in orders), key=lambda b: b[0])

        # A request whose catch-up does not pay even with the best drafts it could get on its own is
        # left out of the first plan: in the order of marginal tokens its first slot comes in with the
        # others' and its charge would sink every prefix after it. But one draft step serves every
        # drafting request, so a catch-up can pay where the step is shared and not where its request
        # bears the step alone: judged alone only, requests that all had to catch up (a draft model
        # that has seen none of them) never started drafting together. So a second plan takes them
        # all back in, less each one whose charge it is no worse without (dearest per token left
        # first, one pass), and the better plan is drafted.
        required_gain = self.required_gain(num_sequences)
        bar = no_adaptive_drafts * required_gain
        own: dict[str, list[tuple[float, int, str]]] = {}  # request id -> its slots, in order
        for sl in slots:
            own.setdefault(sl[2], []).append(sl)
        shared = [rid for rid in catch_ups if best_prefix(own.get(rid, []))[0] < bar]
        best, best_n, order = best_plan([sl for sl in slots if sl[2] not in shared])
        if shared:
            together, plan = slots, best_plan(slots)
            for rid in sorted(shared, key=lambda r: -catch_ups[r].seconds / catch_ups[r].tokens_left):
                if any(sl[2] == rid for sl in plan[2][: plan[1]]):  # one outside the plan charges nothing
                    without = [sl for sl in together if sl[2] != rid]
                    fewer = best_plan(without)
                    if fewer[0] >= plan[0]:
                        together, plan = without, fewer
            if plan[0] > best:
                best, best_n, order = plan
        # A catch-up is paid now and earns its price back over the request's drafting steps, so it is
        # only as good as the price of those steps. Until drafting steps of this batch size were timed
        # (StepCostModel.drafting_timed) that price rests on the profile's shape, one sequence's: at
        # 16 Qwen-pair sequences on the AVX-512 Xeon, 11 requests caught up on 601 tokens in one step
        # (10.7 s), the next drafting step took 4.8 s where 3.0 s was predicted, drafting stopped, and
        # the catch-ups were never paid back (the session before saw 12 in one step, 6.6 s). There, a
        # step takes one catch-up at most: the one the plan gains most with, the others wait (and
        # probes, which pay their own catch-ups, bring requests in one at a time meanwhile).
        if not self.cost.drafting_timed(num_sequences):
            paying = [rid for rid in catch_ups if any(sl[2] == rid for sl in order[:best_n])]
            if len(paying) > 1:
                best, best_n, order = max(
                    (
                        best_plan([sl for sl in order if sl[2] == keep or sl[2] not in paying])
                        for keep in paying
                    ),
                    key=lambda b: b[0],
                )
        headroom = drafting_top[0] / bar if bar > 0 else 0.0  # before `could_pay` weighs certain drafts
        # A thin margin may rest on a stale plain price (StepCostModel.plain_is_stale), any margin on a
        # plain price never measured, and any on a plain price above the drafting steps' own
        # (StepCostModel.plain_is_behind): one step without drafts measures it. Only a step that is
        # plain without them does.
        refresh = (
            best_n > 0
            and fixed.tokens == 0
            and base_tokens == num_sequences
            and (
                (
                    (best < bar * REFRESH_MARGIN or not self.cost.plain_is_measured(num_sequences))
                    and self.cost.plain_is_stale(num_sequences)
                )
                or self.cost.plain_is_behind(num_sequences)
            )
        )
        if best < bar or refresh:
            best_n = 0
        chosen: dict[str, int] = {}
        for _, j, rid in order[:best_n]:
            chosen[rid] = max(chosen.get(rid, 0), j + 1)
        k.update(chosen)
        self._chosen = {
            rid: (rates[rid], rid in free, self.acceptance.own_share(rid, self._hints.get(rid)))
            for rid in chosen
        }
        self._age_unchosen(candidates, costly_chosen=any(rid not in free for rid in chosen))

        # A probe only refreshes an estimate, so it is worth its price only where some estimate could
        # make the optimiser draft for its request: if the plan drafted would not take the request's
        # drafts even were every one of them accepted, no answer the probe brings changes a decision.
        # Judged without the request's catch-up: the probe feeds it (out of the probe budget), so
        # later drafts do not pay it again. At 16-32 Qwen-pair clients (AMD EPYC) nothing drafted and
        # the probes, each feeding the draft a prompt, were all the policy cost (work 0.989-0.993x of
        # off's, the PROBE_BUDGET share).
        drafted_slots, threshold = order[:best_n], (best if best_n > 0 else bar)
        # The answer is the same for every request of the same cap and kind (its id only names its
        # slots, and its slots' value is its kind's gain calibration), so it is asked once a step per
        # pair (at 32 Qwen-pair clients one plan weighed a step instead of one a request); a free
        # proposal keeps its own id (its slots add no draft step).
        answers: dict[tuple[int, bool], bool] = {}

        def could_pay(c: Candidate) -> bool:
            is_free = c.request_id in free
            key = (min(c.cap, self.k_max), is_free)
            if key not in answers:
                rid = c.request_id if is_free else "\0probe"  # an id no catch-up is kept under
                certain = [(factors[is_free], j, rid) for j in range(key[0])]
                merged = sorted(drafted_slots + certain, key=lambda s: (-s[0], s[1]))
                g, n = best_prefix(merged)
                answers[key] = g > threshold and any(r == rid for _, _, r in merged[:n])
            return answers[key]

        probed = [] if refresh else self._probe(candidates, k, num_sequences, base_tokens, free, could_pay)
        self._relax_unjudged(candidates, k)
        for c in candidates:  # probes' catch-ups too: drafting may go on after them, for free
            caught_up = c.setup_tokens >= SETUP_MIN_TOKENS and c.request_id not in free
            if caught_up and k[c.request_id] > 0 and not c.static:
                self.payback.caught_up(c.request_id, self._payback_bucket(num_sequences))
        setup = sum(c.setup_tokens for c in candidates if k[c.request_id] > 0 and c.request_id not in free)
        prefill = max(0, base_tokens - n_decode)  # prompt tokens: the rest are one per decode request
        seconds = self.step_seconds(num_sequences, base_tokens, k, free, prefill)
        seconds += self.cost.setup_seconds(setup)
        unscaled, drafted = 0.0, [0.0, 0.0]  # tokens no calibration scales; chosen drafts', by kind
        for rid in k:
            extra = expected_tokens(rates[rid], k[rid]) - 1.0
            if rid in chosen:
                unscaled += 1.0
                drafted[rid in free] += extra
            else:
                unscaled += 1.0 + extra
        promise = Promise(unscaled, seconds, (drafted[0], drafted[1]))
        static = any(c.static and k[c.request_id] > 0 for c in candidates)
        predicted = promise.predicted_tokens(factors)
        # The bar and calibration this decision used: read after it, the step's ageing
        # (_age_unchosen) would have moved both by a decay.
        decision = Decision(
            k,
            predicted,
            seconds,
            promise,
            probed,
            free,
            setup,
            static,
            headroom=headroom,
            required_gain=required_gain,
            gain_factor=factors[0],
        )
        self._let_unsure_chains_end(decision, candidates, chosen, num_sequences, offset, budget)
        return decision, headroom

    def _let_unsure_chains_end(
        self,
        decision: Decision,
        candidates: Sequence[Candidate],
        chosen: dict[str, int],
        num_sequences: int,
        offset: float,
        budget: int,
    ) -> None:
        """Chosen costly windows whose proposer ends them where its chain turns unsure: each gets the
        threshold, and its k raised to its cap within the token budget. One more draft of chain
        probability p is worth drafting where p > its price x the step's goodput (tokens a second):
        (tokens + p) / (seconds + price) > tokens / seconds. The price is a draft's in a window of
        the cap at this batch size (drafts 2..cap: the first one's own forward is paid either way);
        the goodput is plain decode's, the floor a drafting step must beat. Not the plan's own: its
        estimate learns from windows that ended where the draft was sure, so it rose with the stop,
        and with it the threshold: at batch 1 on the Qwen pair the plans went to k = 8 promising
        ~9 tokens, the threshold to a median 0.70, and math and code windows ended at 5 drafts
        where static K = 7-8 emitted ~7 (0.88x / 0.92x of it; docs/bench/issue20-s52). On s44's
        traces windows to the cap ending below a fixed chain probability of 0.1-0.3 ran
        1.02-1.04x the best static K, where the estimate's k ran 0.98x."""
        unsure = [
            c for c in candidates if c.stops_unsure and c.request_id in chosen and not c.free and not c.static
        ]
        if not unsure:
            return
        k = decision.k
        pricer = self.cost.step_pricer(num_sequences)
        plain = pricer(num_sequences, 0, 0) + offset
        room = max(0, budget - sum(k.values()))
        for c in unsure:
            rid, cap = c.request_id, min(c.cap, self.k_max)
            extra = min(room, max(0, cap - k[rid]))
            k[rid] += extra
            room -= extra
            window = max(k[rid], 2)
            price = (pricer(num_sequences + window, 1, window) - pricer(num_sequences + 1, 1, 1)) / (
                window - 1
            )
            decision.stop_below[rid] = min(1.0, max(0.0, price) * len(candidates) / max(plain, 1e-9))

    def _catch_up(self, c: Candidate, num_sequences: int) -> _CatchUp:
        tokens_left: float = max(1, c.tokens_left or 1)
        horizon = self.payback.horizon(self._payback_bucket(num_sequences))
        if horizon is not None:
            tokens_left = max(1.0, min(tokens_left, horizon))
        return _CatchUp(self.cost.setup_seconds(c.setup_tokens), tokens_left)

    def _payback_bucket(self, num_sequences: int) -> int:
        """The batch bucket whose payback record prices a catch-up now (LOAD_ALPHA)."""
        return batch_bucket(max(num_sequences, round(self._load or 0.0)))

    def step_seconds(
        self,
        num_sequences: int,
        base_tokens: int,
        k: dict[str, int],
        free: frozenset[str] = frozenset(),
        prefill_tokens: int | None = None,
    ) -> float:
        """The cost model's price of a step with these drafts (free ones add rows, no draft steps)."""
        drafts = [v for v in k.values() if v > 0]
        costly = [v for rid, v in k.items() if v > 0 and rid not in free]
        return self.cost.step_seconds(
            num_sequences, base_tokens + sum(drafts), len(costly), max(costly, default=0), prefill_tokens
        )

    def _probe(
        self,
        candidates: Sequence[Candidate],
        k: dict[str, int],
        num_sequences: int,
        base_tokens: int,
        free: frozenset[str],
        could_pay: Callable[[Candidate], bool],
    ) -> list[str]:
        """One draft, now and then, for a request the optimiser gave none: its acceptance estimate
        may be stale (content changes) or only a prior. A request is due for a probe after `interval`
        steps without drafts; the interval doubles with every probe and starts over once the optimiser
        itself gives the request drafts again. Due requests are probed while the probe budget (a
        PROBE_BUDGET share of every step's predicted time, saved up) pays their price: requests without
        a verification of their own first, then the longest overdue. A due request whose drafts
        `could_pay` says would not be drafted at any acceptance stays due, unprobed, until they could
        (the batch shrinks, the machine's prices change)."""
        due: list[tuple[Candidate, _ProbeState]] = []
        for c in candidates:
            state = self._probes.get(c.request_id)
            if state is None:
                # A request with no verification of its own is due on its first decode step if the
                # optimiser gives it nothing: the global estimate it starts from may come from other
                # content, and only probes refresh it.
                unknown = not self.acceptance.has_observations(c.request_id)
                state = _ProbeState(steps_without_drafts=FIRST_PROBE_INTERVAL - 1 if unknown else 0)
                self._probes[c.request_id] = state
            if c.cap <= 0:  # nothing to draft (a preview found no proposal, no tokens left): not counted
                continue
            if c.request_id in self._previewed:  # learned from its shadows (_Shadow): no probe needed
                continue
            if k[c.request_id] > 0:
                state.steps_without_drafts = 0
                state.interval = FIRST_PROBE_INTERVAL
                continue
            state.steps_without_drafts += 1
            if state.steps_without_drafts >= state.interval:
                due.append((c, state))
        num_tokens = base_tokens + sum(v for v in k.values() if v > 0)
        step_seconds = self.step_seconds(num_sequences, base_tokens, k, free)

        def price(c: Candidate) -> float:
            return self._probe_price(c, num_sequences, num_tokens, c.request_id in free)

        # Saved up to a few of the dearest due probe, so a probe with a long catch-up is bought now
        # and then; still at most PROBE_BUDGET of the time over all.
        dearest = max([price(c) for c, _ in due], default=0.0)
        cap = MAX_SAVED_PROBES * max(self.cost.probe_seconds(num_sequences, num_tokens), dearest)
        self._probe_savings = self._savings_after(step_seconds, cap)
        self._savings_cap = cap
        due.sort(
            key=lambda d: (
                self.acceptance.has_observations(d[0].request_id),
                -d[1].steps_without_drafts / d[1].interval,
            )
        )
        probed = []
        for c, state in due:
            # A probe the savings do not cover waits; a cheaper one behind it need not.
            charge = price(c)
            if charge > self._probe_savings or not could_pay(c):  # the cheap test first
                continue
            self._probe_savings -= charge
            num_tokens += 1  # the next probe's row comes after this one's
            k[c.request_id] = 1
            state.steps_without_drafts = 0
            state.interval = min(2 * state.interval, MAX_PROBE_INTERVAL)
            probed.append(c.request_id)
        return probed

    def _probe_price(self, c: Candidate, num_sequences: int, num_tokens: int, free: bool) -> float:
        """A probe for the candidate in a step of `num_tokens` tokens: its verification row, and the
        proposal's catch-up unless the proposal is free (a lookup)."""
        return self.cost.probe_seconds(num_sequences, num_tokens, 0 if free else c.setup_tokens)

    def _savings_after(self, step_seconds: float, cap: float) -> float:
        """The probe savings once a step of `step_seconds` has added its PROBE_BUDGET share."""
        return min(self._probe_savings + PROBE_BUDGET * step_seconds, cap)

    def required_gain(self, num_sequences: int) -> float:
        """How much more goodput drafting must promise than not drafting, at this batch size."""
        return MIN_GAIN * self.cost.shortfall(num_sequences, self._gain_factors())

    def _gain_factors(self) -> tuple[float, float]:
        """The gain calibrations' factors, (costly, free): the order of `Promise.drafted`."""
        return self.gain_calibration[False].factor, self.gain_calibration[True].factor

    # --- feedback ---------------------------------------------------------------------------------
    def observe_step(
        self,
        num_sequences: int,
        drafted: bool,
        tokens: int,
        seconds: float,
        promised: Promise | None = None,
    ) -> None:
        """A decode-only step the controller decided (prefill chunks would blur the comparison; probe
        steps are neither kind): the tokens its requests emitted in `seconds`, with drafts or without,
        and what the controller predicted for it."""
        self.cost.observe_realized(num_sequences, drafted, tokens, seconds, promised)

    def observe_verification(
        self, request_id: str, num_drafts: int, num_accepted: int, emitted: Sequence[int] = ()
    ) -> None:
        """A scheduled decode request's step: its proposer's drafts and how many were accepted, and
        the tokens it emitted (which judge its undrafted previews)."""
        hint = self._hints.get(request_id)
        previewed = self._previewed.pop(request_id, ())
        chosen = self._chosen.pop(request_id, None)
        if num_drafts > 0:
            self.payback.drafted(request_id, len(emitted) if emitted else num_accepted + 1)
            if chosen is not None:  # the controller's own choice (not a probe, not a static cap)
                rates, free, share = chosen
                self.gain_calibration[free].observe(
                    expected_tokens(rates, num_drafts) - 1.0, num_accepted, share
                )
            self.acceptance.observe(request_id, num_drafts, num_accepted, hint)
        elif previewed:
            self._shadows.setdefault(request_id, []).append(_Shadow(hint, previewed))
        pending = self._shadows.get(request_id)
        for token in emitted:
            if not pending:
                break
            still = []
            for shadow in pending:
                if shadow.drafts[shadow.matched] == token:
                    shadow.matched += 1
                    if shadow.matched < len(shadow.drafts):
                        still.append(shadow)
                        continue
                self.acceptance.observe(request_id, len(shadow.drafts), shadow.matched, shadow.hint)
            pending = still
        if pending:
            self._shadows[request_id] = pending
        else:
            self._shadows.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self._probes.pop(request_id, None)
        self._previewed.pop(request_id, None)
        self._shadows.pop(request_id, None)
        self._chosen.pop(request_id, None)
        self.payback.finished(request_id)
