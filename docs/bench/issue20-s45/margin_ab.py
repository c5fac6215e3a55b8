"""Batch 1, the Qwen pair (the hybrid with n-gram lookup), adaptive policy: two engines in one process,
one with StepCostModel's `inconsistent_margin` as built (INCONSISTENT_MARGIN) and one with 0.0 (the
forty-fourth session's engine), taking the same prompts in turn (the order alternating prompt by
prompt), so the machine's drift falls on both alike. 48 greedy tokens a prompt (EOS ignored), ROUNDS
rounds over the benchmark's prompts (PER_CATEGORY a category) and heldout_s45's; each engine writes its
own step log.

    python margin_ab.py OUT_DIR ROUNDS [PER_CATEGORY]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from heldout_s45 import heldout_s45

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.step_cost_model import INCONSISTENT_MARGIN

MARGINS = {"built": INCONSISTENT_MARGIN, "margin0": 0.0}


def build(log: Path, margin: float) -> LLM:
    log.unlink(missing_ok=True)
    llm = LLM(
        model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        draft_model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        draft_quantization_encoding="int4",
        max_length=4096,
        step_log=str(log),
    )
    assert llm.engine.controller is not None
    llm.engine.controller.cost.inconsistent_margin = margin
    return llm


def main() -> None:
    out, rounds = Path(sys.argv[1]), int(sys.argv[2])
    per_category = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    engines = {arm: build(out / f"steps-{arm}.jsonl", m) for arm, m in MARGINS.items()}
    for llm in engines.values():
        llm.generate(["warm up"], params)
    prompts = [("bench", p.id, p.category, p.messages) for p in load_prompts(list(CATEGORIES), per_category)]
    prompts += [("heldout-s45", pid, cat, m) for pid, cat, m in heldout_s45()]
    rows = []
    print("# columns: round, set, prompt, arm, seconds, drafting steps, draft tokens, accepted", flush=True)
    for r in range(rounds):
        for i, (pset, pid, cat, messages) in enumerate(prompts):
            arms = list(engines) if (i + r) % 2 == 0 else list(reversed(engines))
            texts = {}
            for arm in arms:
                got = engines[arm].generate([messages], params)[0]
                texts[arm] = got.token_ids
                spec = got.spec
                rows.append(
                    {
                        "round": r,
                        "set": pset,
                        "prompt": pid,
                        "category": cat,
                        "arm": arm,
                        "seconds": got.elapsed_s,
                    }
                )
                print(
                    r,
                    pset,
                    pid,
                    arm,
                    f"{got.elapsed_s:.3f}",
                    spec.num_drafts,
                    spec.num_draft_tokens,
                    spec.num_accepted_tokens,
                    flush=True,
                )
            if len({tuple(t) for t in texts.values()}) != 1:
                print(f"TOKENS DIFFER on {pid} round {r}", flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(summarise(rows))


def summarise(rows: list[dict]) -> str:
    """Per set and category: total seconds per arm and margin0 / built (the built engine's speed
    against the other's); per set the mean of the categories' ratios and the paired per-prompt ratios'
    median."""
    seconds: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    paired: dict[str, dict[tuple[int, str], dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        seconds[(row["set"], row["category"])][row["arm"]] += row["seconds"]
        paired[row["set"]][(row["round"], row["prompt"])][row["arm"]] = row["seconds"]
    lines = [f"{'set':12s} {'category':15s} {'built s':>8s} {'margin0 s':>9s} {'speed built/margin0':>19s}"]
    by_set: dict[str, list[float]] = defaultdict(list)
    for (pset, cat), arms in sorted(seconds.items()):
        ratio = arms["margin0"] / arms["built"]
        by_set[pset].append(ratio)
        lines.append(f"{pset:12s} {cat:15s} {arms['built']:8.2f} {arms['margin0']:9.2f} {ratio:19.3f}")
    for pset, ratios in by_set.items():
        pairs = [p["margin0"] / p["built"] for p in paired[pset].values()]
        lines.append(
            f"{pset}: mean over categories {statistics.mean(ratios):.3f}, median paired prompt"
            f" {statistics.median(pairs):.3f} ({len(pairs)} pairs), built faster in"
            f" {sum(p > 1 for p in pairs)} of {len(pairs)}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
