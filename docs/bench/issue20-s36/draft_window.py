"""What a draft model loses when it sees only part of the context: the first S tokens (attention sinks)
and the newest W, as a bounded catch-up would feed it. Teacher-forced on the target's own greedy
answers: the draft's argmax at each answer position against the target's token; from those matches,
the tokens a greedy window of k drafts would accept on average (windows starting at every position).

    python draft_window.py [MAX_TOKENS] [SET]      SET: bench (benchmarks/prompts, 21) or heldout (below)

Positions are renumbered (sink at 0..S-1, window right after): RoPE attention depends only on
relative positions, so this is what a draft sees with the sink's KV placed just before the window.
"""

from __future__ import annotations

import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.llm import LLM
from specserve.engine.runner import SequenceInput, forward_sequences
from specserve.engine.sampling_params import SamplingParams

BLOCK = 16
VARIANTS = [(None, None), (4, 64), (4, 128), (4, 256), (32, 128), (0, 128)]  # (sink S, window W)


def heldout_prompts() -> list[list[dict[str, str]]]:
    """Prompts written for this test (not the benchmark's), long contexts from the Python standard
    library's own source (PSF licence)."""
    import inspect
    import json as json_mod
    import textwrap

    sources = [inspect.getsource(f) for f in (textwrap.dedent, json_mod.dumps, statistics.median_grouped)]
    asks = [
        "Explain what this function does, step by step, then suggest one improvement.",
        "Write three unit tests for this function with pytest.",
        "Rewrite this function with type hints and a shorter docstring.",
    ]
    prompts = [
        [{"role": "user", "content": f"{ask}\n\n```python\n{src}\n```"}]
        for ask, src in zip(asks, sources, strict=True)
    ]
    prompts += [
        [
            {
                "role": "user",
                "content": "Write a Python function that merges overlapping intervals, with a docstring.",
            }
        ],
        [
            {
                "role": "user",
                "content": "Summarise the trade-offs between threads and processes in Python in five bullet points.",
            }
        ],
        [
            {
                "role": "user",
                "content": "Translate to French: The quick brown fox jumps over the lazy dog near the river bank.",
            }
        ],
    ]
    return prompts


def accepted(match: list[int], k: int) -> float:
    """Mean tokens a greedy window of k drafts starting at each position would accept, from the
    draft's per-position agreement with the target (1 or 0)."""
    runs = []
    for j in range(len(match)):
        run = 0
        while run < k and j + run < len(match) and match[j + run]:
            run += 1
        runs.append(run)
    return statistics.mean(runs)


def main() -> None:
    max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 48
    which = sys.argv[2] if len(sys.argv) > 2 else "bench"
    prompts = [p.messages for p in load_prompts(list(CATEGORIES))] if which == "bench" else heldout_prompts()
    target = LLM("Qwen/Qwen2.5-Coder-1.5B-Instruct", speculative_method="none")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    draft = load_model(spec, None, draft=True).model.eval()
    per_seq = 256
    kv = draft.allocate_kv_cache(per_seq * BLOCK + 1, spec.dtype, "cpu")
    table = list(range(per_seq))
    stats: dict[str, dict[str, list[float]]] = {}
    for messages in tqdm(prompts, desc="prompts"):
        out = target.generate([messages], params)[0]
        ids, cont = out.prompt_token_ids, out.token_ids
        n = len(ids)
        for s, w in VARIANTS:
            name = "full" if s is None else f"S{s} W{w}"
            seen = ids if s is None or n <= s + w else ids[:s] + ids[n - w :]
            feed = seen + cont[:-1]
            hidden = forward_sequences(draft, kv, [SequenceInput(feed, 0, table, len(cont))], BLOCK)
            preds = draft.compute_logits(hidden).argmax(-1).tolist()  # preds[j] guesses cont[j]
            match = [int(p == t) for p, t in zip(preds, cont, strict=True)]
            st = stats.setdefault(name, {"agree": [], "k3": [], "k5": [], "fed": []})
            st["agree"].append(sum(match) / len(match))
            for k in (3, 5):
                st[f"k{k}"].append(accepted(match, k))
            st["fed"].append(len(seen))
    rows = []
    for name, st in stats.items():
        rows.append(
            {
                "variant": name,
                "prompts": len(st["agree"]),
                "agreement": round(statistics.mean(st["agree"]), 3),
                "accepted_k3": round(statistics.mean(st["k3"]), 3),
                "accepted_k5": round(statistics.mean(st["k5"]), 3),
                "catch_up_tokens": round(statistics.mean(st["fed"]), 1),
            }
        )
    print(json.dumps(rows, indent=1))
    print(f"\n{which} prompts, {max_tokens} greedy target tokens each")
    print("| variant | prompts | agreement | accepted of 3 | accepted of 5 | mean catch-up tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['prompts']} | {r['agreement']} | {r['accepted_k3']} | {r['accepted_k5']}"
            f" | {r['catch_up_tokens']} |"
        )


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(main).result()
