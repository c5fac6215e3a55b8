"""Batch 1, the Qwen pair (the hybrid with n-gram lookup): each prompt of one category under the
adaptive policy and then static K for each K given, 48 greedy tokens (EOS ignored), ROUNDS rounds, one
engine, the step log written beside. A check of one cell of the policy bench (s43's summarisation_ab.py
made general).

    python category_ab.py CATEGORY STEP_LOG.jsonl ROUNDS K [K ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specserve.benchmarks.prompt_sets import load_prompts
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams


def main() -> None:
    category, log, rounds = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    ks = [int(k) for k in sys.argv[4:]]
    log.unlink(missing_ok=True)
    torch.set_num_threads(2)
    llm = LLM(
        model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        draft_quantization_encoding="int4",
        max_length=4096,
        step_log=str(log),
    )
    arms = {"adaptive": SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)}
    for k in ks:
        arms[f"static{k}"] = SamplingParams(
            max_tokens=48,
            temperature=0,
            ignore_eos=True,
            speculative_policy="static",
            num_speculative_tokens=k,
        )
    llm.generate(["warm up"], arms["adaptive"])
    totals = {arm: 0.0 for arm in arms}
    print("# columns: round, prompt, arm, seconds, drafting steps, draft tokens, accepted")
    for r in range(rounds):
        for prompt in load_prompts([category]):
            for arm, params in arms.items():
                with log.open("a") as f:
                    f.write(json.dumps({"marker": f"{r} {prompt.id} {arm}"}) + "\n")
                out = llm.generate([prompt.messages], params)[0]
                spec = out.spec
                totals[arm] += out.elapsed_s
                print(
                    r,
                    prompt.id,
                    arm,
                    f"{out.elapsed_s:.2f}s",
                    spec.num_drafts,
                    spec.num_draft_tokens,
                    spec.num_accepted_tokens,
                    flush=True,
                )
    base = totals["adaptive"]
    print(
        "totals:", ", ".join(f"{arm} {t:.2f}s (adaptive / it {t / base:.3f}x)" for arm, t in totals.items())
    )


if __name__ == "__main__":
    main()
