"""Traces for simulating the controller at batch 1: for each prompt, the Qwen target's greedy answer
(MAX_TOKENS, EOS ignored) and, at every answer position, whether the int4 0.5B draft's argmax given
the target's own prefix is the target's token. While the draft agrees its context is the target's,
so the tokens a greedy window of k drafts from position t accepts is min(k, run of agreements from t).

The draft is loaded as the server loads it and fed as it drafts: the prompt in one forward (a
catch-up, the float GEMMs), then the answer one token a forward (its int4 kernels with int8
activations).

    python agreement_traces.py OUT.json [MAX_TOKENS]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.llm import LLM
from specserve.engine.runner import SequenceInput, forward_sequences
from specserve.engine.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "docs" / "bench" / "issue20-s36"))
from draft_window import heldout_prompts  # noqa: E402  (the s36 held-out set)
from heldout_s44 import heldout_s44  # noqa: E402

BLOCK = 16


def main() -> None:
    out_path = Path(sys.argv[1])
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    torch.set_num_threads(2)
    prompts = [("bench", p.id, p.category, p.messages) for p in load_prompts(list(CATEGORIES))]
    prompts += [("heldout-s36", f"s36-{i + 1}", "mixed", m) for i, m in enumerate(heldout_prompts())]
    prompts += [("heldout-s44", pid, cat, m) for pid, cat, m in heldout_s44()]
    target = LLM("Qwen/Qwen2.5-Coder-1.5B-Instruct", speculative_method="none", max_length=4096)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    answers = target.generate([m for _, _, _, m in prompts], params)
    del target
    spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    draft = load_model(spec, None, draft=True).model.eval()
    per_seq = 4096 // BLOCK
    kv = draft.allocate_kv_cache(per_seq * BLOCK + 1, spec.dtype, "cpu")
    table = list(range(per_seq))
    traces = []
    for (group, pid, cat, _), ans in tqdm(list(zip(prompts, answers, strict=True)), desc="draft"):
        ids, cont = ans.prompt_token_ids, ans.token_ids
        agree = []
        with torch.inference_mode():
            hidden = forward_sequences(draft, kv, [SequenceInput(ids, 0, table, 1)], BLOCK)
            for j, token in enumerate(cont):
                agree.append(int(draft.compute_logits(hidden).argmax(-1).item() == token))
                if j + 1 < len(cont):
                    hidden = forward_sequences(
                        draft, kv, [SequenceInput([token], len(ids) + j, table, 1)], BLOCK
                    )
        traces.append({"set": group, "id": pid, "category": cat, "prompt_tokens": len(ids), "agree": agree})
        print(pid, cat, len(ids), f"{sum(agree) / len(agree):.2f}", flush=True)
    out_path.write_text(json.dumps({"max_tokens": max_tokens, "traces": traces}) + "\n")


if __name__ == "__main__":
    main()
