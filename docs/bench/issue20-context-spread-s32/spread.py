"""Does a plain 8-sequence decode forward cost more when its sequences' contexts are spread out than
when they are level, at the same total context? Off cells of a served 8-client run hold requests that
start together and stay level; adaptive cells hold requests that have drifted apart (drafts accepted,
prefills interleaved), and the CPU attention pads every sequence's keys to the longest context of its
group (`engine/attention.py: _matmul_attention`).

In-process, SmolLM2 bf16, speculation off, 8 prompts of token ids, 32 output tokens each, the two
layouts taking turns: level (every prompt `mean` tokens) and spread (from `mean - width` to
`mean + width`, the same total). Per round: the median plain 8-sequence forward of each.

    python docs/bench/issue20-context-spread-s32/spread.py [rounds] [mean] [width]
"""

import statistics as st
import sys

from specserve.engine import LLM, SamplingParams

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
mean = int(sys.argv[2]) if len(sys.argv) > 2 else 200
width = int(sys.argv[3]) if len(sys.argv) > 3 else 150
llm = LLM(None, max_batch_size=8)
filler = llm.tokenizer.encode(" the quick brown fox jumps over the lazy dog" * 200)
layouts = {
    "level": [mean] * 8,
    "spread": [mean - width + round(2 * width * i / 7) for i in range(8)],
}
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, speculative_enabled=False)
print({name: lengths for name, lengths in layouts.items()}, flush=True)
results: dict[str, list[float]] = {name: [] for name in layouts}
for r in range(rounds + 1):
    for name in list(layouts) if r % 2 == 0 else list(layouts)[::-1]:
        prompts = [filler[r + i : r + i + n] for i, n in enumerate(layouts[name])]
        llm.engine.stats.drain_events()
        llm.generate(prompts, [params] * 8, use_chat_template=False)
        steps = llm.engine.stats.drain_events().steps
        plain = [s.forward_seconds for s in steps if s.prefill_tokens == 0 and s.num_sequences == 8]
        print(f"round {r} {name:6s} plain@8 {1e3 * st.median(plain):5.2f} ms over {len(plain)}", flush=True)
        if r:  # round 0 warms both up
            results[name].append(st.median(plain))
ratios = [s / lv for s, lv in zip(results["spread"], results["level"], strict=True)]
print("spread / level per round:", " ".join(f"{x:.3f}" for x in ratios), f"(median {st.median(ratios):.3f})")
