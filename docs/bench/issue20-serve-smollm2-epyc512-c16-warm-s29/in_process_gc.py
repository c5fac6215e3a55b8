import gc
import time

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams

llm = LLM(None, max_batch_size=16)
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 7)][
    :48
]
gc.collect()
acc = {"t": 0.0, "n": [0, 0, 0], "start": 0.0}


def cb(phase, info):
    if phase == "start":
        acc["start"] = time.perf_counter()
    else:
        acc["t"] += time.perf_counter() - acc["start"]
        acc["n"][info["generation"]] += 1


gc.callbacks.append(cb)
for r in range(3):
    for arm in ("off", "adaptive"):
        kw = {"speculative_enabled": False} if arm == "off" else {"speculative_policy": "adaptive"}
        acc["t"] = 0.0
        acc["n"] = [0, 0, 0]
        llm.engine.stats.drain_events()
        llm.generate(
            prompts,
            SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, **kw),
            use_chat_template=False,
        )
        ev = llm.engine.stats.drain_events()
        print(
            arm,
            f"steps {len(ev.steps)} gc {1e3 * acc['t']:.1f} ms total, collections by generation {acc['n']}, per step {1e3 * acc['t'] / len(ev.steps):.3f} ms",
            flush=True,
        )
