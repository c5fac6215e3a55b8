"""In one process: a wave of 8 prompts prefilled in one forward (speculation off in lockstep) against
each prompt beside the 7 decodes of the others (clients drifted apart), SmolLM2 bf16.

    python wave.py ROUNDS [FIRST_PROMPT]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams
from specserve.engine.step_batch import WindowBatch

torch.set_num_threads(2)
llm = LLM(None, max_batch_size=16)
engine = llm.engine
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))]
first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, speculative_enabled=False)
for p in prompts[first + 8 : first + 15]:  # 7 requests decoding
    engine.add_request(engine.make_request(p, params))
for _ in range(20):
    engine.step()
wave = prompts[first : first + 8]
for p in wave:
    engine.add_request(engine.make_request(p, params))
engine._drain_inbox()
scheduled = engine.scheduler.schedule().scheduled
decodes = [s for s in scheduled if s.num_new_tokens == 1]
prompts_in = [s for s in scheduled if s.num_new_tokens > 1]
print("wave prompt tokens", [s.num_new_tokens for s in prompts_in], "beside", len(decodes), "decodes")
batches = {"wave": WindowBatch.build(prompts_in, engine._states, {})}
batches["decodes"] = WindowBatch.build(decodes, engine._states, {})
for i, s in enumerate(prompts_in):
    batches[f"p{i}"] = WindowBatch.build([s], engine._states, {})
    batches[f"p{i}+decodes"] = WindowBatch.build(decodes + [s], engine._states, {})
times: dict[str, list[float]] = {name: [] for name in batches}
names = list(batches)
for _ in range(int(sys.argv[1])):
    random.shuffle(names)
    for name in names:
        start = time.perf_counter()
        engine._forward(batches[name])
        times[name].append(time.perf_counter() - start)
ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
n = len(prompts_in)
lockstep = ms["wave"] + n * ms["decodes"]
drifted = sum(ms[f"p{i}+decodes"] for i in range(n))
print(f"lockstep: the wave {ms['wave']:.1f} ms + {n} decode steps of {ms['decodes']:.1f} = {lockstep:.1f} ms")
print(
    f"drifted apart: {n} steps of a prompt beside the decodes = {drifted:.1f} ms ({drifted / lockstep:.3f}x)"
)
print(f"(the prompts alone, one a forward: {sum(ms[f'p{i}'] for i in range(n)):.1f} ms)")
