"""In-process: do plain 16-sequence decode steps run slower in adaptive runs than in off runs?"""

import statistics as st

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams

llm = LLM(None, max_batch_size=16)
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 7)][
    :48
]
res = {"off": [], "adaptive": []}
for r in range(8):
    for arm in ["off", "adaptive"] if r % 2 == 0 else ["adaptive", "off"]:
        kw = {"speculative_enabled": False} if arm == "off" else {"speculative_policy": "adaptive"}
        llm.engine.stats.drain_events()
        llm.generate(
            prompts,
            SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, **kw),
            use_chat_template=False,
        )
        ev = llm.engine.stats.drain_events()
        plain = [
            s.forward_seconds
            for s in ev.steps
            if s.prefill_tokens == 0 and s.draft_tokens == 0 and s.num_sequences == 16
        ]
        drafted = sum(s.draft_tokens for s in ev.steps)
        res[arm].append(st.median(plain))
        print(
            r,
            arm,
            f"plain@16 n={len(plain)} median {1e3 * st.median(plain):.1f} ms, drafts {drafted}",
            flush=True,
        )
pairs = [a / o for a, o in zip(res["adaptive"], res["off"], strict=True)]
print(
    "adaptive/off plain@16 time ratio per pair",
    [round(p, 3) for p in pairs],
    "median",
    round(st.median(pairs), 3),
)
