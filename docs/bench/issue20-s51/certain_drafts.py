"""Could drafts pay at N SmolLM2 sequences even if accepted for certain and free to propose (rows
only, no draft steps)? At every decode-only step the controller weighs, the best goodput over t = 1..5N
such drafts, against the bar drafting must clear (`required_gain` x plain decode's goodput), by the
engine's own cost model. Three waves of N requests (32 tokens, EOS ignored); the default n-gram server.

    python certain_drafts.py N
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams

CAP = 5  # drafts a request may get (the default --max-num-steps)


def main() -> None:
    n = int(sys.argv[1])
    llm = LLM(None, max_kv_cache_tokens=131072, max_batch_size=64)
    eng, ctl = llm.engine, llm.engine.controller
    prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories(None), 8)]
    ratios: list[float] = []
    choose = ctl.choose

    def measured_choose(candidates: Any, num_sequences: int, base_tokens: int, budget: int) -> Any:
        if base_tokens == num_sequences == len(candidates) == n:
            price = ctl.cost.step_pricer(num_sequences)
            bar = num_sequences / price(num_sequences, 0, 0) * ctl.required_gain(num_sequences)
            best = max((num_sequences + t) / price(num_sequences + t, 0, 0) for t in range(1, n * CAP + 1))
            ratios.append(best / bar)
        return choose(candidates, num_sequences, base_tokens, budget)

    ctl.choose = measured_choose
    for wave in range(3):
        for i in range(n):
            params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
            eng.add_request(eng.make_request(prompts[i % len(prompts)], params))
        while eng.has_work():
            eng.step()
        print(
            f"{n} sequences, wave {wave}: {len(ratios)} weighed steps; certain drafts' best goodput / bar:"
            f" median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}"
        )
        ratios.clear()


if __name__ == "__main__":
    main()
