"""The chain probabilities below which the controller told the Qwen pair's draft to end its windows
(Decision.stop_below), at batch 1 on the first PROMPTS math and code prompts of the benchmark set
(48 tokens, greedy), with the controller's predicted goodput for those steps and the cost model's
step price by drafts afterwards.

    python stop_thresholds.py [PROMPTS]
"""

from __future__ import annotations

import statistics
import sys

from specserve.benchmarks.prompt_sets import load_prompts
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    llm = LLM(
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        speculative_method="draft_model",
        draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        draft_quantization_encoding="int4",
        max_length=4096,
    )
    controller = llm.engine.controller
    assert controller is not None
    choose = controller.choose
    log: list[tuple[float, float]] = []

    def logged(*args, **kwargs):
        decision = choose(*args, **kwargs)
        goodput = decision.predicted_tokens / decision.predicted_seconds
        log.extend((t, goodput) for t in decision.stop_below.values())
        return decision

    controller.choose = logged  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for prompt in load_prompts(["math_reasoning", "code"])[:count]:
        llm.generate([prompt.messages], params)
    thresholds = [t for t, _ in log]
    print(f"steps with a stop: {len(log)}")
    print(
        f"threshold median {statistics.median(thresholds):.3f}, deciles {statistics.quantiles(thresholds, n=10)}"
    )
    print(f"predicted goodput median {statistics.median(g for _, g in log):.1f} tok/s")
    prices = [controller.cost.step_seconds(1, 1 + k, 1 if k else 0, k) * 1000 for k in range(10)]
    print("step price by drafts 0..9 (ms):", [round(p, 1) for p in prices])


if __name__ == "__main__":
    main()
