"""Statistics for the benchmark harness: medians, percentiles and paired ratios (pure Python).

Machines here are shared and noisy, so every speed claim is a ratio of two measurements taken next to each
other in the same run (A B A B ...): `paired_ratios` pairs them by key (prompt, repeat) and the summary is
the median of the per-pair ratios, which is robust to a burst of load hitting one pair.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from specserve.engine.stats import acceptance_rate, mean_acceptance_length


def _clean(values: Iterable[float | None]) -> list[float]:
    return sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))


def median(values: Iterable[float | None]) -> float | None:
    """Median of the finite values; None when there are none."""
    xs = _clean(values)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = _clean(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(
    values: Iterable[float | None], qs: Sequence[float] = (50, 90, 99)
) -> dict[str, float | None]:
    xs = _clean(values)
    return {f"p{q:g}": percentile(xs, q) for q in qs}


def mean(values: Iterable[float | None]) -> float | None:
    xs = _clean(values)
    return sum(xs) / len(xs) if xs else None


def paired_ratios(
    numerator: Mapping[Hashable, float | None], denominator: Mapping[Hashable, float | None]
) -> list[float]:
    """Per-key ratios numerator[k] / denominator[k] for keys present (and positive) in both, in key order
    of `numerator`. Unpaired keys are dropped: a ratio is only ever taken between neighbours."""
    out = []
    for key, num in numerator.items():
        den = denominator.get(key)
        if num is None or den is None or not math.isfinite(num) or not math.isfinite(den) or den <= 0:
            continue
        out.append(num / den)
    return out


def median_paired_ratio(
    numerator: Mapping[Hashable, float | None], denominator: Mapping[Hashable, float | None]
) -> float | None:
    return median(paired_ratios(numerator, denominator))


@dataclass(frozen=True)
class PairedRatio:
    """One arm against another: the per-pair ratios, their median, and how many pairs it came out ahead."""

    ratios: list[float]

    @property
    def median(self) -> float | None:
        return median(self.ratios)

    @property
    def ahead(self) -> int:
        return sum(r > 1 for r in self.ratios)


def compare(
    numerator: Mapping[Hashable, float | None], denominator: Mapping[Hashable, float | None]
) -> PairedRatio:
    return PairedRatio(paired_ratios(numerator, denominator))


def acceptance(
    num_drafts: int, num_draft_tokens: int, num_accepted: int
) -> tuple[float | None, float | None]:
    """(acceptance rate, mean acceptance length); None where nothing was drafted. The length counts the
    token every verification adds on its own (the recovered or bonus token): 1 + accepted per draft."""
    rate = acceptance_rate(num_accepted, num_draft_tokens) if num_draft_tokens else None
    length = mean_acceptance_length(num_accepted, num_drafts) if num_drafts else None
    return rate, length


def geomean(values: Iterable[float | None]) -> float | None:
    xs = [x for x in _clean(values) if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def round_or_none(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)
