"""Where the spread layout's extra time goes: torch's profiler over the plain 8-sequence decode steps of
the level and spread layouts of spread.py (one generate each after a warm-up of both), self CPU time
per op, the ops that differ most.

    python docs/bench/issue20-context-spread-s32/profile_layouts.py [mean] [width]
"""

import sys

from torch.profiler import ProfilerActivity, profile

from specserve.engine import LLM, SamplingParams

mean = int(sys.argv[1]) if len(sys.argv) > 1 else 200
width = int(sys.argv[2]) if len(sys.argv) > 2 else 150
llm = LLM(None, max_batch_size=8)
filler = llm.tokenizer.encode(" the quick brown fox jumps over the lazy dog" * 200)
layouts = {"level": [mean] * 8, "spread": [mean - width + round(2 * width * i / 7) for i in range(8)]}
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, speculative_enabled=False)
totals: dict[str, dict[str, float]] = {}
for attempt in range(2):  # the first pass warms both layouts up
    for name, lengths in layouts.items():
        prompts = [filler[attempt + i : attempt + i + n] for i, n in enumerate(lengths)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, [params] * 8, use_chat_template=False)
        if attempt:
            totals[name] = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
ops = set(totals["level"]) | set(totals["spread"])
rows = sorted(ops, key=lambda op: totals["spread"].get(op, 0) - totals["level"].get(op, 0), reverse=True)
print(
    f"self CPU ms over one generate: total level {sum(totals['level'].values()):.0f}, spread {sum(totals['spread'].values()):.0f}"
)
print("op | level ms | spread ms | spread - level")
for op in rows[:12]:
    level, spread = totals["level"].get(op, 0.0), totals["spread"].get(op, 0.0)
    print(f"{op} | {level:.1f} | {spread:.1f} | {spread - level:+.1f}")
