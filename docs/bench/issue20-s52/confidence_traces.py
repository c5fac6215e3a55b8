"""s44's agreement traces (`../issue20-s44/agreement_traces.py`) with the draft's confidence: for each
prompt, the Qwen target's greedy answer (MAX_TOKENS, EOS ignored) and, at every answer position,
whether the int4 0.5B draft's argmax given the target's own prefix is the target's token, and the
draft's probability of its argmax there. While the draft agrees its context is the target's, so a
greedy window from position t that stops after its first draft below a confidence threshold is
simulated exactly from these two lists (`stop_sim.py`).

    python confidence_traces.py OUT.json [MAX_TOKENS]
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
sys.path.insert(0, str(REPO / "docs" / "bench" / "issue20-s44"))
sys.path.insert(0, str(REPO / "docs" / "bench" / "issue20-s36"))
from draft_window import heldout_prompts  # noqa: E402  (the s36 held-out set)
from heldout_s44 import heldout_s44  # noqa: E402

BLOCK = 16


def main() -> None:
    out_path = Path(sys.argv[1])
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 48
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
        agree: list[int] = []
        confidence: list[float] = []
        with torch.inference_mode():
            hidden = forward_sequences(draft, kv, [SequenceInput(ids, 0, table, 1)], BLOCK)
            for j, token in enumerate(cont):
                probs = torch.softmax(draft.compute_logits(hidden).float()[-1], dim=-1)  # [V]
                top = int(probs.argmax().item())
                agree.append(int(top == token))
                confidence.append(round(float(probs[top].item()), 4))
                if j + 1 < len(cont):
                    hidden = forward_sequences(
                        draft, kv, [SequenceInput([token], len(ids) + j, table, 1)], BLOCK
                    )
        traces.append(
            {
                "set": group,
                "id": pid,
                "category": cat,
                "prompt_tokens": len(ids),
                "agree": agree,
                "confidence": confidence,
            }
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"max_tokens": max_tokens, "traces": traces}) + "\n")


if __name__ == "__main__":
    main()
