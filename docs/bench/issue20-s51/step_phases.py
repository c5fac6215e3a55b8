"""Where a step's time goes outside the forward, speculation off against the adaptive policy (the
default n-gram lookup), N SmolLM2 sequences in one process: each phase of `EngineCore.step` timed by a
wrapper, per step of a wave of N requests (32 tokens each, EOS ignored), median over four waves of
each arm, alternated.

    python step_phases.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    llm = LLM(None, max_kv_cache_tokens=131072, max_batch_size=64)
    eng = llm.engine
    prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories(None), 8)]
    seconds: dict[str, list[float]] = defaultdict(list)

    def timed(obj: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label].append(time.perf_counter() - start)

        setattr(obj, name, wrapper)

    for name in ("schedule", "_speculation_plan", "_candidate", "preview"):
        timed(eng.scheduler, name, f"scheduler.{name}")
    for name in ("_propose", "_forward", "_verify", "_commit", "_observe_step"):
        timed(eng, name, f"engine.{name}")
    for name in ("choose", "quiet_decision", "observe_verification"):
        timed(eng.controller, name, f"controller.{name}")

    def wave(speculate: bool) -> dict[str, float]:
        for i in range(n):
            params = SamplingParams(
                max_tokens=32, temperature=0, ignore_eos=True, speculative_enabled=speculate
            )
            eng.add_request(eng.make_request(prompts[i % len(prompts)], params))
        seconds.clear()
        steps = 0
        while eng.has_work():
            eng.step()
            steps += 1
        eng.stats.drain_events()
        return {label: sum(v) / steps * 1e3 for label, v in seconds.items()}

    wave(False)
    wave(True)
    per_arm: dict[bool, dict[str, list[float]]] = {False: defaultdict(list), True: defaultdict(list)}
    for rep in range(4):
        for speculate in (False, True) if rep % 2 == 0 else (True, False):
            for label, ms in wave(speculate).items():
                per_arm[speculate][label].append(ms)
    print(f"{n} sequences; ms per step (every step of a wave, prefill steps included), median of 4 waves")
    print("phase | off | adaptive")
    for label in sorted(set(per_arm[False]) | set(per_arm[True])):
        off, adaptive = per_arm[False].get(label), per_arm[True].get(label)
        print(
            f"{label} | {statistics.median(off) if off else 0.0:.3f}"
            f" | {statistics.median(adaptive) if adaptive else 0.0:.3f}"
        )


if __name__ == "__main__":
    main()
