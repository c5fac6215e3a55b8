"""s44's batch-1 simulation (`../issue20-s44/policy_sim.py`: the engine's own controller, the Qwen
pair's step prices on the AMD EPYC) with windows that end where the draft's chain turns unsure: after
the first draft at which the product of the draft's probabilities of its drafts (its argmax, greedy)
falls below a threshold. Arms, per category against the same-run oracle (the best static K, whole
windows):

- adaptive: the controller as built, windows of its k (proposals that cannot end early);
- adaptive_stop: the controller told that proposals end where unsure (Candidate.stops_unsure): it
  raises their k to the cap and gives the threshold (Decision.stop_below);
- kN_chainT: static K=N windows ending below the fixed chain probability T (arguments), for reference.

    python stop_sim.py TRACES.json [T ...]

TRACES.json from `confidence_traces.py`. A draft after the first disagreement is drafted from the
draft's own context, whose confidence the traces do not hold: the sim reads the target context's.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "issue20-s44"))
import policy_sim as ps  # noqa: E402

from specserve.engine.spec_controller import Candidate, SpeculationController  # noqa: E402

MAX_TOKENS = 48
SETS = {"bench": ["bench"], "held-out": ["heldout-s44", "heldout-s36"]}


def drafted(conf: list[float], t: int, k: int, threshold: float) -> int:
    """Drafts a window of at most k from position t holds: it ends after the draft that takes the
    chain probability below threshold."""
    chain = 1.0
    for i in range(k):
        chain *= conf[t + i] if t + i < len(conf) else 0.0
        if chain < threshold:
            return i + 1
    return k


def static_seconds(tr: dict, k: int, threshold: float) -> float:
    agree, conf, prompt = tr["agree"], tr["confidence"], tr["prompt_tokens"]
    t, seconds, first = 1, 0.0, True
    while t < MAX_TOKENS:
        kk = min(k, MAX_TOKENS - t - 1)
        kk = drafted(conf, t, kk, threshold) if kk else 0
        acc = min(kk, ps.run_length(agree, t))
        seconds += ps.step_seconds(kk, (prompt + 1 if first else 2) if kk else 0)
        first = first and kk == 0
        t += acc + 1
    return seconds


def adaptive_seconds(ctl: SpeculationController, rid: str, tr: dict, unsure: bool, log: list) -> float:
    agree, conf = tr["agree"], tr["confidence"]
    t, seconds, missing = 1, 0.0, tr["prompt_tokens"] + 1
    while t < MAX_TOKENS:
        cap = min(ps.K_MAX, MAX_TOKENS - t - 1)
        cand = Candidate(rid, cap, False, None, (), False, missing, MAX_TOKENS - t, unsure)
        decision = ctl.choose([cand], 1, 1, 8192)
        k = decision.k.get(rid, 0)
        if k and rid in decision.stop_below:
            log.append(decision.stop_below[rid])
            k = drafted(conf, t, k, decision.stop_below[rid])
        acc = min(k, ps.run_length(agree, t))
        setup = missing if k else 0
        forward = ps.target_seconds(1 + k)
        draft = ps.DRAFT_TOKEN_S * k + ps.CATCH_UP_TOKEN_S * setup if k else 0.0
        ctl.cost.observe_target(1, 1 + k, forward, 0)
        if k:
            if rid in decision.probed:
                ctl.cost.observe_probe(1, draft, setup)
            else:
                ctl.cost.observe_draft(1, k, draft, setup)
        ctl.cost.observe_overhead(ps.OVERHEAD_S)
        if rid not in decision.probed:
            ctl.observe_step(1, k > 0, acc + 1, forward + draft + ps.OVERHEAD_S, decision.promise)
        ctl.observe_verification(rid, k, acc, list(range(acc + 1)))
        seconds += ps.step_seconds(k, setup)
        missing = (2 if acc == k else 1) if k else missing + 1
        t += acc + 1
    ctl.forget(rid)
    return seconds


def run(traces: list[dict], thresholds: list[float]) -> tuple[dict[str, dict[str, float]], list[float]]:
    by_cat: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    ctl, ctl_stop, log = ps.make_controller(), ps.make_controller(), []
    for i, tr in enumerate(traces):
        cat = by_cat[tr["category"]]
        for k in range(1, ps.K_MAX + 1):
            cat[f"k{k}"] += static_seconds(tr, k, 0.0)
        for threshold in thresholds:
            cat[f"k8_chain{threshold}"] += static_seconds(tr, 8, threshold)
        cat["adaptive"] += adaptive_seconds(ctl, f"r{i}", tr, False, [])
        cat["adaptive_stop"] += adaptive_seconds(ctl_stop, f"r{i}", tr, True, log)
    return by_cat, log


def main() -> None:
    data = json.loads(Path(sys.argv[1]).read_text())
    thresholds = [float(x) for x in sys.argv[2:]] or [0.1, 0.2, 0.3]
    for name, groups in SETS.items():
        by_cat, log = run([tr for tr in data["traces"] if tr["set"] in groups], thresholds)
        arms = ["adaptive", "adaptive_stop"] + [f"k8_chain{t}" for t in thresholds]
        print(f"[{name}] vs same-run oracle (mean over categories, categories within 3%)")
        for arm in arms:
            ratios = {c: min(v[f"k{k}"] for k in range(1, ps.K_MAX + 1)) / v[arm] for c, v in by_cat.items()}
            cells = " ".join(f"{c}:{r:.3f}" for c, r in ratios.items())
            within = sum(r >= 0.97 for r in ratios.values())
            print(f"  {arm:16s} {statistics.mean(ratios.values()):.3f} ({within}/{len(ratios)})  {cells}")
        if log:
            q = statistics.quantiles(log, n=10)
            print(
                f"  adaptive_stop thresholds: median {statistics.median(log):.3f}, 10-90% {q[0]:.3f}-{q[-1]:.3f}"
            )


if __name__ == "__main__":
    main()
