"""Conditional acceptance per n-gram class and draft position, judged offline: at every position of
the off arm's greedy answers (repeat 0 of docs/bench/issue20-policy-smollm2-epyc512-s26), the n-gram
preview (n 1..4, 8 drafts) against the tokens that followed. Run from the repository root."""

import json
from collections import defaultdict

import numpy as np

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM
from specserve.plugins.ngram import find_match

with open("docs/bench/issue20-policy-smollm2-epyc512-s26/spec_policy.json") as f:
    report = json.load(f)
llm = LLM(None, quantization_encoding="bfloat16", max_length=2048, max_kv_cache_tokens=4096, max_batch_size=1)
prompt_set = load_prompts(parse_categories("all"), 3)
prompt_tokens = {p.id: list(llm.tokenizer.apply_chat_template(p.messages)) for p in prompt_set}
category = {p.id: p.category for p in prompt_set}
answers = {r["prompt"]: r["tokens"] for r in report["results"] if r["arm"] == "off" and r["repeat"] == 0}
counts: dict[tuple[str, int], np.ndarray] = defaultdict(lambda: np.zeros((2, 8)))  # [hits/trials, position]
for pid, answer in answers.items():
    seq = prompt_tokens[pid] + answer
    for i in range(len(prompt_tokens[pid]), len(seq) - 1):
        n, drafts = find_match(np.array(seq[:i], dtype=np.int64), 1, 4, 8)
        if not drafts:
            continue
        future = seq[i:]
        matched = 0
        while matched < min(len(drafts), len(future)) and drafts[matched] == future[matched]:
            matched += 1
        for j in range(min(matched + 1, len(drafts), len(future))):
            counts[(category[pid], n)][1, j] += 1
            counts[(category[pid], n)][0, j] += j < matched
for key in sorted(counts):
    hits, trials = counts[key]
    print(key, " ".join(f"{h / t:.2f}({int(t)})" if t else "-" for h, t in zip(hits, trials, strict=True)))
