"""What the adaptive policy's deciding costs a step at 16 SmolLM2 (n-gram) sequences, in one process,
with quiet spells (SpeculationController.quiet_decision) and without.

One engine (the served defaults: SmolLM2 bf16, n-gram lookup, adaptive policy), 16 of the benchmark's
prompts decoded together (3 a category in category order, the first 16), 64 greedy tokens each (EOS
ignored). Three arms take turns, the order rotating every round: speculation off per request;
adaptive as built; adaptive weighing every step (the controller's quiet_share set to infinity, so no
spell starts). Each decode-only step with 12 or more sequences is timed in parts: the scheduler's
speculation plan (the previews, then `choose` or, in a quiet step, `quiet_decision`), `choose` alone,
the proposer, the forward, and the rest of the step. Means and medians over those steps; the adaptive
arms' tokens are checked equal. And the best drafting plan's goodput over the bar in the
weigh-every-step arm's decisions at 12 or more sequences (what QUIET_HEADROOM is compared with).

    python machinery.py ROUNDS [--profile]
"""

from __future__ import annotations

import cProfile
import math
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_controller import QUIET_SHARE

PARTS = ("step", "plan", "choose", "propose", "forward", "rest")
ARMS = ("off", "adaptive", "weigh-every-step")


def timed(parts: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def main() -> None:
    rounds = int(sys.argv[1])
    profile = "--profile" in sys.argv
    torch.set_num_threads(2)
    llm = LLM(max_kv_cache_tokens=131072)
    engine = llm.engine
    controller = engine.controller
    assert controller is not None
    prompts = [p.messages for p in load_prompts(list(CATEGORIES), 3)][:16]
    parts: dict[str, float] = {}
    engine.scheduler._speculation_plan = timed(parts, "plan", engine.scheduler._speculation_plan)
    controller.choose = timed(parts, "choose", controller.choose)  # type: ignore[method-assign]
    engine._propose = timed(parts, "propose", engine._propose)
    engine._forward = timed(parts, "forward", engine._forward)
    step = engine.step
    # The best drafting plan's goodput over the bar (SpeculationController._decide's headroom), for the
    # weigh-every-step arm's decisions at 12 or more sequences.
    headrooms: list[float] = []
    arm_now = [""]
    decide = controller._decide

    def recorded_decide(candidates: Any, num_sequences: int, *args: Any) -> Any:
        decision, headroom = decide(candidates, num_sequences, *args)
        if arm_now[0] == "weigh-every-step" and num_sequences >= 12:
            headrooms.append(headroom)
        return decision, headroom

    controller._decide = recorded_decide  # type: ignore[method-assign]
    per_arm: dict[str, dict[str, list[float]]] = {arm: defaultdict(list) for arm in ARMS}
    quiet_steps: dict[str, int] = defaultdict(int)
    tokens: dict[str, list[list[int]]] = {}

    def measured_step(arm: str) -> Callable[[], Any]:
        def run() -> Any:
            parts.clear()
            n = engine.num_running
            start = time.perf_counter()
            out = step()
            total = time.perf_counter() - start
            last = engine.stats.events.steps[-1] if engine.stats.events.steps else None
            if last is not None and last.prefill_tokens == 0 and n >= 12:
                rec = per_arm[arm]
                rec["step"].append(total)
                for name in PARTS[1:5]:
                    rec[name].append(parts.get(name, 0.0))
                rec["rest"].append(total - sum(v for k, v in parts.items() if k != "choose"))
                quiet_steps[arm] += last.quiet
            return out

        return run

    llm.generate(["warm up"], SamplingParams(max_tokens=8))
    profiler = cProfile.Profile() if profile else None
    for r in range(rounds):
        for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
            params = SamplingParams(
                max_tokens=64, temperature=0, ignore_eos=True, speculative_enabled=arm != "off"
            )
            controller.quiet_share = math.inf if arm == "weigh-every-step" else QUIET_SHARE
            engine.step = measured_step(arm)  # type: ignore[method-assign]
            arm_now[0] = arm
            if profiler is not None and arm == "adaptive":
                profiler.enable()
            got = [o.token_ids for o in llm.generate(prompts, params)]
            if profiler is not None and arm == "adaptive":
                profiler.disable()
            if arm != "off" and tokens.setdefault(arm, got) != got:
                print(f"round {r}: {arm} tokens differ from its first round")
    if tokens["adaptive"] != tokens["weigh-every-step"]:
        print("adaptive and weigh-every-step tokens differ")
    print("ms a step, mean (median); decode-only steps with 12+ sequences")
    print(f"{'arm':18s} {'steps':>5s} {'quiet':>5s} " + " ".join(f"{n:>15s}" for n in PARTS))
    for arm, rec in per_arm.items():
        cols = " ".join(
            f"{1000 * statistics.mean(rec[n]):7.3f} ({1000 * statistics.median(rec[n]):5.3f})" for n in PARTS
        )
        print(f"{arm:18s} {len(rec['step']):5d} {quiet_steps[arm]:5d} {cols}")
    cuts = statistics.quantiles(headrooms, n=10)
    print(
        f"best drafting plan / bar, weigh-every-step decisions at 12+ sequences ({len(headrooms)}):"
        f" min {min(headrooms):.3f}, 10% {cuts[0]:.3f}, median {statistics.median(headrooms):.3f},"
        f" 90% {cuts[-1]:.3f}, max {max(headrooms):.3f}"
    )
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(
            r"spec_controller|scheduler|ngram|engine_core", 25
        )


if __name__ == "__main__":
    main()
