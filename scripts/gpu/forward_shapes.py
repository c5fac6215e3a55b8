# ruff: noqa: B023 - each timing lambda runs inside the iteration that made it
"""Why steps with verification windows cost 5-7x a decode step on the H200: forward_sequences on
synthetic batches, SDPA variants, and a profiler table."""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ledger as g

from specserve.engine.runner import SequenceInput, forward_sequences


def timed(fn, n=10):
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e3


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    llm = g.ngram_target_engine()
    e = llm.engine
    bs = e.config.block_size

    def seqs(spec):  # [(new tokens, context before)]
        out, nb = [], 0
        for new, ctx in spec:
            need = -(-(ctx + new) // bs)
            out.append(SequenceInput([5] * new, ctx, list(range(nb, nb + need)), new))
            nb += need
        return out

    cases = {
        "16x1": [(1, 300)] * 16,
        "16x6": [(6, 300)] * 16,
        "8x1+8x6": [(1, 300)] * 8 + [(6, 300)] * 8,
        "15x1+1x2": [(1, 300)] * 15 + [(2, 300)],
        "1x6": [(6, 300)],
        "1x1": [(1, 300)],
    }
    for name, spec in cases.items():
        s = seqs(spec)
        ms = timed(lambda: forward_sequences(e.model, e.kv_cache, s, bs, e.device))
        g.log(f"forward {name}: {ms:.2f} ms")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    S, H, KVH, D, C = 16, 12, 2, 128, 300
    for Q in (1, 6):
        q = torch.randn(S, H, Q, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(S, KVH, C, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(S, 1, Q, C, dtype=torch.bool, device=dev).tril(diagonal=C - Q)
        fmask = torch.zeros(S, 1, Q, C, dtype=torch.bfloat16, device=dev).masked_fill(~mask, float("-inf"))
        ke, ve = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
        variants = {
            "bool+gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            "float+gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, enable_gqa=True),
            "bool+expanded": lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask),
            "float+expanded": lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=fmask),
            "nomask+gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        }
        for vn, fn in variants.items():
            try:
                g.log(f"sdpa Q={Q} {vn}: {timed(fn, 50):.3f} ms")
            except Exception as exc:
                g.log(f"sdpa Q={Q} {vn}: {type(exc).__name__} {exc}"[:200])
    from torch.profiler import ProfilerActivity, profile

    s = seqs(cases["8x1+8x6"])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            forward_sequences(e.model, e.kv_cache, s, bs, e.device)
        sync()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=22, max_name_column_width=50))


main()
