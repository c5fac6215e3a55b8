"""What rounding a draft's activations to int8 (`round_draft_activations`) costs in agreement with the
target: the Qwen2.5-0.5B int4 draft teacher-forced on the 1.5B target's own greedy answers, its argmax
at each answer position against the target's token, with bf16 and with int8 activations (same int4
weights, same process); from those matches, the tokens a greedy window of k drafts would accept.

    python draft_activations.py [MAX_TOKENS] [SET]     SET: bench (benchmarks/prompts, 21) or heldout
"""

from __future__ import annotations

import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.decode_stack import use_decode_stack
from specserve.engine.llm import LLM
from specserve.engine.quantization import Int4TiledLinear, round_draft_activations
from specserve.engine.runner import SequenceInput, forward_sequences
from specserve.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "issue20-s36"))
from draft_window import accepted, heldout_prompts  # noqa: E402  (the s36 held-out set and window count)

BLOCK = 16


def main() -> None:
    max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 48
    which = sys.argv[2] if len(sys.argv) > 2 else "bench"
    prompts = [p.messages for p in load_prompts(list(CATEGORIES))] if which == "bench" else heldout_prompts()
    target = LLM("Qwen/Qwen2.5-Coder-1.5B-Instruct", speculative_method="none")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    draft = load_model(spec, None).model.eval()  # no float copy: every forward runs the int4 kernel
    use_decode_stack(draft, None)  # the modules: the stack would not see the activations switched below
    layers = [m for m in draft.modules() if isinstance(m, Int4TiledLinear)]
    assert layers and round_draft_activations(draft) == len(layers), "needs the int4 kernel's VNNI path"
    kv = draft.allocate_kv_cache(256 * BLOCK + 1, spec.dtype, "cpu")
    stats: dict[str, dict[str, list[float]]] = {}
    for messages in tqdm(prompts, desc="prompts"):
        out = target.generate([messages], params)[0]
        cont = out.token_ids
        feed = out.prompt_token_ids + cont[:-1]
        for name, int8 in (("bf16 activations", False), ("int8 activations", True)):
            for layer in layers:
                layer.int8_activations = int8
            hidden = forward_sequences(
                draft, kv, [SequenceInput(feed, 0, list(range(256)), len(cont))], BLOCK
            )
            preds = draft.compute_logits(hidden).argmax(-1).tolist()  # preds[j] guesses cont[j]
            match = [int(p == t) for p, t in zip(preds, cont, strict=True)]
            st = stats.setdefault(name, {"agree": [], "k3": [], "k5": []})
            st["agree"].append(sum(match) / len(match))
            st["k3"].append(accepted(match, 3))
            st["k5"].append(accepted(match, 5))
    rows = [
        {
            "variant": name,
            "prompts": len(st["agree"]),
            "agreement": round(statistics.mean(st["agree"]), 3),
            "accepted_k3": round(statistics.mean(st["k3"]), 3),
            "accepted_k5": round(statistics.mean(st["k5"]), 3),
        }
        for name, st in stats.items()
    ]
    print(json.dumps(rows, indent=1))
    print(f"\n{which} prompts, {max_tokens} greedy target tokens each")
    print("| draft | prompts | agreement | accepted of 3 | accepted of 5 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['prompts']} | {r['agreement']} | {r['accepted_k3']} | {r['accepted_k5']} |"
        )


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(main).result()
