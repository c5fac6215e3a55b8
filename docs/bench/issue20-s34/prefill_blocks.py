"""Prefill attention in one SDPA call against blocks of query rows (`_blocked_sdpa_attention`), in one
process, alternated: one SmolLM2 layer's attention on its own, then whole prefill forwards of the
bench's prompts (SmolLM2 bf16, the served engine's configuration).

    python prefill_blocks.py ROUNDS
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams, attention
from specserve.engine.step_batch import WindowBatch

torch.set_num_threads(2)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
blocked, one_call = attention._blocked_sdpa_attention, attention._sdpa_attention


def timed(fn, *args) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# --- one layer: SmolLM2's heads (9 query, 3 KV, 64 wide), a fresh prompt of T tokens ---------------
print("one layer, a prompt of T tokens (ms, median):")
heads, kv_heads, dim, block = 9, 3, 64, 16
for tokens in (104, 256, 484, 1024):
    blocks = (tokens + block - 1) // block
    meta = attention.AttentionMetadata.build([tokens], [tokens], [list(range(blocks))], block)
    q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, dim, dtype=torch.bfloat16)
    v = torch.randn(tokens, kv_heads, dim, dtype=torch.bfloat16)
    k_cache = torch.zeros(blocks * block, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    args = (q, k, v, k_cache, v_cache, meta, dim**-0.5)
    diff = (blocked(*args).float() - one_call(*args).float()).abs().max().item()
    times: dict[str, list[float]] = {"one call": [], "blocks": []}
    for _ in range(20 * rounds):
        for name, fn in random.sample([("one call", one_call), ("blocks", blocked)], 2):
            times[name].append(timed(fn, *args))
    a, b = (1e3 * statistics.median(times[n]) for n in ("one call", "blocks"))
    print(
        f"  T={tokens}: one call {a:.2f}, blocks of {attention.PREFILL_QUERY_BLOCK} {b:.2f} ({b / a:.3f}x); max |diff| {diff:.2g}"
    )

# --- whole prefill forwards -------------------------------------------------------------------------
llm = LLM(None, max_batch_size=16)
engine = llm.engine
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))]
params = SamplingParams(max_tokens=8, temperature=0, speculative_enabled=False)
for p in prompts[:8]:
    engine.add_request(engine.make_request(p, params))
engine._drain_inbox()
scheduled = [s for s in engine.scheduler.schedule().scheduled if s.num_new_tokens > 1]
batches = {"wave": WindowBatch.build(scheduled, engine._states, {})}
for s in scheduled:
    batches[f"prompt of {s.num_new_tokens}"] = WindowBatch.build([s], engine._states, {})
logits = {}
for arm, fn in (("one call", one_call), ("blocks", blocked)):
    attention._blocked_sdpa_attention = fn
    logits[arm] = engine._forward(batches["wave"])
diff = (logits["one call"][0].float() - logits["blocks"][0].float()).abs().max().item()
print(f"whole forwards (ms, median); the wave's last-token logits differ by at most {diff:.3g}:")
times = {(arm, name): [] for arm in ("one call", "blocks") for name in batches}
for _ in range(rounds):
    keys = list(times)
    random.shuffle(keys)
    for arm, name in keys:
        attention._blocked_sdpa_attention = blocked if arm == "blocks" else one_call
        times[arm, name].append(timed(engine._forward, batches[name]))
attention._blocked_sdpa_attention = blocked
for name in batches:
    a, b = (1e3 * statistics.median(times[arm, name]) for arm in ("one call", "blocks"))
    print(f"  {name}: one call {a:.1f}, blocks {b:.1f} ({b / a:.3f}x)")
