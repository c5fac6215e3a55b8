"""What the speculation controller expects drafts to deliver (engine/spec_controller.py).

`AcceptanceModel`: per request and draft position j, the chance that draft j is accepted given that
drafts 0..j-1 were. Counts decay, so a change of content (a copy-heavy section starts) shows within
a few verifications; a new request starts from every request's recent statistics. The expected
tokens one verification emits with k drafts is 1 + sum_{m<=k} prod_{j<=m} a_j (`expected_tokens`).
A request's estimate below its class's global rate drifts back up to it while its proposals go
unjudged (`AcceptanceModel.relax`): a low estimate would otherwise stop the very drafts that could
raise it. `GainCalibration`: what the controller's chosen drafts delivered against that expectation.

Pure Python (no torch): the scheduler's controller uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Pseudo-observations the global estimate is worth inside a request's pooled estimate, and the
# pooled estimate inside each position's.
PRIOR_WEIGHT = 2.0
POSITION_WEIGHT = 2.0
# Per-observation decay of a request's counts (memory ~5 verifications) and the global counts (~200).
REQUEST_DECAY = 0.8
GLOBAL_DECAY = 0.995
# What the controller's own drafts delivered against what it predicted for them: accepted drafts over
# expected accepted drafts, decayed per verification (memory ~30), with GAIN_PRIOR_TOKENS pseudo-tokens
# at 1. A request is drafted when its estimate is high, and its estimate is high partly by chance, so
# chosen drafts deliver less than the estimate said (the winner's curse): on the AVX-512 Xeon at 2 Qwen
# clients the controller's drafts were accepted 157 times where it expected 210 (0.75), at 4 clients
# 96 where it expected 110. The expected tokens of every adaptive slot are scaled by that ratio, never
# above 1 (a model that is too cautious is left alone: drafting must never cost) nor below
# MIN_GAIN_CALIBRATION. Kept apart for free proposals (lookups, whose previews are judged without
# drafting) and the proposals a model drafts. A window counts as much as its request's estimate
# rested on the request's own counts (AcceptanceModel.own_share): the curse is chance in those counts,
# and a young request's estimate is the global rate, whose shortfall its own counts learn at once.
# Counted in full, a young request's rejections were counted twice: at batch 1 the Qwen pair's
# translation-3 had its first two windows rejected, the calibration fell 0.91 -> 0.855 on them, and
# its plans sat at 0.95-0.999 of the bar for 7-8 of its 22-23 steps (docs/bench/issue20-s51).
GAIN_CALIBRATION_DECAY = 0.97
# And a step that weighs costly proposals (a draft model's) and chooses none of them forgets as much as
# a verification does (GainCalibration.age; SpeculationController._age_unchosen says why lookups'
# calibration does not), so the factor drifts back to 1 while nothing updates it. Without it, one
# bad drafting step could stop drafting for good: at 4 Qwen-pair clients (AMD EPYC, in-process) four
# requests whose first windows were all accepted were given 8 drafts each, far fewer of the 32 were
# accepted than expected, the factor fell to 0.53 in that one step, the best plan fell to 0.82-0.89 of
# the bar (1.6-1.7 before), and drafting stayed off for the rest of the cell. Served beside a static
# K=1 arm, the adaptive cells drafted in 3-38 of 158-213 steps (the step log's calibration 0.67-0.88),
# where cells of a run without that arm drafted in 75-93 of 114-143; with the ageing, 67-97 of 115-138
# (adaptive 1.11x of off where it was 1.02x; docs/bench/issue20-s49).
GAIN_PRIOR_TOKENS = 4.0
MIN_GAIN_CALIBRATION = 0.5
# Per step in which a request's proposal is not judged (not drafted, not previewed), its own counts
# fade by this factor while its estimate is below its class's global rate (AcceptanceModel.relax).
# A low estimate censors itself: it stops the drafts whose verifications could raise it, and probes
# are rationed (PROBE_BUDGET, a catch-up in each probe's price). At batch 1 the Qwen pair's
# translation-3, whose draft misses the answer's first tokens and agrees with most later ones, had its
# first windows (7, 4, 2, 1 drafts) rejected, then drafted in none of the next 43 steps (0.94x of off
# against static K=6's 1.74x in s49b; alike in 4 of the 7 policy benches s44-s49b without s48's
# fade, docs/bench/issue20-s50). A high estimate does not censor itself (a request drafted is
# verified) and is not faded: s48's fade, both ways, also took good requests towards the global rate
# in every step without drafts, and with it the 4-client Qwen-pair cells ran about twice as many
# plain steps (why was not established; docs/bench/issue20-s48).
# 0.9 halves the counts in ~7 steps, well inside the 43 that request had left.
RELAX_DECAY = 0.9


@dataclass
class _Counts:
    hits: list[float]
    trials: list[float]

    @classmethod
    def zeros(cls, n: int) -> _Counts:
        return cls([0.0] * n, [0.0] * n)

    def fade(self, factor: float) -> None:
        for j in range(len(self.hits)):
            self.hits[j] *= factor
            self.trials[j] *= factor

    def observe(self, num_drafts: int, num_accepted: int, decay: float) -> None:
        """Drafts 0..num_accepted-1 were accepted; draft num_accepted (if proposed) was rejected;
        later ones were never judged."""
        self.fade(decay)
        for j in range(min(num_accepted + 1, num_drafts, len(self.hits))):
            self.trials[j] += 1.0
            if j < num_accepted:
                self.hits[j] += 1.0


def _pooled(own: _Counts, prior: float) -> float:
    """A request's acceptance over all the positions it was judged at, with `prior` (its class's
    global rate) worth PRIOR_WEIGHT observations."""
    return (sum(own.hits) + PRIOR_WEIGHT * prior) / (sum(own.trials) + PRIOR_WEIGHT)


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
        pooled = _pooled(own, prior)
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

    def relax(self, request_id: str, hint: int | None, factor: float) -> None:
        """A step that did not judge the request's proposal of class `hint`: if its own estimate is
        below the class's global rate, its counts fade by `factor`, so the estimate drifts up towards
        that rate (and stops there: fading only moves the pooled rate towards its prior). An estimate
        above it is left: see RELAX_DECAY."""
        own = self._requests.get(request_id, {}).get(hint)
        if own is None:
            return
        prior = self.global_rate(hint)
        if _pooled(own, prior) < prior:
            own.fade(factor)

    def own_share(self, request_id: str, hint: int | None = None) -> float:
        """How much of the request's pooled estimate for class `hint` is its own counts rather than
        the global prior: its trials over trials + PRIOR_WEIGHT (0 for a request never judged)."""
        own = self._requests.get(request_id, {}).get(hint)
        if own is None:
            return 0.0
        trials = sum(own.trials)
        return trials / (trials + PRIOR_WEIGHT)

    def has_observations(self, request_id: str) -> bool:
        return request_id in self._requests

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


@dataclass
class GainCalibration:
    """Accepted drafts over the acceptance model's expectation for the drafts the controller chose."""

    expected: float = 0.0
    accepted: float = 0.0

    def observe(self, expected: float, accepted: int, weight: float = 1.0) -> None:
        """One verification of chosen drafts: `expected` accepted drafts were predicted, `accepted`
        were; worth `weight` of a verification (AcceptanceModel.own_share says why less)."""
        self.age()
        self.expected += weight * max(0.0, expected)
        self.accepted += weight * max(0, accepted)

    def age(self) -> None:
        """One step's (or verification's) worth of forgetting: the factor drifts towards 1."""
        self.expected *= GAIN_CALIBRATION_DECAY
        self.accepted *= GAIN_CALIBRATION_DECAY

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
