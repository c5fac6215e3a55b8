"""In-process: garbage collections (gc.callbacks) during off and adaptive runs of 48 requests at 16."""

import gc
import time

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams

llm = LLM(None, max_batch_size=16)
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 7)][
    :48
]
gc.collect()
acc = {"seconds": 0.0, "started": 0.0, "by_generation": [0, 0, 0]}


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        acc["started"] = time.perf_counter()
    else:
        acc["seconds"] += time.perf_counter() - acc["started"]
        acc["by_generation"][info["generation"]] += 1


gc.callbacks.append(on_gc)
for _ in range(3):
    for arm in ("off", "adaptive"):
        kw = {"speculative_enabled": False} if arm == "off" else {"speculative_policy": "adaptive"}
        acc["seconds"], acc["by_generation"] = 0.0, [0, 0, 0]
        llm.engine.stats.drain_events()
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, **kw)
        llm.generate(prompts, params, use_chat_template=False)
        steps = len(llm.engine.stats.drain_events().steps)
        print(
            f"{arm} steps {steps} gc {1e3 * acc['seconds']:.1f} ms total, collections by generation"
            f" {acc['by_generation']}, per step {1e3 * acc['seconds'] / steps:.3f} ms"
        )
