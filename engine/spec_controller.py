"""The speculation controller: every step, for every running request, how many tokens to draft.

Pure Python (no torch): the scheduler calls it. Three parts, each replaceable on its own:

- `AcceptanceModel`: per request and draft position j, the chance that draft j is accepted given that
  drafts 0..j-1 were. Counts decay, so a change of content (a copy-heavy section starts) shows within
  a few verifications; a new request starts from every request's recent statistics. The expected
  tokens one verification emits with k drafts is 1 + sum_{m<=k} prod_{j<=m} a_j.
- `StepCostModel`: what a step costs given what it holds. The target's cost over the number of
  tokens it runs comes from a start-up profile (it has the hardware's shape: on this CPU a bf16
  window of up to ~16 tokens costs about one token, int4 steps every 4 rows, a GPU is flat until
  large batches), calibrated online per batch-size bucket from measured forwards (the machine's
  speed drifts, and a batch of many short sequences is not one long one) as a slope and an offset,
  so that what one more row adds is measured too; a plain decode step's price is such a line in its
  batch size itself (the profile of one sequence does not tell a batch's sizes apart). The proposer's cost per
  draft step and per catch-up token starts from its own start-up timing (`DraftCostProfile`) and is
  learned online per batch-size bucket, and a fixed per-step overhead too.
- `SpeculationController.choose`: the k vector that maximises expected emitted tokens per second of
  step time (goodput) under the token budget. k = 0 for a request, or the whole batch, when drafting
  does not pay. A request that is not drafting keeps learning: when its proposer previews the tokens
  it would draft (n-gram lookup), they are judged against the tokens the request emits next, which is
  what verifying them would have found (`_Shadow`), at no cost. Otherwise it is probed with one draft
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

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from .catch_up_payback import CatchUpPayback

# Pseudo-observations the global estimate is worth inside a request's pooled estimate, and the
# pooled estimate inside each position's.
PRIOR_WEIGHT = 2.0
POSITION_WEIGHT = 2.0
# Per-observation decay of a request's counts (memory ~5 verifications) and the global counts (~200).
REQUEST_DECAY = 0.8
GLOBAL_DECAY = 0.995
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
# What drafting steps really delivered, per batch bucket: tokens per second of decode-only steps with
# drafts against those without, each an exponentially weighted mean (memory ~30 steps). Where the
# drafting steps delivered less, the cost model is wrong there (at 32 SmolLM2 requests drafts of
# acceptance 0.3 cost more than the calibrated price said), and the gain drafting must promise is
# raised by that ratio until what it delivers catches up. The drafting steps are also held to what the
# controller promised for them (its predicted tokens over its predicted seconds, the same steps): where
# they delivered less, the bar is raised by that ratio too. Drafting steps are rare where drafting is
# marginal, so the acceptance and cost calibrations there lag: served SmolLM2 at 8 clients (EPYC VM),
# 8-sequence drafting steps were promised 1.053x the plain steps' tokens a second and delivered 0.976x
# (tokens 0.96 of the promise, seconds 1.036), at 16 clients 1.082x against 0.986x; at 1 and 4 clients
# they delivered 1.008 and 1.005 of the promise, the Qwen pair at 1-2 clients 1.04 and 1.00.
REALIZED_DECAY = 0.97
REALIZED_MIN_STEPS = 8.0
# Once the raised bar stops drafting, no drafting step updates the comparison; each plain step ages the
# drafting record a little, so after ~140 plain steps it is no longer trusted and drafting is tried again
# (one bad step re-raises the bar) rather than being locked out of that batch size for good.
REALIZED_AGEING = 0.99
# Smoothing of the online cost measurements. The target's calibration keeps a longer memory than the
# draft's: drafting steps are rare when drafting rarely pays, and they alone show what a row adds.
CALIBRATION_DECAY = 0.98  # per measured forward (memory ~50 forwards): the slope
OFFSET_ALPHA = 0.2  # the offset (replaying two batch-1 runs' forwards: median error 5% vs 7% for a ratio)
# A forward with more tokens than this per sequence is mostly prefill: calibrated apart from decode
# when the caller does not say how many of its tokens were prompt tokens.
PREFILL_TOKENS_PER_SEQUENCE = 32
# Pull of the calibration's slope towards "measured / profiled", in pseudo-forwards whose profiled
# times differ by 25% from the mean: without forwards of different sizes the calibration is that
# ratio, and one odd forward does not set the slope on its own.
SLOPE_PRIOR_WEIGHT = 2.0
DRAFT_ALPHA = 0.2
# A plain decode step's price not measured for this many decode forwards of its batch size (all had
# draft rows) is refreshed: the controller runs one step without drafts when drafting's margin over
# it is thin enough for a stale price to have decided it (REFRESH_MARGIN), and that step's residual
# restarts the calibration's offset. A step without drafts in 40 at such a thin margin costs < 0.5%.
STALE_FORWARDS = 40
REFRESH_MARGIN = 1.25
# A plain decode step priced above the last step of the same batch with draft rows, each by its own
# calibration, says one of the two prices is another time's machine speed (rows cannot make a step
# cheaper), and the kind measured longer ago is the stale one: its next measurement restarts its
# offset. A plain price not measured for this many decode forwards of its batch size is measured again
# at once, whatever drafting's margin (StepCostModel.plain_is_behind). At 16 SmolLM2 clients on the EPYC
# VM a slow spell left the plain price at 117 ms while drafting steps ran 89-102 ms; the "never below
# plain" floor then priced 26-48 rows at nothing, and the first cells after a server start drafted 80
# steps at 0.19-0.32 accepted a draft, delivering 0.90-0.99x of the same steps undrafted. Replayed over
# two such runs' logs, the plain price was behind in 8 of the 9 cells whose drafting steps delivered
# less than undrafted ones and in none of the 18 whose drafting gained (1.02-1.13x).
INCONSISTENT_FORWARDS = 8
# The forwards a calibration's offset starts from (their median residual), and the plain decode steps a
# batch size must have measured before drafting is weighed against their price: the first decode step
# after a prefill can take twice a plain step's time (Qwen pair, 2 clients, AVX-512 Xeon: 0.69 s, then
# 0.28-0.30 s), and as the plain price it made 45 drafting steps look 2.4x cheaper than they were.
RESTART_FORWARDS = 3
# The draft's cost per step is the median of this many recent drafting steps per batch bucket. A
# draft model's first proposal for a request also feeds it the whole prompt (0.6 s against 0.23 s
# for five steps of the Qwen pair's int4 0.5B draft); averaged in, every new request raised the
# per-step price by a quarter for the next several steps.
DRAFT_WINDOW = 9
# Before a catch-up was measured, and when the proposer timed none at start-up (DraftCostProfile), one
# token of it is priced at this share of a draft step (the Qwen pair's int4 0.5B draft on its float
# path on the AMX Xeon: 512 tokens 0.87 s, one step 0.046 s; on the AVX-512 Xeon a token cost 6-8 ms
# against a 35-45 ms step, so the proposer's own timing is worth having).
SETUP_TOKEN_PRIOR = 1 / 16
# The per-token catch-up price is the lower median of this many recent catch-ups' prices. It is
# learned only from catch-ups, and a price too high stops them: an exponential mean (0.2 of each new
# price) took one catch-up of 17 tokens timed while another job held the cores (0.2 s a token against
# ~2 ms) to 42 ms a token, and the Qwen pair at one client never caught a request up again (in-process
# run beside a test suite, AMD EPYC). A median needs most of the window to move.
SETUP_WINDOW = 5
# A drafting step whose proposals fed at least this many catch-up tokens per drafting request teaches
# the per-token price (fewer are lost in the per-step times' noise).
SETUP_MIN_TOKENS = 16
OVERHEAD_ALPHA = 0.1
# What the controller's own drafts delivered against what it predicted for them: accepted drafts over
# expected accepted drafts, decayed per verification (memory ~30), with GAIN_PRIOR_TOKENS pseudo-tokens
# at 1. A request is drafted when its estimate is high, and its estimate is high partly by chance, so
# chosen drafts deliver less than the estimate said (the winner's curse): on the AVX-512 Xeon at 2 Qwen
# clients the controller's drafts were accepted 157 times where it expected 210 (0.75), at 4 clients
# 96 where it expected 110. The expected tokens of every adaptive slot are scaled by that ratio, never
# above 1 (a model that is too cautious is left alone: drafting must never cost) nor below
# MIN_GAIN_CALIBRATION. Kept apart for free proposals (lookups, whose previews are judged without
# drafting) and the proposals a model drafts.
GAIN_CALIBRATION_DECAY = 0.97
GAIN_PRIOR_TOKENS = 4.0
MIN_GAIN_CALIBRATION = 0.5
# A catch-up is paid back over the drafting steps its request has next, and those run at the server's
# load, not at the batch of the step that caught up: at 4 Qwen-pair clients (AMD EPYC) a request left
# alone for a step between two waves (its wave finished, the next one's requests not yet admitted)
# was caught up on 52-494 tokens (0.32-1.18 s) by the payback of one-client cells (~45 tokens drafted
# after a catch-up), drafted once, and stopped drafting when the next wave made the batch 4 again;
# the policy's work came to 0.962x of off's over four pairs. So the payback record a catch-up is
# priced with and counted in is the bucket of the recent batch size (exponentially weighted, memory
# ~1 / LOAD_ALPHA steps), or of this step's batch where that is larger.
LOAD_ALPHA = 0.1


def _bucket(n: int) -> int:
    """Batch-size bucket: 1, 2-3, 4-7, 8-15, ... (cost per sequence changes slowly with n)."""
    return max(n, 1).bit_length()


def _calibration_key(
    num_sequences: int, num_tokens: int, prefill_tokens: int | None = None
) -> tuple[int, bool, bool]:
    """(batch bucket, prefill, more rows than sequences). Steps with windows are calibrated apart from
    plain decode steps of the same batch: the profile is one sequence, and in a batch the first rows
    beyond one per sequence cost far more than its shape says (SmolLM2 bf16, 16 requests of ~400
    tokens: 0.10 s plain, 0.15-0.16 s with 8-16 draft rows, where the profile is flat from 24 to 32
    tokens; calibrated together, the fit priced those rows at nothing and the controller drafted at
    0.8x of the plain speed). Steps with a prefill chunk are calibrated apart from both: a prompt's
    token costs less than a draft row (no logits, no verification; SmolLM2 bf16 at 16-32 clients on
    the EPYC VM: ~1.0 ms against ~2.0 ms), and steps of 31 decodes beside a 300-token chunk, counted
    with the windows, set their calibration's slope to 0.85x the profile's, so that draft rows at 32
    sequences were priced at nothing again. `prefill_tokens` None (unknown): a step of more than
    PREFILL_TOKENS_PER_SEQUENCE tokens per sequence counts as prefill."""
    num_sequences = max(1, num_sequences)
    if prefill_tokens is None:
        prefill = num_tokens > PREFILL_TOKENS_PER_SEQUENCE * num_sequences
    else:
        prefill = prefill_tokens > 0
    return _bucket(num_sequences), prefill, num_tokens > num_sequences


# --- acceptance ------------------------------------------------------------------------------------
@dataclass
class _Counts:
    hits: list[float]
    trials: list[float]

    @classmethod
    def zeros(cls, n: int) -> _Counts:
        return cls([0.0] * n, [0.0] * n)

    def observe(self, num_drafts: int, num_accepted: int, decay: float) -> None:
        """Drafts 0..num_accepted-1 were accepted; draft num_accepted (if proposed) was rejected;
        later ones were never judged."""
        for j in range(len(self.hits)):
            self.hits[j] *= decay
            self.trials[j] *= decay
        for j in range(min(num_accepted + 1, num_drafts, len(self.hits))):
            self.trials[j] += 1.0
            if j < num_accepted:
                self.hits[j] += 1.0


class AcceptanceModel:
    """Acceptance per draft position, per request and per proposal class (`hint`: what the proposer
    can tell about a proposal before drafting it for free, e.g. the length of an n-gram match;
    None when it cannot tell). Classes are kept apart because they differ more than requests do: on
    SmolLM2 answers a 1-token n-gram match's first draft is accepted ~0.2 of the time, a 4-token one's ~0.8.

    Estimates are pooled over positions, then told apart: a request's rate over all the positions it
    was judged at (its class's global rate as the prior), and at position j its own counts there with
    that pooled rate as the prior. Position j is only judged when a request drafts more than j tokens,
    so an estimate kept per position on its own is a trap: one rejection at the third draft kept the
    Qwen pair's code answers (pooled acceptance 0.97) at k = 2 for the rest of the request, since the
    third position was never tried again and its prior (every request's third position) was stuck the
    same way. A position without recent trials of its own now reads the request's pooled rate; one
    with them (the first draft of a qa answer, accepted 0.6 while later drafts are 0.9) keeps them."""

    def __init__(self, k_max: int, initial_acceptance: float = 0.5):
        self.k_max = k_max
        self.initial = initial_acceptance
        self._global: dict[int | None, _Counts] = {}
        self._requests: dict[str, dict[int | None, _Counts]] = {}

    def global_rate(self, hint: int | None = None) -> float:
        """Every request's recent acceptance over all positions for proposals of class `hint`."""
        counts = self._global.get(hint)
        if counts is None:
            return self.initial
        return (sum(counts.hits) + self.initial) / (sum(counts.trials) + 1.0)  # one pseudo-observation

    def global_rates(self, hint: int | None = None) -> list[float]:
        """What a request of class `hint` without verifications of its own starts from, per position."""
        return [self.global_rate(hint)] * self.k_max

    def rates(self, request_id: str, prior: float | None = None, hint: int | None = None) -> list[float]:
        """a_j for j in 0..k_max-1: this request's counts for class `hint`, pooled over positions with
        the global rate of that class (`prior`, computed here when not given) as the pooled prior, and
        per position with the pooled rate as the prior."""
        prior = prior if prior is not None else self.global_rate(hint)
        own = self._requests.get(request_id, {}).get(hint)
        if own is None:
            return [prior] * self.k_max
        pooled = (sum(own.hits) + PRIOR_WEIGHT * prior) / (sum(own.trials) + PRIOR_WEIGHT)
        return [
            (h + POSITION_WEIGHT * pooled) / (t + POSITION_WEIGHT)
            for h, t in zip(own.hits, own.trials, strict=True)
        ]

    def observe(self, request_id: str, num_drafts: int, num_accepted: int, hint: int | None = None) -> None:
        if num_drafts <= 0:
            return
        own = self._requests.setdefault(request_id, {}).setdefault(hint, _Counts.zeros(self.k_max))
        own.observe(num_drafts, num_accepted, REQUEST_DECAY)
        self._global.setdefault(hint, _Counts.zeros(self.k_max)).observe(
            num_drafts, num_accepted, GLOBAL_DECAY
        )

    def has_observations(self, request_id: str) -> bool:
        return request_id in self._requests

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


@dataclass
class GainCalibration:
    """Accepted drafts over the acceptance model's expectation for the drafts the controller chose."""

    expected: float = 0.0
    accepted: float = 0.0

    def observe(self, expected: float, accepted: int) -> None:
        self.expected = GAIN_CALIBRATION_DECAY * self.expected + max(0.0, expected)
        self.accepted = GAIN_CALIBRATION_DECAY * self.accepted + max(0, accepted)

    @property
    def factor(self) -> float:
        ratio = (self.accepted + GAIN_PRIOR_TOKENS) / (self.expected + GAIN_PRIOR_TOKENS)
        return min(1.0, max(MIN_GAIN_CALIBRATION, ratio))


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens one verification emits with k drafts: 1 + sum_{m<=k} prod_{j<=m} a_j."""
    total, p = 1.0, 1.0
    for a in rates[:k]:
        p *= a
        total += p
    return total


# --- cost ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftCostProfile:
    """A proposer's costs timed at start-up (`Proposer.profile_cost`), before any request: the price
    of its draft steps and catch-ups until real ones were timed. Without it a draft step is priced
    by the proposer's weight bytes over the target's and a catch-up token at SETUP_TOKEN_PRIOR of a
    step: on the AVX-512 Xeon the Qwen pair's first catch-up (4 requests, 370 tokens) was priced
    1.06 s and took 3.08 s, and 4-request draft steps were priced 55 ms and took 89 ms."""

    step_seconds: tuple[tuple[int, float], ...]  # (requests, seconds of one draft step for them)
    catch_up_token_seconds: float  # seconds per token the proposer feeds before it drafts

    def __post_init__(self) -> None:
        # A plugin's numbers: refused here, so a bad one is a clear error at start-up (the engine then
        # prices as it would without a profile) and never a NaN in every step's decision.
        points = [(int(n), float(t)) for n, t in self.step_seconds]
        if not points or any(n < 1 or not 0.0 <= t < float("inf") for n, t in points):
            raise ValueError(
                f"a draft cost profile needs (requests >= 1, finite seconds >= 0) points: {points}"
            )
        if not 0.0 <= self.catch_up_token_seconds < float("inf"):
            raise ValueError(
                f"catch-up seconds per token must be finite and >= 0: {self.catch_up_token_seconds}"
            )
        object.__setattr__(self, "step_seconds", tuple(sorted(points)))

    def step(self, num_requests: int) -> float:
        """One draft step for `num_requests` requests: piecewise linear between the timed counts, flat
        below the first, along the last segment beyond the last."""
        return _interpolate(
            [n for n, _ in self.step_seconds], [t for _, t in self.step_seconds], num_requests
        )


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """Piecewise linear through points (xs sorted); flat below the first; beyond the last, its
    segment's slope (a single point: proportional)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[0] * x / xs[0]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        return ys[-1] + max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) * (x - xs[-1])
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class _Calibration:
    """measured ~= slope * profiled + offset: the slope fitted to recent forwards (exponentially
    weighted least squares, pulled towards measured / profiled), the offset following the latest
    ones (the machine's speed drifts faster than its shape changes). "profiled" is what the kind of
    step is regressed on (`StepCostModel._regressor`): the profile's cost of its tokens, or for plain
    decode steps their number of sequences.

    A single ratio (the slope alone) is right when the whole machine is slower than at start-up, and
    when a batch of long sequences costs more per row than the profile's one short sequence. But the
    profile also misses per-step costs that do not grow with the rows (attention over a long context,
    sampling): SmolLM2 bf16 at batch 1 measured 48.6 ms for 1 row and 62.2 ms for 2 against a profile of
    36.6 and 54.7 ms, and the ratio alone priced the second row at 21-24 ms instead of 13.6, so drafts
    that paid were not made. Forwards of different sizes (drafting steps next to plain ones) show the
    slope; prefill forwards are calibrated apart (StepCostModel), or their leverage would set it."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    slope: float = 1.0  # fitted once per observation: predict runs for every draft slot of every step
    offset: float = 0.0
    last_forward: int = 0  # the batch bucket's decode forward count when this kind was last measured
    last_shape: tuple[int, float] = (1, 0.0)  # (sequences, regressor) of the last decode forward measured
    # (profiled, measured) of the first RESTART_FORWARDS forwards since the offset (re)started: the
    # offset is their median residual until then, so one odd forward does not set it.
    restart: list[tuple[float, float]] = field(default_factory=list)
    count: int = 0  # forwards observed, ever

    def _fit_slope(self) -> float:
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        spread = max(0.0, self.sum_xx - self.weight * mean_x * mean_x)  # weighted sum of (x - mean_x)^2
        covariance = self.sum_xy - self.weight * mean_x * mean_y
        prior = SLOPE_PRIOR_WEIGHT * (0.25 * mean_x) ** 2
        return max(0.0, (covariance + prior * mean_y / mean_x) / (spread + prior))

    def observe(self, profiled: float, measured: float, stale: bool = False) -> None:
        """`stale`: this kind of step was not measured for a while, so the offset restarts from this
        measurement (the machine's speed may have moved since), as on the first one."""
        d, first = CALIBRATION_DECAY, self.weight == 0 or stale
        self.weight = d * self.weight + 1.0
        self.sum_x = d * self.sum_x + profiled
        self.sum_y = d * self.sum_y + measured
        self.sum_xx = d * self.sum_xx + profiled * profiled
        self.sum_xy = d * self.sum_xy + profiled * measured
        self.slope = self._fit_slope()
        self.count += 1
        if first:
            self.restart = []
        if len(self.restart) < RESTART_FORWARDS:
            self.restart.append((profiled, measured))
            self.offset = statistics.median(m - self.slope * x for x, m in self.restart)
            return
        residual = measured - self.slope * profiled
        self.offset += OFFSET_ALPHA * (residual - self.offset)

    @property
    def settled(self) -> bool:
        """Whether RESTART_FORWARDS forwards were observed (a restart after a gap needs one to price:
        the price it replaces was a settled one)."""
        return self.count >= RESTART_FORWARDS

    def predict(self, profiled: float) -> float:
        return max(0.0, self.slope * profiled + self.offset)


@dataclass(frozen=True)
class Promise:
    """What the controller predicted for a step, kept apart by what its gain calibrations scale: the
    tokens they do not (each decode request's own token, probes' and static caps' expected accepted
    drafts) and its own drafts' expected accepted tokens before them, (costly, free), so the promise
    can be read again with the calibrations of a later step (`_Realized.shortfall_of_promise`)."""

    tokens: float
    seconds: float
    drafted: tuple[float, float] = (0.0, 0.0)

    def predicted_tokens(self, factors: tuple[float, float]) -> float:
        return self.tokens + factors[0] * self.drafted[0] + factors[1] * self.drafted[1]


@dataclass
class _Realized:
    """Tokens per second of one kind of decode-only step (exponentially weighted)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0
    trusted_once: bool = False  # held enough steps to be trusted at some point
    # What the controller predicted for the steps that came with a prediction (Promise: the tokens no
    # gain calibration scales, and its own drafts' expected accepted tokens before it, costly and
    # free), and what they delivered.
    promised_tokens: float = 0.0
    promised_drafted: tuple[float, float] = (0.0, 0.0)
    promised_seconds: float = 0.0
    kept_tokens: float = 0.0
    kept_seconds: float = 0.0
    promised_steps: float = 0.0

    def observe(self, tokens: int, seconds: float, promised: Promise | None = None) -> None:
        self.age(REALIZED_DECAY)
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1.0
        self.trusted_once = self.trusted_once or self.steps >= REALIZED_MIN_STEPS
        if promised is not None and promised.seconds > 0:
            self.promised_tokens += promised.tokens
            costly, free = self.promised_drafted
            self.promised_drafted = (costly + promised.drafted[0], free + promised.drafted[1])
            self.promised_seconds += promised.seconds
            self.kept_tokens += tokens
            self.kept_seconds += seconds
            self.promised_steps += 1.0

    def age(self, factor: float = REALIZED_AGEING) -> None:
        self.tokens *= factor
        self.seconds *= factor
        self.steps *= factor
        self.promised_tokens *= factor
        self.promised_drafted = (self.promised_drafted[0] * factor, self.promised_drafted[1] * factor)
        self.promised_seconds *= factor
        self.kept_tokens *= factor
        self.kept_seconds *= factor
        self.promised_steps *= factor

    @property
    def rate(self) -> float | None:
        if self.steps < REALIZED_MIN_STEPS or self.seconds <= 0:
            return None
        return self.tokens / self.seconds

    def shortfall_of_promise(self, factors: tuple[float, float] = (1.0, 1.0)) -> float | None:
        """Promised tokens a second over delivered ones (>= 0), once enough steps came with a promise.
        The promises are those the controller would make now for the same drafts: their expected
        accepted tokens scaled by the gain calibrations' `factors` (costly, free) of now, not of when
        they were made. The gain calibration and this record both answer drafts accepted less often
        than expected; counted in both, one miss was paid twice: at one Qwen-pair client (AMD EPYC) a
        request's first eight-token drafts were accepted less and less as its answer left the prompt's
        text (promised 6.8, 8.8, 6.6, 4.8 tokens; delivered 9, 5, 4, 2), its drafting steps had
        promised 1.40-1.50x what they delivered (the step log), the same request took the calibration
        to 0.67-0.69 (in-process), and with the bar raised ~1.4x on top drafting stayed off for most of
        the next requests (two cells: 22 and 5 drafting steps of 167 and 189). Read with a calibration
        of 0.67, those promises were ~1.05-1.10x what the steps delivered."""
        if self.promised_steps < REALIZED_MIN_STEPS or self.promised_seconds <= 0 or self.kept_seconds <= 0:
            return None
        delivered = self.kept_tokens / self.kept_seconds
        promise = Promise(self.promised_tokens, self.promised_seconds, self.promised_drafted)
        promised = promise.predicted_tokens(factors) / self.promised_seconds
        return promised / delivered if delivered > 0 else None


# A step price's calibrations (StepCostModel._price_parts): its own kind's, the plain step's price,
# the other kind's.
_PriceParts: TypeAlias = tuple[_Calibration | None, float | None, _Calibration | None]


class StepCostModel:
    """Seconds per step = target(num_sequences, num_tokens) + draft(num_requests, num_steps) + overhead."""

    def __init__(
        self,
        target_curve: Sequence[tuple[int, float]],
        draft_cost_ratio: float = 0.0,
        draft_profile: DraftCostProfile | None = None,
    ):
        """target_curve: (tokens in one forward, seconds), from a profile; draft_cost_ratio: the
        proposer's cost per draft step as a fraction of the target's step at the same batch size
        before any measurement (its weights over the target's: 0 for n-gram lookup), used when the
        proposer timed nothing at start-up (`draft_profile`)."""
        points = sorted((max(1, int(n)), max(0.0, float(s))) for n, s in target_curve)
        if not points:
            raise ValueError("the target cost curve needs at least one point")
        self._xs = [n for n, _ in points]
        self._ys = [s for _, s in points]
        # curve() by token count: the profile never changes, and the controller prices every draft
        # slot of every step through it (~66 lookups a step at 8 SmolLM2 requests). At most one entry
        # per step size the token budget allows.
        self._curve: dict[int, float] = {}
        self.draft_cost_ratio = draft_cost_ratio
        self.draft_profile = draft_profile
        self._calibration: dict[tuple[int, bool, bool], _Calibration] = {}  # see _calibration_key
        self._forwards: dict[int, int] = {}  # batch bucket -> decode forwards measured (plain_is_stale)
        self._draft_steps: dict[int, deque[float]] = {}  # batch bucket -> recent seconds per draft step
        self._probe_draft: float | None = None  # proposer seconds per probe, measured
        self._setup_token: deque[float] = deque(maxlen=SETUP_WINDOW)  # recent seconds per catch-up token
        self.overhead_seconds = 0.0
        # batch bucket -> (decode-only steps without drafts, with drafts): what they delivered
        self._realized: dict[int, tuple[_Realized, _Realized]] = {}

    def curve(self, num_tokens: int) -> float:
        """The profiled forward cost, piecewise linear; flat below the first point, the last
        segment's slope beyond the last."""
        seconds = self._curve.get(num_tokens)
        if seconds is None:
            seconds = self._curve[num_tokens] = _interpolate(self._xs, self._ys, num_tokens)
        return seconds

    def target_seconds(self, num_sequences: int, num_tokens: int, prefill_tokens: int | None = None) -> float:
        key = _calibration_key(num_sequences, num_tokens, prefill_tokens)
        return self._price(self._price_parts(key, num_sequences), key, num_sequences, num_tokens)

    def _price_parts(self, key: tuple[int, bool, bool], num_sequences: int) -> _PriceParts:
        """What a step's price of this kind and batch size takes from the calibrations, whatever its
        number of tokens."""
        bucket, prefill, multi_row = key
        calibration = self._calibration.get(key)
        # The same step without draft rows, for a step with them: it stands in and sets a floor.
        plain_key = (bucket, prefill, False)
        plain = self._calibration.get(plain_key) if multi_row else None
        plain_price = (
            None if plain is None else plain.predict(self._regressor(plain_key, num_sequences, num_sequences))
        )
        other = None
        if calibration is None and plain_price is None:
            other = self._calibration.get((bucket, prefill, not multi_row))
        return calibration, plain_price, other

    def _price(
        self, parts: _PriceParts, key: tuple[int, bool, bool], num_sequences: int, num_tokens: int
    ) -> float:
        calibration, plain_price, other = parts
        profiled = self.curve(num_tokens)
        if calibration is not None:
            price = calibration.predict(self._regressor(key, num_sequences, num_tokens))
        elif plain_price is not None:
            # Until a step of this kind was measured, the other kind of the same batch stands in for
            # it: the plain step's price, grown along the profile by the rows this one adds.
            price = plain_price * profiled / max(self.curve(num_sequences), 1e-12)
        else:
            if other is None:
                return profiled
            price = other.predict(profiled)
        if plain_price is not None:
            # A step with draft rows is never priced below the same step without them. The two kinds
            # are calibrated from different steps, and each goes stale while the other runs: on an
            # AVX-512 Xeon at 4 Qwen clients, steps with one draft row were priced 0.37 s while plain
            # steps were still priced 0.40 s from a slow spell before drafting began, so a draft row
            # looked cheaper than none and the controller drafted on at 0.87x of the plain speed.
            price = max(price, plain_price)
        return price

    def step_pricer(self, num_sequences: int) -> Callable[[int, int, int], float]:
        """`step_seconds(num_sequences, ...)` as a function of (tokens, drafting requests, draft
        steps), for one step's plans: the calibrations a price takes (`_price_parts`) are looked up
        once per kind of step. Why: the controller prices every prefix of its draft slots, ~30 shapes
        a step at 8 SmolLM2 requests and ~100 at 32, and repeating the lookups for each was a third of
        its time (a step's choice, replayed: 134 -> 94-112 us at 8 requests, 394 -> 281-290 us at 32,
        the same decisions; docs/bench/issue20-s34/choose_replay.py; in the engine, run cold between
        forwards, 0.17-0.18 -> 0.16 ms a step at 8)."""
        parts: dict[tuple[int, bool, bool], _PriceParts] = {}

        def price(num_tokens: int, draft_requests: int, num_steps: int) -> float:
            key = _calibration_key(num_sequences, num_tokens)
            known = parts.get(key)
            if known is None:
                known = parts[key] = self._price_parts(key, num_sequences)
            return (
                self._price(known, key, num_sequences, num_tokens)
                + self.draft_seconds(draft_requests, num_steps)
                + self.overhead_seconds
            )

        return price

    def _regressor(self, key: tuple[int, bool, bool], num_sequences: int, num_tokens: int) -> float:
        """What a calibration of this kind maps to seconds. Plain decode steps: their number of
        sequences, so their price is a line in the batch size fitted to plain steps themselves. The
        profile is one sequence, and along it a batch bucket's sizes differ little where their steps
        differ much (SmolLM2 bf16 on the EPYC VM: 8 and 15 sequences cost 61 and 104 ms where the
        profile's 8 and 15 tokens cost 41 and 50); fitted to steps of 8-12 sequences through the
        profile, the slope was so steep that 13-15 sequences were priced 134-149 ms, and drafting
        25 rows there looked nearly free (predicted 141-153 ms against the plain price) where it
        emitted fewer tokens a second than plain steps. Every other kind: the profile's cost of its
        tokens (what a verification row or a prompt's token adds follows the profile's shape)."""
        _, prefill, multi_row = key
        if not prefill and not multi_row:
            return float(max(1, num_sequences))
        return self.curve(num_tokens)

    def plain_is_stale(self, num_sequences: int) -> bool:
        """Whether the plain decode steps of this batch size were last measured STALE_FORWARDS or more
        decode forwards of it ago (the steps since all had draft rows), so their price may be the
        machine's speed of another time, or never while steps with draft rows were (see
        `plain_is_measured`)."""
        bucket = _bucket(num_sequences)
        plain = self._calibration.get((bucket, False, False))
        if plain is None or not plain.settled:
            # Any forward of this batch size measured (a prefill's too): it runs here, and from its
            # first decode step on, drafting waits for a plain price of its own.
            return any(b == bucket for b, _, _ in self._calibration)
        return self._age(bucket, plain) >= STALE_FORWARDS

    def _age(self, bucket: int, calibration: _Calibration) -> int:
        """Decode forwards of this batch bucket since this kind of step was last measured."""
        return self._forwards.get(bucket, 0) - calibration.last_forward

    def _below_plain(self, bucket: int, num_sequences: int, profiled: float) -> bool:
        """Whether a step with draft rows (its regressor `profiled`) is priced by its own calibration
        below the plain step of the same batch by theirs (INCONSISTENT_FORWARDS)."""
        plain = self._calibration.get((bucket, False, False))
        drafting = self._calibration.get((bucket, False, True))
        if plain is None or drafting is None or not plain.settled or not drafting.settled:
            return False
        return drafting.predict(profiled) < plain.predict(float(max(1, num_sequences)))

    def plain_is_behind(self, num_sequences: int) -> bool:
        """Whether this batch size's plain price is above what the last step with draft rows is priced
        at by its own calibration, and was last measured INCONSISTENT_FORWARDS or more decode forwards
        of it ago (steps with draft rows ran since): then the plain price is the stale one, and the
        drafting steps' prices rest on the floor it sets (`target_seconds`), so their rows look free.
        The last drafting step's own shape is compared, not one extrapolated along the profile: steps
        of eight rows priced right extrapolate to one row below a plain step that costs as much."""
        bucket = _bucket(num_sequences)
        plain = self._calibration.get((bucket, False, False))
        if plain is None:
            return False
        return self._age(bucket, plain) >= INCONSISTENT_FORWARDS and self._plain_above_drafting(bucket)

    def _plain_above_drafting(self, bucket: int) -> bool:
        """Whether the last step with draft rows of this batch bucket is priced by its own calibration
        below the plain step of its batch size."""
        drafting = self._calibration.get((bucket, False, True))
        return drafting is not None and self._below_plain(bucket, *drafting.last_shape)

    def plain_is_measured(self, num_sequences: int) -> bool:
        """Whether the plain decode steps of this batch size were measured RESTART_FORWARDS times. Until
        then their price is the steps with draft rows' calibration standing in, or one or two
        forwards, and that is no price: on the AVX-512 Xeon the first drafting steps
        at 2 Qwen clients (0.77 s for 4 rows, with catch-ups) priced a plain step at 0.59 s where it
        took 0.30 s, so drafting looked 1.6x better than it was and went on at 0.8x of the plain speed
        with nothing to correct it."""
        plain = self._calibration.get((_bucket(num_sequences), False, False))
        return plain is not None and plain.settled

    def draft_seconds(self, num_requests: int, num_steps: int) -> float:
        if num_requests <= 0 or num_steps <= 0:
            return 0.0
        return num_steps * self.draft_step_seconds(num_requests)

    def setup_seconds(self, num_tokens: int) -> float:
        """A proposer's catch-up on `num_tokens` tokens before it drafts (Preview.setup_tokens)."""
        if num_tokens <= 0:
            return 0.0
        per_token = statistics.median_low(self._setup_token) if self._setup_token else None
        if per_token is None and self.draft_profile is not None:
            per_token = self.draft_profile.catch_up_token_seconds
        if per_token is None:
            per_token = SETUP_TOKEN_PRIOR * self.draft_step_seconds(1)
        return num_tokens * per_token

    def draft_step_seconds(self, num_requests: int) -> float:
        """One draft step for `num_requests` requests: measured, or before that the start-up profile's
        price, or the weight ratio's."""
        recent = self._draft_steps.get(_bucket(num_requests))
        if not recent:
            if self.draft_profile is not None:
                return self.draft_profile.step(num_requests)
            return self.draft_cost_ratio * self.target_seconds(num_requests, num_requests)
        return statistics.median(recent)

    def probe_seconds(self, num_sequences: int, num_tokens: int, setup_tokens: int = 0) -> float:
        """What one more probe adds to a step that runs `num_tokens` tokens: a verification row, the
        proposer's one draft (measured on probes, `observe_probe`), and the catch-up on the
        `setup_tokens` tokens the proposer has not seen. The catch-up is the probe's own: a Qwen-pair
        request that never drafted has a whole prompt to feed (504 tokens, 3.4 s on the AVX-512 Xeon)
        where one that drafted a step ago has 1-2 (0.04 s); priced by the probes' average, a probe
        of the first kind cost 30x its price and every other request's step waited for it."""
        row = self.target_seconds(num_sequences, num_tokens + 1) - self.target_seconds(
            num_sequences, num_tokens
        )
        return (
            max(0.0, row)
            + self._probe_draft_seconds()
            + (self.setup_seconds(setup_tokens) if setup_tokens >= SETUP_MIN_TOKENS else 0.0)
        )

    def _probe_draft_seconds(self) -> float:
        """A probe's one draft: measured on probes, a draft step's price before."""
        return self._probe_draft if self._probe_draft is not None else self.draft_seconds(1, 1)

    def step_seconds(
        self,
        num_sequences: int,
        num_tokens: int,
        draft_requests: int,
        draft_steps: int,
        prefill_tokens: int | None = None,
    ) -> float:
        return (
            self.target_seconds(num_sequences, num_tokens, prefill_tokens)
            + self.draft_seconds(draft_requests, draft_steps)
            + self.overhead_seconds
        )

    # --- online measurements ---------------------------------------------------------------------
    def observe_target(
        self, num_sequences: int, num_tokens: int, seconds: float, prefill_tokens: int | None = None
    ) -> None:
        base = self.curve(num_tokens)
        if base <= 0 or seconds <= 0:
            return
        key = _calibration_key(num_sequences, num_tokens, prefill_tokens)
        calibration = self._calibration.setdefault(key, _Calibration())
        bucket, prefill, _ = key
        x = self._regressor(key, num_sequences, num_tokens)
        if prefill:
            calibration.observe(x, seconds)
            return
        age = self._age(bucket, calibration)
        # Where the two kinds disagree (a step with draft rows priced below the plain step), the one
        # measured longer ago restarts from this measurement: it is the other time's speed.
        other = self._calibration.get((bucket, False, not key[2]))
        older = other is not None and other.last_forward > calibration.last_forward
        disagree = older and (
            self._below_plain(bucket, num_sequences, x)  # this step's own old price, with draft rows
            if key[2]
            else self._plain_above_drafting(bucket)
        )
        stale = calibration.weight > 0 and (age >= STALE_FORWARDS or disagree)
        forwards = self._forwards.get(bucket, 0) + 1
        self._forwards[bucket] = forwards
        calibration.observe(x, seconds, stale)
        calibration.last_forward = forwards
        calibration.last_shape = (num_sequences, x)

    def observe_draft(self, num_requests: int, num_steps: int, seconds: float, setup_tokens: int = 0) -> None:
        """A drafting step's proposer time: `num_steps` draft steps for `num_requests` requests, after
        feeding `setup_tokens` catch-up tokens. The per-step price is the median of recent steps (a
        catch-up does not move it); what a step spends beyond it teaches the per-token catch-up price."""
        if num_requests <= 0 or num_steps <= 0 or seconds < 0:
            return
        # Split by the current per-step price even before this bucket has a record of its own (the
        # weight-ratio prior then): otherwise a bucket's first drafting step, usually a catch-up on
        # the whole prompt, became its first "draft step" (Qwen pair, batch 1: 0.33 s against 0.042 s),
        # and the catch-up prior (a share of the step price) priced the next catch-ups 8x too high.
        if setup_tokens >= SETUP_MIN_TOKENS * num_requests:
            residual = max(0.0, seconds - num_steps * self.draft_step_seconds(num_requests))
            self._observe_setup(residual / setup_tokens)
            return  # mostly catch-up: not a draft step's time
        recent = self._draft_steps.setdefault(_bucket(num_requests), deque(maxlen=DRAFT_WINDOW))
        recent.append(seconds / num_steps)

    def _observe_setup(self, per_token: float) -> None:
        self._setup_token.append(per_token)

    def observe_probe(self, num_probes: int, seconds: float, setup_tokens: int = 0) -> None:
        """The proposer's time in a step whose only drafts were `num_probes` probes, after feeding
        `setup_tokens` catch-up tokens: a catch-up teaches the per-token price (what the step spent
        beyond its probes' price), the rest the price of a probe's draft."""
        if num_probes <= 0 or seconds < 0:
            return
        if setup_tokens >= SETUP_MIN_TOKENS * num_probes:
            residual = max(0.0, seconds - num_probes * self._probe_draft_seconds())
            self._observe_setup(residual / setup_tokens)
            return
        per_probe = seconds / num_probes
        old = self._probe_draft
        self._probe_draft = per_probe if old is None else old + DRAFT_ALPHA * (per_probe - old)

    def observe_realized(
        self,
        num_sequences: int,
        drafted: bool,
        tokens: int,
        seconds: float,
        promised: Promise | None = None,
    ) -> None:
        """A decode-only step's tokens in `seconds`, with drafts or without; `promised`: what the
        controller predicted for it."""
        if seconds <= 0:
            return
        plain, drafting = self._realized.setdefault(_bucket(num_sequences), (_Realized(), _Realized()))
        if drafted:
            drafting.observe(tokens, seconds, promised)
        else:
            plain.observe(tokens, seconds)
            drafting.age()

    def shortfall(self, num_sequences: int, factors: tuple[float, float] = (1.0, 1.0)) -> float:
        """How far (>= 1) the drafting steps at this batch size delivered less than the plain ones, or
        than the controller promised for them (their drafts' expectation scaled by the gain
        calibrations' `factors` of now: `_Realized.shortfall_of_promise`), whichever is further.
        A batch bucket whose drafting was never measured enough borrows the nearest bucket's record
        (the smaller one on a tie): on the EPYC VM the first minute at 16 and 32 SmolLM2 clients
        drafted at 0.80x / 0.84x of the plain speed, before the guard had seen eight drafting steps
        there (a second pass, with their own records, ran at 0.96x / 0.99x). One whose own record
        aged out borrows nothing: that is the retry, and a neighbour's record may never age."""
        own = _bucket(num_sequences)
        ratio = self._shortfall_of(own, factors)
        if ratio is not None:
            return ratio
        kinds = self._realized.get(own)
        if kinds is not None and kinds[1].trusted_once:
            return 1.0
        for bucket in sorted(self._realized, key=lambda b: (abs(b - own), b)):
            ratio = self._shortfall_of(bucket, factors)
            if ratio is not None:
                return ratio
        return 1.0

    def _shortfall_of(self, bucket: int, factors: tuple[float, float]) -> float | None:
        kinds = self._realized.get(bucket)
        if kinds is None:
            return None
        plain_rate, drafted_rate = kinds[0].rate, kinds[1].rate
        if plain_rate is None or drafted_rate is None:
            return None
        promise = kinds[1].shortfall_of_promise(factors)
        return max(1.0, plain_rate / drafted_rate, promise if promise is not None else 1.0)

    def drafting_timed(self, num_sequences: int) -> bool:
        """Whether decode steps with drafts were timed REALIZED_MIN_STEPS times at this batch size (the
        realized-goodput record, `shortfall`): their price then rests on steps of this size."""
        kinds = self._realized.get(_bucket(num_sequences))
        return kinds is not None and kinds[1].trusted_once

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_seconds += OVERHEAD_ALPHA * (max(0.0, seconds) - self.overhead_seconds)


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
    def __init__(self, k_max: int, cost: StepCostModel, acceptance: AcceptanceModel | None = None):
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
        self._chosen: dict[str, tuple[list[float], bool]] = {}
        self.payback = CatchUpPayback()
        self._load: float | None = None  # recent batch size (LOAD_ALPHA)

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
        k = {c.request_id: 0 for c in candidates}
        self._load = (
            float(num_sequences)
            if self._load is None
            else self._load + LOAD_ALPHA * (num_sequences - self._load)
        )
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
        factor = {rid: self.gain_calibration[rid in free].factor for rid in k}
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

        def best_prefix(order: list[tuple[float, int, str]]) -> tuple[float, int]:
            """(goodput, length) of the best prefix of `order` within the token budget."""
            tokens, gain, steps, drafting, setup = fixed.tokens, fixed.gain, fixed.steps, fixed.drafting, 0.0
            drafting_adaptive: set[str] = set()
            expected: dict[str, float] = {}  # request id -> expected tokens of its slots so far
            best, best_n = goodput(tokens, drafting, steps, gain, setup), 0
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
                if g > best:
                    best, best_n = g, n
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
        bar = no_adaptive_drafts * self.required_gain(num_sequences)
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
        self._chosen = {rid: (rates[rid], rid in free) for rid in chosen}

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
                certain = [(self.gain_calibration[is_free].factor, j, rid) for j in range(key[0])]
                merged = sorted(drafted_slots + certain, key=lambda s: (-s[0], s[1]))
                g, n = best_prefix(merged)
                answers[key] = g > threshold and any(r == rid for _, _, r in merged[:n])
            return answers[key]

        probed = [] if refresh else self._probe(candidates, k, num_sequences, base_tokens, free, could_pay)
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
        predicted = promise.predicted_tokens(self._gain_factors())
        return Decision(k, predicted, seconds, promise, probed, free, setup, static)

    def _catch_up(self, c: Candidate, num_sequences: int) -> _CatchUp:
        tokens_left: float = max(1, c.tokens_left or 1)
        horizon = self.payback.horizon(self._payback_bucket(num_sequences))
        if horizon is not None:
            tokens_left = max(1.0, min(tokens_left, horizon))
        return _CatchUp(self.cost.setup_seconds(c.setup_tokens), tokens_left)

    def _payback_bucket(self, num_sequences: int) -> int:
        """The batch bucket whose payback record prices a catch-up now (LOAD_ALPHA)."""
        return _bucket(max(num_sequences, round(self._load or 0.0)))

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
            setup = 0 if c.request_id in free else c.setup_tokens
            return self.cost.probe_seconds(num_sequences, num_tokens, setup)

        # Saved up to a few of the dearest due probe, so a probe with a long catch-up is bought now
        # and then; still at most PROBE_BUDGET of the time over all.
        dearest = max([price(c) for c, _ in due], default=0.0)
        cap = MAX_SAVED_PROBES * max(self.cost.probe_seconds(num_sequences, num_tokens), dearest)
        self._probe_savings = min(self._probe_savings + PROBE_BUDGET * step_seconds, cap)
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
                rates, free = chosen
                self.gain_calibration[free].observe(expected_tokens(rates, num_drafts) - 1.0, num_accepted)
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
