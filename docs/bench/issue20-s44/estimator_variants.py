"""Two other readings of a request's draft positions without recent trials, in `policy_sim.py`'s
simulation (the engine's controller at batch 1 on recorded traces), against the acceptance model as
built:

- "later pooled apart": positions after the first read the request's rate over its later positions
  (the first draft after a correction is the hard one: qa answers' first drafts ~0.6, later ~0.9),
  not its rate over all positions;
- "deepest tried": a position beyond the deepest one with trials reads that position's estimate.

    python estimator_variants.py TRACES.json
"""

from __future__ import annotations

import sys
from pathlib import Path

from specserve.engine import acceptance_model as am

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy_sim  # noqa: E402


class LaterPooledApart(am.AcceptanceModel):
    def rates(self, request_id: str, prior: float | None = None, hint: int | None = None) -> list[float]:
        prior = prior if prior is not None else self.global_rate(hint)
        own = self._requests.get(request_id, {}).get(hint)
        if own is None:
            return [prior] * self.k_max
        pooled = (sum(own.hits) + am.PRIOR_WEIGHT * prior) / (sum(own.trials) + am.PRIOR_WEIGHT)
        later = (sum(own.hits[1:]) + am.PRIOR_WEIGHT * pooled) / (sum(own.trials[1:]) + am.PRIOR_WEIGHT)
        return [
            (h + am.POSITION_WEIGHT * (pooled if j == 0 else later)) / (t + am.POSITION_WEIGHT)
            for j, (h, t) in enumerate(zip(own.hits, own.trials, strict=True))
        ]


class DeepestTried(am.AcceptanceModel):
    def rates(self, request_id: str, prior: float | None = None, hint: int | None = None) -> list[float]:
        rates = super().rates(request_id, prior, hint)
        own = self._requests.get(request_id, {}).get(hint)
        if own is None:
            return rates
        out, last = [], None
        for a, t in zip(rates, own.trials, strict=True):
            if t >= 0.5:  # decayed trial counts: at least half a recent trial
                last = a
            out.append(a if t >= 0.5 or last is None else last)
        return out


def main() -> None:
    for name, model in (
        ("as built", am.AcceptanceModel),
        ("later pooled apart", LaterPooledApart),
        ("deepest tried", DeepestTried),
    ):
        for sets in (["heldout-s44", "heldout-s36"], ["bench"]):
            traces = policy_sim.load_traces(sys.argv[1], sets)
            ctl = policy_sim.make_controller(model(policy_sim.K_MAX))
            print(f"# {name} [{' '.join(sets)}]")
            print(policy_sim.report(*policy_sim.simulate(traces, 48, ctl)))
            print()


if __name__ == "__main__":
    main()
