"""Batch 1, the Qwen pair as in draft_window_batch1.py, on three long prompts: the first 1,500 tokens of
three Python standard-library modules (textwrap, shlex, fnmatch; PSF licence) with a question each,
every draft context bound per prompt, the order rotated. Needs draft_window.patch applied.

    python draft_window_long.py none,256 1500 REPEATS OUT.json
"""

from __future__ import annotations

import fnmatch
import json
import shlex
import sys
import textwrap
from pathlib import Path

import torch

from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams

QUESTIONS = (
    (textwrap, "Explain what the following code does, function by function."),
    (shlex, "Summarise the following module in a short paragraph, then list its public functions."),
    (fnmatch, "Write a short review of the following code: what it does well and what could be improved."),
)


def main() -> None:
    windows = [None if w == "none" else int(w) for w in sys.argv[1].split(",")]
    length, repeats = int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    llm = LLM(
        model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        draft_quantization_encoding="int4",
        max_length=4096,
    )
    tok = llm.tokenizer
    draft = next(p for p in llm.engine.proposer.proposers if p.name == "draft_model")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = []
    for module, question in QUESTIONS:
        source = tok.decode(tok.encode(Path(module.__file__).read_text())[:length])
        prompts.append((module.__name__, [{"role": "user", "content": question + "\n\n" + source}]))
    llm.generate(["warm up"], params)
    rows, n = [], 0
    for repeat in range(repeats):
        for name, messages in prompts:
            for window in windows[n % len(windows) :] + windows[: n % len(windows)]:
                draft.context_tokens = window
                out = llm.generate([messages], params)[0]
                rows.append(
                    {
                        "prompt": name,
                        "repeat": repeat,
                        "window": window,
                        "prompt_tokens": len(out.prompt_token_ids),
                        "seconds": out.elapsed_s,
                        "first_token_s": out.first_token_s,
                        "tokens": out.token_ids,
                        "accepted": out.spec.num_accepted_tokens,
                        "drafted": out.spec.num_draft_tokens,
                        "drafts": out.spec.num_drafts,
                    }
                )
                print(
                    name,
                    repeat,
                    window,
                    len(out.prompt_token_ids),
                    f"{out.elapsed_s:.2f}s ttft {out.first_token_s or 0:.2f}",
                    out.spec.num_accepted_tokens,
                    "/",
                    out.spec.num_draft_tokens,
                    out.spec.num_drafts,
                    flush=True,
                )
            n += 1
    with open(sys.argv[4], "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
