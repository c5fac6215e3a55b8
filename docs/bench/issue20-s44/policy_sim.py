"""The speculation controller at batch 1, simulated on recorded traces (agreement_traces.py): the
engine's own `SpeculationController` decides k every step, a window of k drafts from answer position
t accepts min(k, run of draft agreements from t), and a step costs what the Qwen pair's steps cost on
this machine (fitted from the qa check's step log, results/category_ab-qa-steps.jsonl.xz: target
forward 89 ms for one token, ~105 ms for eight; 10.8 ms a draft token; 2.2 ms a catch-up token). The
same traces give static K = 1..8 and speculation off. Requests run one after another in one
controller, as the policy bench runs them. Only the draft model (no n-gram lookup).

    python policy_sim.py TRACES.json [MAX_TOKENS] [SET ...]

Variants of the acceptance model's constants are set with NAME=VALUE arguments (e.g. PRIOR_WEIGHT=4).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specserve.engine import acceptance_model
from specserve.engine.spec_controller import Candidate, SpeculationController
from specserve.engine.step_cost_model import INCONSISTENT_MARGIN, DraftCostProfile, StepCostModel

K_MAX = 8
CURVE = [(1, 0.089), (4, 0.091), (6, 0.100), (9, 0.108), (16, 0.125), (64, 0.35), (512, 2.3)]
DRAFT_TOKEN_S, CATCH_UP_TOKEN_S, OVERHEAD_S = 0.0108, 0.0022, 0.001


def target_seconds(tokens: int) -> float:
    for (x0, y0), (x1, y1) in zip(CURVE, CURVE[1:], strict=False):
        if tokens <= x1:
            return y0 + (y1 - y0) * max(0, tokens - x0) / (x1 - x0)
    return CURVE[-1][1]


def step_seconds(k: int, setup: int) -> float:
    return target_seconds(1 + k) + DRAFT_TOKEN_S * k + (CATCH_UP_TOKEN_S * setup if k else 0.0) + OVERHEAD_S


def run_length(agree: list[int], t: int) -> int:
    n = 0
    while t + n < len(agree) and agree[t + n]:
        n += 1
    return n


def static_seconds(agree: list[int], max_tokens: int, k: int, prompt_tokens: int) -> float:
    """Output token 0 comes from the prefill (not timed here, the same in every arm)."""
    t, seconds, first = 1, 0.0, True
    while t < max_tokens:
        kk = min(k, max_tokens - t - 1)
        acc = min(kk, run_length(agree, t))
        seconds += step_seconds(kk, (prompt_tokens + 1 if first else 2) if kk else 0)
        first = first and kk == 0
        t += acc + 1
    return seconds


def exact(seconds: float) -> float:
    return seconds


def adaptive_seconds(
    ctl: SpeculationController,
    rid: str,
    agree: list[int],
    max_tokens: int,
    prompt_tokens: int,
    measure: Callable[[float], float] = exact,
    plain: list[int] | None = None,
    phase_hint: bool = False,
) -> tuple[float, float]:
    """The request's time under the controller and its mean k. `measure` turns a modelled forward or
    draft time into the one the controller is shown (noise_sim.py: the machine's noise); the arm is
    charged the modelled time. `plain`, when given, counts [steps that could draft, steps given none].
    `phase_hint`: each proposal's class (Candidate.hint) is whether the request's last window was
    accepted in full (issue20-s45/phase_hint_sim.py); otherwise no class."""
    t, seconds, missing, ks = 1, 0.0, prompt_tokens + 1, []
    full = 0  # the last window with drafts was accepted in full
    while t < max_tokens:
        cap = min(K_MAX, max_tokens - t - 1)
        hint = full if phase_hint else None
        cand = Candidate(rid, cap, False, hint, (), False, missing, max_tokens - t)
        decision = ctl.choose([cand], 1, 1, 8192)
        k = decision.k.get(rid, 0)
        if plain is not None and cap > 0:
            plain[0] += 1
            plain[1] += k == 0
        acc = min(k, run_length(agree, t))
        setup = missing if k else 0
        forward = measure(target_seconds(1 + k))
        draft = measure(DRAFT_TOKEN_S * k + CATCH_UP_TOKEN_S * setup) if k else 0.0
        cost = ctl.cost
        cost.observe_target(1, 1 + k, forward, 0)
        if k:
            if rid in decision.probed:
                cost.observe_probe(1, draft, setup)
            else:
                cost.observe_draft(1, k, draft, setup)
        cost.observe_overhead(OVERHEAD_S)
        if rid not in decision.probed:
            ctl.observe_step(1, k > 0, acc + 1, forward + draft + OVERHEAD_S, decision.promise)
        ctl.observe_verification(rid, k, acc, list(range(acc + 1)))
        seconds += step_seconds(k, setup)
        ks.append(k)
        if k:
            full = int(acc == k)
        # The draft's cache: after a window it lacks the bonus token (and the last draft when all
        # were accepted); without a window it falls one token further behind.
        missing = (2 if acc == k else 1) if k else missing + 1
        t += acc + 1
    ctl.forget(rid)
    return seconds, statistics.mean(ks)


def make_controller(
    acceptance: acceptance_model.AcceptanceModel | None = None,
    inconsistent_margin: float = INCONSISTENT_MARGIN,
) -> SpeculationController:
    profile = DraftCostProfile(((1, DRAFT_TOKEN_S),), CATCH_UP_TOKEN_S)
    cost = StepCostModel(CURVE, draft_profile=profile, inconsistent_margin=inconsistent_margin)
    return SpeculationController(K_MAX, cost, acceptance)


Seconds = dict[str, dict[str, float]]  # category -> arm ("off", "k1".."k8", "adaptive") -> seconds


def simulate(
    traces: list[dict[str, Any]],
    max_tokens: int,
    ctl: SpeculationController,
    measure: Callable[[float], float] = exact,
    plain: list[int] | None = None,
    phase_hint: bool = False,
) -> tuple[Seconds, dict[str, list[float]]]:
    """Every arm's seconds per category, and adaptive's mean k per request by category."""
    by_cat: Seconds = defaultdict(lambda: defaultdict(float))
    mean_k: dict[str, list[float]] = defaultdict(list)
    for i, tr in enumerate(traces):
        agree, n = tr["agree"], tr["prompt_tokens"]
        cat = by_cat[tr["category"]]
        cat["off"] += (max_tokens - 1) * step_seconds(0, 0)
        for k in range(1, K_MAX + 1):
            cat[f"k{k}"] += static_seconds(agree, max_tokens, k, n)
        s, mk = adaptive_seconds(ctl, f"r{i}", agree, max_tokens, n, measure, plain, phase_hint)
        cat["adaptive"] += s
        mean_k[tr["category"]].append(mk)
    return by_cat, mean_k


def vs_oracle(cat: dict[str, float]) -> tuple[str, float]:
    """The category's fastest static K and adaptive's speed against it."""
    oracle = min((k for k in cat if k.startswith("k")), key=lambda k: cat[k])
    return oracle, cat[oracle] / cat["adaptive"]


def mean_vs_oracle(by_cat: Seconds) -> float:
    return statistics.mean(vs_oracle(cat)[1] for cat in by_cat.values())


def report(by_cat: Seconds, mean_k: dict[str, list[float]]) -> str:
    lines = [
        f"{'category':15s} {'adaptive/oracle':>15s} {'oracle':>6s} {'adaptive/K5':>11s} {'off/adaptive':>12s} mean k"
    ]
    ratios, vs_k5 = [], []
    for name, cat in by_cat.items():
        oracle, ratio = vs_oracle(cat)
        ratios.append(ratio)
        vs_k5.append(cat["k5"] / cat["adaptive"])
        lines.append(
            f"{name:15s} {ratio:15.3f} {oracle:>6s} {vs_k5[-1]:11.3f} {cat['off'] / cat['adaptive']:12.3f}"
            f" {statistics.mean(mean_k[name]):.2f}"
        )
    within = sum(v >= 0.97 for v in ratios)
    lines.append(
        f"mean adaptive/oracle {statistics.mean(ratios):.3f} (within 3%: {within} of {len(ratios)}),"
        f" mean adaptive/K5 {statistics.mean(vs_k5):.3f}"
    )
    return "\n".join(lines)


def load_traces(path: str, sets: list[str]) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return [tr for tr in data["traces"] if tr["set"] in (set(sets) or {"bench"})]


def main() -> None:
    args = [a for a in sys.argv[1:] if "=" not in a]
    for a in sys.argv[1:]:
        if "=" in a:
            name, value = a.split("=", 1)
            if not hasattr(acceptance_model, name):
                raise SystemExit(f"acceptance_model has no {name}")
            setattr(acceptance_model, name, float(value))
    max_tokens = int(args[1]) if len(args) > 1 else 48
    print(report(*simulate(load_traces(args[0], args[2:]), max_tokens, make_controller())))


if __name__ == "__main__":
    main()
