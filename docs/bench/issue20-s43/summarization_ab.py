"""Batch 1, the Qwen pair (the hybrid with n-gram lookup): each summarisation prompt under the adaptive
policy and then static K=5, 48 greedy tokens (EOS ignored), one engine, the step log written beside.
A check of the policy bench's summarisation cell (0.913x of K=5 there).

    python summarization_ab.py STEP_LOG.jsonl
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
    log = Path(sys.argv[1])
    log.unlink(missing_ok=True)
    torch.set_num_threads(2)
    llm = LLM(
        model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        draft_quantization_encoding="int4",
        max_length=4096,
        step_log=str(log),
    )
    adaptive = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    static = SamplingParams(
        max_tokens=48, temperature=0, ignore_eos=True, speculative_policy="static", num_speculative_tokens=5
    )
    llm.generate(["warm up"], adaptive)
    for prompt in load_prompts(["summarization"]):
        for arm, params in (("adaptive", adaptive), ("static5", static)):
            with log.open("a") as f:
                f.write(json.dumps({"marker": f"{prompt.id} {arm}"}) + "\n")
            out = llm.generate([prompt.messages], params)[0]
            spec = out.spec
            print(
                prompt.id,
                arm,
                f"{out.elapsed_s:.2f}s",
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                flush=True,
            )


if __name__ == "__main__":
    main()
