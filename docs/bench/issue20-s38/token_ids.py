"""How well Qwen2.5's token ids order tokens by frequency on our prompts: the share of the prompts'
tokens whose ids lie at or above a cut (a draft LM head over ids below the cut could not propose
them). Prompts: benchmarks/prompts (every category) and the thirty-sixth session's held-out set.

    python token_ids.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoTokenizer

from specserve.benchmarks.prompt_sets import CATEGORIES, load_prompts

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "docs" / "bench" / "issue20-s36"))
from draft_window import heldout_prompts  # noqa: E402  (the s36 held-out set)

CUTS = (8192, 16384, 32768, 49152, 65536, 98304)


def main() -> None:
    converted = sorted((Path.home() / ".cache/specserve/converted").glob("Qwen2.5-Coder-1.5B-Instruct-*"))
    if not converted:
        raise SystemExit(
            "convert Qwen/Qwen2.5-Coder-1.5B-Instruct first (any specserve command that loads it)"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(converted[-1]))
    # Each message's text (a chat's turns one by one), not the JSON lines around them.
    texts = [m["content"] for p in load_prompts(list(CATEGORIES)) for m in p.messages]
    texts += [m["content"] for messages in heldout_prompts() for m in messages]
    ids = [i for t in texts for i in tokenizer.encode(t)]
    print(f"{len(texts)} messages, {len(ids)} tokens, vocabulary {len(tokenizer)}")
    for cut in CUTS:
        print(f"ids >= {cut}: {sum(i >= cut for i in ids) / len(ids):.4f} of the tokens")


if __name__ == "__main__":
    main()
