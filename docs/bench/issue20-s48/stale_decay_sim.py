"""`issue20-s44/policy_sim.py` (the engine's controller at batch 1 on recorded draft-agreement traces) with
the fade of undrafted requests' acceptance counts (spec_controller.STALE_DECAY) set to each value given;
1 is the controller without it. With and without the machine's timing noise (`noise_sim.py`'s
log-normal factor on every measured time, six seeds), on the benchmark's prompts and the held-out
ones. Prints, per setting, adaptive / best static K (mean over categories) and the requests whose mean
k fell below 1 (drafting stopped for most of the request), by prompt.

    python stale_decay_sim.py TRACES.json MAX_TOKENS SIGMA DECAY [DECAY ...]
    python stale_decay_sim.py ../issue20-s44/results/agreement_traces.json 48 0.1 1 0.95 0.9 0.8

The fade was built in e59975f and reverted in the next commit (README.md here): run this at e59975f.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specserve.engine import spec_controller

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-s44"))
import policy_sim  # noqa: E402

SEEDS = range(6)
SETS = (["bench"], ["heldout-s44", "heldout-s36"])


def measure(sigma: float, seed: int) -> Callable[[float], float]:
    """The times the controller is shown: the modelled ones, times a log-normal factor when sigma > 0."""
    if sigma <= 0:
        return policy_sim.exact
    rng = random.Random(seed)
    return lambda seconds: seconds * rng.lognormvariate(0.0, sigma)


def run(traces: list[dict[str, Any]], max_tokens: int, sigma: float, seed: int) -> tuple[float, list[str]]:
    """Adaptive / best static K (mean over categories), and the prompts whose adaptive mean k < 1."""
    ctl = policy_sim.make_controller()
    by_cat, mean_k = policy_sim.simulate(traces, max_tokens, ctl, measure(sigma, seed))
    seen: dict[str, int] = {}  # category -> requests of it so far (mean_k keeps them in trace order)
    low = []
    for tr in traces:
        i = seen[tr["category"]] = seen.get(tr["category"], -1) + 1
        if mean_k[tr["category"]][i] < 1.0:
            low.append(tr["id"])
    return policy_sim.mean_vs_oracle(by_cat), low


def main() -> None:
    path, max_tokens, sigma = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    decays = [float(a) for a in sys.argv[4:]]
    if not hasattr(spec_controller, "STALE_DECAY"):
        raise SystemExit("stale_decay_sim.py: this controller has no STALE_DECAY; run it at commit e59975f")
    print(f"# python stale_decay_sim.py {' '.join(sys.argv[1:])}")
    for decay in decays:
        spec_controller.STALE_DECAY = decay
        for sets in SETS:
            traces = policy_sim.load_traces(path, sets)
            quiet, quiet_low = run(traces, max_tokens, 0.0, 0)
            noisy = [run(traces, max_tokens, sigma, seed) for seed in SEEDS]
            stopped = sorted({p for _, low in noisy for p in low} | set(quiet_low))
            print(
                f"STALE_DECAY {decay:<5} {' '.join(sets):24s} no noise {quiet:.3f};"
                f" sigma {sigma}: mean {statistics.mean(r for r, _ in noisy):.3f}"
                f" (seeds {' '.join(f'{r:.3f}' for r, _ in noisy)});"
                f" mean k < 1: {', '.join(stopped) or 'none'}"
            )


if __name__ == "__main__":
    main()
