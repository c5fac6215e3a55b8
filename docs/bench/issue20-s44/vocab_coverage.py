"""How much of what the Qwen target writes lies inside the N most frequent tokens of the Python
standard library's source (PSF licence), counted with the target's tokenizer: a draft LM head over
those N tokens could not propose the rest. Texts: the target's own greedy answers (48 tokens, EOS
ignored) to the benchmark prompts (every category) and to the thirty-sixth session's held-out set,
and those prompts' messages.

    python vocab_coverage.py
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams
from specserve.plugins.medusa_data import _stdlib_files, stdlib_path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "docs" / "bench" / "issue20-s36"))
from draft_window import heldout_prompts  # noqa: E402  (the s36 held-out set)

CUTS = (4096, 8192, 16384, 32768, 49152, 65536)


def main() -> None:
    torch.set_num_threads(2)
    llm = LLM(model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct", max_length=4096)
    tok = llm.engine.tokenizer.hf
    start = time.perf_counter()
    counts: Counter[int] = Counter()
    files = _stdlib_files(stdlib_path())
    for path in files:
        try:
            counts.update(tok.encode(path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    print(
        f"stdlib: {len(files)} files, {sum(counts.values())} tokens, {len(counts)} distinct,"
        f" counted in {time.perf_counter() - start:.1f} s"
    )
    ranked = [i for i, _ in counts.most_common()]
    bench = [p.messages for p in load_prompts(list(CATEGORIES))]
    cats = [p.category for p in load_prompts(list(CATEGORIES))]
    held = heldout_prompts()
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs = llm.generate(bench + held, params)
    sets = {
        "benchmark answers": [o.token_ids for o in outs[: len(bench)]],
        "held-out answers": [o.token_ids for o in outs[len(bench) :]],
        "benchmark prompts": [tok.encode(m["content"]) for p in bench for m in p],
        "held-out prompts": [tok.encode(m["content"]) for p in held for m in p],
    }
    for cat in CATEGORIES:
        sets[f"  answers: {cat}"] = [o.token_ids for o, c in zip(outs, cats, strict=False) if c == cat]
    print("share of tokens outside the top N:")
    print(f"{'text':28s} {'tokens':>7s} " + " ".join(f"{c:>7d}" for c in CUTS))
    tops = [set(ranked[:c]) for c in CUTS]
    for name, seqs in sets.items():
        ids = [i for s in seqs for i in s]
        shares = [sum(i not in top for i in ids) / len(ids) for top in tops]
        print(f"{name:28s} {len(ids):7d} " + " ".join(f"{s:7.4f}" for s in shares))


if __name__ == "__main__":
    main()
