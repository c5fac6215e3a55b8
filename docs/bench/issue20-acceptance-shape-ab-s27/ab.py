"""Same-process A/B at batch 1 (SmolLM2 bf16, n-gram): the controller at df396e7 ("old", from
old_ctrl.py beside this file, see README.md) against the working tree's ("new"), with speculation off
and static K=3 / K=5 on the same engine. Usage: python ab.py PROMPTS_PER_CATEGORY REPEATS [CATEGORIES]"""

import json
import os
import statistics as st
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from batch1 import build_llm, old_controller  # noqa: E402

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories  # noqa: E402
from specserve.engine import SamplingParams  # noqa: E402

per = int(sys.argv[1]) if len(sys.argv) > 1 else 3
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
cats = sys.argv[3] if len(sys.argv) > 3 else "all"
llm = build_llm()
eng = llm.engine
new = eng.controller
controllers = {"new": new, "old": old_controller(eng)}
prompt_set = load_prompts(parse_categories(cats), per)
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in prompt_set]
static = {"speculative_policy": "static"}
arms = [
    ("off", {"speculative_enabled": False}, "new"),
    ("k3", {**static, "num_speculative_tokens": 3}, "new"),
    ("k5", {**static, "num_speculative_tokens": 5}, "new"),
    ("old", {"speculative_policy": "adaptive"}, "old"),
    ("new", {"speculative_policy": "adaptive"}, "new"),
]


def use(name: str) -> None:
    eng.controller = eng.scheduler.controller = controllers[name]


for _, arm, ctrl in arms:  # warm-up
    use(ctrl)
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0, **arm), use_chat_template=False)
results = []
start = time.time()
for rep in range(reps):
    for i, prompt in enumerate(prompts):
        shift = (i + rep) % len(arms)
        for name, arm, ctrl in arms[shift:] + arms[:shift]:
            use(ctrl)
            params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, **arm)
            t = time.perf_counter()
            out = llm.generate([prompt], params, use_chat_template=False)[0]
            seconds = time.perf_counter() - t
            results.append(
                {
                    "arm": name,
                    "prompt": i,
                    "cat": prompt_set[i].category,
                    "rep": rep,
                    "tok_s": len(out.token_ids) / seconds,
                    "mean_k": out.spec.mean_k,
                }
            )
    print(f"round {rep} done {time.time() - start:.0f}s", flush=True)
with open(f"ab-{cats}-{per}x{reps}.json", "w") as f:
    json.dump(results, f)


def ratio(a: str, b: str, rows: list[dict]) -> float:
    """Median over (prompt, repeat) of arm a's speed over arm b's."""
    speed_a = {(r["prompt"], r["rep"]): r["tok_s"] for r in rows if r["arm"] == a}
    speed_b = {(r["prompt"], r["rep"]): r["tok_s"] for r in rows if r["arm"] == b}
    return st.median(speed_a[key] / speed_b[key] for key in speed_a)


print("cat          k3/off k5/off old/off new/off  new/old  old/best new/best")
means = defaultdict(list)
for cat in dict.fromkeys(r["cat"] for r in results):
    rows = [r for r in results if r["cat"] == cat]
    v = {a: ratio(a, "off", rows) for a in ("k3", "k5", "old", "new")}
    best = max(v["k3"], v["k5"])
    cells = " ".join(f"{v[a]:6.3f}" for a in ("k3", "k5", "old", "new"))
    print(
        f"{cat:12s} {cells}  {ratio('new', 'old', rows):6.3f}   {v['old'] / best:6.3f}  {v['new'] / best:6.3f}"
    )
    for a in v:
        means[a].append(v[a])
print("mean         " + " ".join(f"{st.mean(means[a]):6.3f}" for a in ("k3", "k5", "old", "new")))
