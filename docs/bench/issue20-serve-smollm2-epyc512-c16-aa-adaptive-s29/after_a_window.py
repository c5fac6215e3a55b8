"""In-process: is a plain 16-sequence forward slower right after a forward with verification windows?

python docs/bench/issue20-serve-smollm2-epyc512-c16-aa-adaptive-s29/after_a_window.py [ROUNDS]
"""

import random
import statistics as st
import sys
import time

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams
from specserve.engine.step_batch import Draft, WindowBatch

llm = LLM(None, max_batch_size=16, num_speculative_tokens=8, speculative_policy="static")
eng = llm.engine
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 3)][
    :16
]
params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True, speculative_enabled=False)
for p in prompts:
    eng.add_request(eng.make_request(p, params))
for _ in range(30):  # prompts prefilled, every request decoding
    eng.step()
for r in eng.scheduler.running:  # the next step allocates 8 draft slots a request
    r.params.speculative_enabled = True
    r.params.speculative_policy = "static"
    r.params.num_speculative_tokens = 8
sched = eng.scheduler.schedule()
rids = [s.request.request_id for s in sched.scheduled]
plain = WindowBatch.build(sched.scheduled, eng._states, {})
# Draft lengths for the first requests (zip stops at the shorter list).
shapes = ([1, 2, 4], [8], [1, 2, 3, 5, 7, 8], [3] * 16, [1] * 5)
windows = [
    WindowBatch.build(
        sched.scheduled, eng._states, {r: Draft([42] * k, None) for r, k in zip(rids, ks, strict=False)}
    )
    for ks in shapes
]
after_plain: list[float] = []
after_window: list[float] = []
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 150):
    eng._forward(plain if i % 2 else random.choice(windows))
    start = time.perf_counter()
    eng._forward(plain)
    (after_plain if i % 2 else after_window).append(time.perf_counter() - start)
print(
    f"plain forward after a plain one: median {1e3 * st.median(after_plain):.1f} ms;"
    f" after one with windows: {1e3 * st.median(after_window):.1f} ms (n={len(after_plain)}, {len(after_window)})"
)
