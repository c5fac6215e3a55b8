"""This session's two attention changes against what they replaced, in one process, alternated on real
SmolLM2 bf16 steps (the served engine's configuration); every step's logits must be equal.

    python attention_ab.py ROUNDS

- grouped: groups sliced from a batch laid out group after group (one gather a step) against three
  picks and a scatter per group (`per_group_copies` below, the code before), on steps mixing a prompt,
  decodes and verification windows;
- gather: decode K/V gathered head-major with one index_select against a gather by slot and a permuted
  copy (`gather_by_slot` below, the code before), on plain decode steps of 8 and 16 sequences.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from specserve.api.cli import ServeSettings, build_parser
from specserve.api.settings import engine_config_from, parse_settings
from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import SamplingParams
from specserve.engine import attention as at
from specserve.engine.engine_core import EngineCore
from specserve.engine.step_batch import Draft, WindowBatch

flags = ["serve", "--max-kv-cache-tokens", "131072", "--num-threads", "2", "--max-batch-size", "24"]
engine = EngineCore(engine_config_from(parse_settings(ServeSettings, build_parser().parse_args(flags))))
inner = at.cpu_paged_attention.__wrapped__
new_matmul = at._matmul_attention


def per_group_copies(q, k, v, k_cache, v_cache, meta, scale):  # noqa: ANN001, ANN201 (the code before)
    if not meta.groups:
        return inner(q, k, v, k_cache, v_cache, meta, scale)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for a, b, sub in meta.groups:
        tokens = meta.group_order[a:b] if meta.group_order is not None else torch.arange(a, b)
        picked = [x.index_select(0, tokens) for x in (q, k, v)]
        out.index_copy_(0, tokens, inner(*picked, k_cache, v_cache, sub, scale))
    return out


def gather_by_slot(q, k, v, k_cache, v_cache, meta, scale):  # noqa: ANN001, ANN201 (the code before)
    at._write_new_kv(k, v, k_cache, v_cache, meta)
    queries = at._padded_queries(q, meta)
    num_seqs, max_q, heads, dim = queries.shape
    max_c, kv_heads = meta.context_slots.shape[1], k_cache.shape[1]
    group = heads // kv_heads
    rows = queries.permute(0, 2, 1, 3).reshape(num_seqs, kv_heads, group * max_q, dim)
    out = queries.new_empty(num_seqs, kv_heads, group * max_q, dim)
    per_seq = max(heads * max_q * max_c, 2 * kv_heads * max_c * dim)
    s_tile = max(1, min(at.SCORE_TILE_ELEMENTS, at.GATHER_TILE_ELEMENTS) // per_seq)
    for s0 in range(0, num_seqs, s_tile):
        s1 = min(s0 + s_tile, num_seqs)
        n = s1 - s0
        slots = meta.context_slots[s0:s1]
        keys = at._gather_context(k_cache, slots).permute(0, 2, 1, 3).to(q.dtype).contiguous()
        values = at._gather_context(v_cache, slots).permute(0, 2, 1, 3).to(q.dtype).contiguous()
        scores = torch.matmul(rows[s0:s1], keys.transpose(-1, -2)).float().mul_(scale)
        scores = scores.view(n, kv_heads, group, max_q, max_c)
        scores.masked_fill_(~meta.attn_mask[s0:s1].view(n, 1, 1, max_q, max_c), float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(values.dtype).view(n, kv_heads, group * max_q, max_c)
        out[s0:s1] = torch.matmul(weights, values)
    out = out.view(num_seqs, heads, max_q, dim).transpose(1, 2)
    return at._flatten_output(out, meta)


layers = [m for m in engine.model.modules() if hasattr(m, "attention_backend")]


def use(change: str, before: bool) -> None:
    """Run with one change undone (the other as committed)."""
    backend = per_group_copies if change == "grouped" and before else at.cpu_paged_attention
    for layer in layers:
        layer.attention_backend = backend
    at._matmul_attention = gather_by_slot if change == "gather" and before else new_matmul


prompts = [engine.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"))]
params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, speculative_enabled=False)
for i in [8, 0, 3, 15, 9, 1, 4, 16, 2, 5, 10, 17, 6, 11, 18, 12]:  # one 490-token prompt in the first 8
    engine.add_request(engine.make_request(prompts[i], params))
for _ in range(25):
    engine.step()
engine.add_request(engine.make_request(prompts[19], params))  # a 195-token prompt admitted
engine._drain_inbox()
scheduled = engine.scheduler.schedule().scheduled
decodes = [s for s in scheduled if s.num_new_tokens == 1]
prompt = [s for s in scheduled if s.num_new_tokens > 1]
windows = {s.request.request_id: Draft([42], None) for s in decodes[1:16:5]}  # one draft: its slot exists
states = engine._states
cases: dict[str, tuple[str, WindowBatch]] = {
    "7 decodes, then a prompt": ("grouped", WindowBatch.build(decodes[:7] + prompt, states, {})),
    "a prompt, then 7 decodes": ("grouped", WindowBatch.build(prompt + decodes[:7], states, {})),
    "16 decodes, 3 windows of 2": ("grouped", WindowBatch.build(decodes, states, windows)),
    "8 decodes, one 490-token": ("gather", WindowBatch.build(decodes[:8], states, {})),
    "8 decodes, two ~500": ("gather", WindowBatch.build(decodes[8:], states, {})),
    "16 decodes": ("gather", WindowBatch.build(decodes, states, {})),
}
for name, (change, batch) in cases.items():
    use(change, True)
    before = engine._forward(batch)[0]
    use(change, False)
    assert torch.equal(before, engine._forward(batch)[0]), name
times: dict[tuple[str, bool], list[float]] = {(name, b): [] for name in cases for b in (True, False)}
keys = list(times)
run: Callable[[WindowBatch], object] = engine._forward
for _ in range(int(sys.argv[1])):
    random.shuffle(keys)
    for name, before in keys:
        use(cases[name][0], before)
        start = time.perf_counter()
        run(cases[name][1])
        times[(name, before)].append(time.perf_counter() - start)
for name, (change, _) in cases.items():
    old, new = (1e3 * statistics.median(times[(name, b)]) for b in (True, False))
    print(
        f"{change:7s} {name:28s} before {old:6.1f} ms, after {new:6.1f} ms: {new - old:+5.2f} ms, {new / old:.3f}x"
    )
