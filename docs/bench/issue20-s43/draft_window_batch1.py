"""Batch 1, the Qwen pair (bf16 1.5B target + int4 0.5B draft, the hybrid with n-gram lookup, adaptive
policy): every benchmark prompt once per draft context bound, the order rotated from prompt to prompt,
48 greedy tokens (EOS ignored). Needs draft_window.patch applied (`git apply draft_window.patch`): the
draft model then catches up on at most `context_tokens` of a request's newest tokens and attends from
there on (None: the whole context, as without the patch).

    python draft_window_batch1.py none,256,128,64 OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams


def main() -> None:
    windows = [None if w == "none" else int(w) for w in sys.argv[1].split(",")]
    torch.set_num_threads(2)
    llm = LLM(
        model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        draft_quantization_encoding="int4",
        max_length=4096,
    )
    draft = next(p for p in llm.engine.proposer.proposers if p.name == "draft_model")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm.generate(["warm up"], params)
    rows = []
    for n, prompt in enumerate(load_prompts(list(CATEGORIES))):
        for window in windows[n % len(windows) :] + windows[: n % len(windows)]:
            draft.context_tokens = window
            out = llm.generate([prompt.messages], params)[0]
            rows.append(
                {
                    "prompt": prompt.id,
                    "category": prompt.category,
                    "window": window,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "seconds": out.elapsed_s,
                    "tokens": out.token_ids,
                    "accepted": out.spec.num_accepted_tokens,
                    "drafted": out.spec.num_draft_tokens,
                    "drafts": out.spec.num_drafts,
                }
            )
            print(prompt.id, window, f"{out.elapsed_s:.2f}s", out.spec.num_accepted_tokens, flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
