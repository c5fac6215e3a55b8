"""What a step costs, for the speculation controller (engine/spec_controller.py).

`StepCostModel`: what a step costs given what it holds. The target's cost over the number of tokens
it runs comes from a start-up profile (it has the hardware's shape: on this CPU a bf16 window of up
to ~16 tokens costs about one token, int4 steps every 4 rows, a GPU is flat until large batches),
calibrated online per batch-size bucket from measured forwards (the machine's speed drifts, and a
batch of many short sequences is not one long one) as a slope and an offset, so that what one more
row adds is measured too; a plain decode step's price is such a line in its batch size itself (the
profile of one sequence does not tell a batch's sizes apart). The proposer's cost per draft step and
per catch-up token starts from its own start-up timing (`DraftCostProfile`) and is learned online per
batch-size bucket, and a fixed per-step overhead too. What drafting steps delivered against plain
ones and against the controller's `Promise` for them is kept per bucket too (`shortfall`).

Pure Python (no torch): the scheduler's controller uses it.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

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
# it is thin enough for a stale price to have decided it (spec_controller.REFRESH_MARGIN), and that
# step's residual restarts the calibration's offset. A step without drafts in 40 at such a thin margin
# costs < 0.5%.
STALE_FORWARDS = 40
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
# "Priced below the plain step" means below it by more than this share of the plain price: timing noise
# alone puts a step with a few draft rows below a plain one (Qwen pair at one sequence on the EPYC VM:
# 4 tokens 91.0 ms, 1 token 89.5 ms, forwards of one size spread by sd(log) 0.08-0.12), and each such
# reading restarted a price or cost a plain refreshing step. Simulated over 41 prompts' draft-agreement
# traces with that noise (docs/bench/issue20-s45/margin_sim.py), no margin kept adaptive at 0.961x /
# 0.967x of the best static K per category (benchmark / held-out prompts) with 8.5% / 6.2% of its
# steps undrafted; 0.10 at 0.970x / 0.980x with 4.0% / 2.6%. On the machine, two engines taking the
# same prompts in turn (margin_ab.py), 0.10 ran 1.012x / 1.016x as fast as no margin, 5.1% of its steps
# undrafted against 8.8%. The slow spell above (117 ms against 89-102 ms, 13-24% apart) is still
# caught. A plain price above drafting's by less than the margin is measured again once it is
# STALE_FORWARDS old, whatever drafting's margin: on its floor the draft rows of a step priced 5%
# below it are priced at nothing.
INCONSISTENT_MARGIN = 0.10
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


def batch_bucket(n: int) -> int:
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
    return batch_bucket(num_sequences), prefill, num_tokens > num_sequences


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
        inconsistent_margin: float = INCONSISTENT_MARGIN,
    ):
        """target_curve: (tokens in one forward, seconds), from a profile; draft_cost_ratio: the
        proposer's cost per draft step as a fraction of the target's step at the same batch size
        before any measurement (its weights over the target's: 0 for n-gram lookup), used when the
        proposer timed nothing at start-up (`draft_profile`); inconsistent_margin: how far below the
        plain step's price a step with draft rows must be priced before the two count as disagreeing
        (INCONSISTENT_MARGIN)."""
        if not 0.0 <= inconsistent_margin < 1.0:
            raise ValueError(f"inconsistent_margin must be in [0, 1), got {inconsistent_margin}")
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
        self.inconsistent_margin = inconsistent_margin
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
        bucket = batch_bucket(num_sequences)
        plain = self._calibration.get((bucket, False, False))
        if plain is None or not plain.settled:
            # Any forward of this batch size measured (a prefill's too): it runs here, and from its
            # first decode step on, drafting waits for a plain price of its own.
            return any(b == bucket for b, _, _ in self._calibration)
        return self._age(bucket, plain) >= STALE_FORWARDS

    def _age(self, bucket: int, calibration: _Calibration) -> int:
        """Decode forwards of this batch bucket since this kind of step was last measured."""
        return self._forwards.get(bucket, 0) - calibration.last_forward

    def _below_plain(self, bucket: int, num_sequences: int, profiled: float, margin: float) -> bool:
        """Whether a step with draft rows (its regressor `profiled`) is priced by its own calibration
        below the plain step of the same batch by theirs, by more than `margin` of the plain price
        (INCONSISTENT_FORWARDS, INCONSISTENT_MARGIN)."""
        plain = self._calibration.get((bucket, False, False))
        drafting = self._calibration.get((bucket, False, True))
        if plain is None or drafting is None or not plain.settled or not drafting.settled:
            return False
        plain_price = plain.predict(float(max(1, num_sequences)))
        return drafting.predict(profiled) < (1.0 - margin) * plain_price

    def plain_is_behind(self, num_sequences: int) -> bool:
        """Whether this batch size's plain price is above what the last step with draft rows is priced
        at by its own calibration, by more than `inconsistent_margin` and last measured
        INCONSISTENT_FORWARDS or more decode forwards of it ago, or by any amount and last measured
        STALE_FORWARDS or more ago (steps with draft rows ran since): then the plain price is the
        stale one, and the drafting steps' prices rest on the floor it sets (`target_seconds`), so
        their rows look free.
        The last drafting step's own shape is compared, not one extrapolated along the profile: steps
        of eight rows priced right extrapolate to one row below a plain step that costs as much."""
        bucket = batch_bucket(num_sequences)
        plain = self._calibration.get((bucket, False, False))
        if plain is None:
            return False
        age = self._age(bucket, plain)
        if age >= STALE_FORWARDS:
            # Below it by less than the noise too: rows priced at nothing on the plain price's floor
            # would otherwise stay so for as long as drafting's margin is wide.
            return self._plain_above_drafting(bucket, 0.0)
        return age >= INCONSISTENT_FORWARDS and self._plain_above_drafting(bucket, self.inconsistent_margin)

    def _plain_above_drafting(self, bucket: int, margin: float) -> bool:
        """Whether the last step with draft rows of this batch bucket is priced by its own calibration
        below the plain step of its batch size by more than `margin` of the plain price."""
        drafting = self._calibration.get((bucket, False, True))
        return drafting is not None and self._below_plain(bucket, *drafting.last_shape, margin)

    def plain_is_measured(self, num_sequences: int) -> bool:
        """Whether the plain decode steps of this batch size were measured RESTART_FORWARDS times. Until
        then their price is the steps with draft rows' calibration standing in, or one or two
        forwards, and that is no price: on the AVX-512 Xeon the first drafting steps
        at 2 Qwen clients (0.77 s for 4 rows, with catch-ups) priced a plain step at 0.59 s where it
        took 0.30 s, so drafting looked 1.6x better than it was and went on at 0.8x of the plain speed
        with nothing to correct it."""
        plain = self._calibration.get((batch_bucket(num_sequences), False, False))
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
        recent = self._draft_steps.get(batch_bucket(num_requests))
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
            # this step's own old price, with draft rows
            self._below_plain(bucket, num_sequences, x, self.inconsistent_margin)
            if key[2]
            else self._plain_above_drafting(bucket, self.inconsistent_margin)
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
        recent = self._draft_steps.setdefault(batch_bucket(num_requests), deque(maxlen=DRAFT_WINDOW))
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
        plain, drafting = self._realized.setdefault(batch_bucket(num_sequences), (_Realized(), _Realized()))
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
        own = batch_bucket(num_sequences)
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
        kinds = self._realized.get(batch_bucket(num_sequences))
        return kinds is not None and kinds[1].trusted_once

    def observe_overhead(self, seconds: float) -> None:
        self.overhead_seconds += OVERHEAD_ALPHA * (max(0.0, seconds) - self.overhead_seconds)
