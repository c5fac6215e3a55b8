"""Load the benchmark prompt sets in benchmarks/prompts/ (one JSON-lines file per category)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS_DIR = Path(__file__).parent / "prompts"
# Spec-Bench's categories, in its order; names are the file stems.
CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag", "code")
ALIASES = {
    "chat": "multi_turn",
    "summary": "summarization",
    "math": "math_reasoning",
    "summarisation": "summarization",
}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: list[dict[str, Any]]


def parse_categories(text: str | None) -> list[str]:
    if not text or text == "all":
        return list(CATEGORIES)
    out = []
    for raw in text.split(","):
        name = ALIASES.get(raw.strip(), raw.strip())
        if name not in CATEGORIES:
            raise ValueError(f"unknown prompt category {raw!r}; choose from {', '.join(CATEGORIES)} (or all)")
        if name not in out:
            out.append(name)
    return out


def load_prompts(
    categories: list[str], per_category: int | None = None, directory: Path = PROMPTS_DIR
) -> list[Prompt]:
    prompts: list[Prompt] = []
    for cat in categories:
        path = directory / f"{cat}.jsonl"
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        items = [json.loads(ln) for ln in lines]
        for item in items[: per_category or None]:
            prompts.append(Prompt(item["id"], item.get("category", cat), item["messages"]))
    return prompts
