"""Training text for draft heads: Python standard library sources and the target's own answers.

Two sources, neither a third-party data set:
- code: the .py files of this interpreter's standard library (`sysconfig.get_paths()["stdlib"]`,
  licence: Python Software Foundation License), read from disk when the data is built; the tests and
  the codec tables are skipped (test data and lookup tables, not code a user asks for).
- distilled: the target's own greedy answers (run by specserve.engine.LLM, batched) to the prompts
  below. They are what a head sees at inference, chat included. The prompts are written here for
  training and are disjoint from benchmarks/prompts/, which the benchmarks measure: answers to those
  would let a head memorise the very outputs it is then timed on.

A sequence is token ids; the held-out split takes every 20th sequence of each source (5%), so both
sources are evaluated. The draft vocabulary (FR-Spec) ranks target ids by how often they occur as
labels in the training split.
"""

from __future__ import annotations

import math
import random
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.engine import LLM

    from .medusa_features import HiddenStateRecorder

STDLIB_LICENCE = "Python Software Foundation License (the interpreter's standard library sources)"
SKIPPED_STDLIB_DIRS = {"test", "tests", "encodings", "site-packages", "idlelib", "lib2to3"}
MIN_SEQUENCE_TOKENS = 16  # shorter chunks (a file's tail) teach little and cost a forward each

# --- distillation prompts (written for this project; not the benchmark's prompts) -------------------
TOPICS = (
    "learning a new language",
    "saving money each month",
    "cooking rice",
    "sleeping better",
    "starting to run",
    "keeping houseplants alive",
    "writing a cover letter",
    "preparing for an interview",
    "visiting a museum",
    "reading more books",
    "the water cycle",
    "how vaccines work",
    "photosynthesis",
    "black holes",
    "the French revolution",
    "climate and weather",
    "electric cars",
    "solar panels",
    "how the internet works",
    "public key cryptography",
    "version control with git",
    "unit testing",
    "databases and indexes",
    "recursion",
    "time zones",
    "making coffee",
    "planning a birthday party",
    "moving to a new city",
    "learning to swim",
    "working from home",
    "team meetings",
    "giving feedback",
    "baking bread",
    "camping for the first time",
    "recycling",
    "volcanoes",
    "the Roman empire",
    "how airplanes fly",
    "composting",
    "learning the guitar",
)
CHAT_TEMPLATES = (
    "Can you explain {topic} to a beginner?",
    "Give me three practical tips about {topic}.",
    "What are common mistakes people make with {topic}?",
    "Write a short paragraph about {topic}.",
    "What are the pros and cons of {topic}?",
    "I am curious about {topic}. Where should I start?",
)
CODE_TASKS = (
    "reverses the words of a sentence",
    "counts the vowels in a string",
    "checks whether a number is prime",
    "merges two sorted lists",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list and keeps the order",
    "flattens a nested list",
    "parses a date in the form YYYY-MM-DD",
    "computes the median of a list",
    "finds the longest common prefix of several strings",
    "converts Celsius to Fahrenheit",
    "reads a CSV file and sums one column",
    "validates an email address with a regular expression",
    "groups words by their first letter",
    "returns the k most common elements of a list",
    "checks whether a string is a palindrome",
    "implements binary search",
    "rotates a matrix by 90 degrees",
    "counts the lines of a text file",
    "chunks a list into pieces of size n",
)
TRANSLATION_SENTENCES = (
    "The train leaves at eight in the morning.",
    "Could you tell me where the library is?",
    "We are going to the beach this weekend.",
    "My brother works in a small bakery.",
    "Please close the window, it is cold.",
    "The meeting has been moved to Thursday.",
    "I would like a cup of tea with milk.",
    "Our garden is full of flowers in spring.",
)
LANGUAGES = ("French", "Spanish", "German")
Messages = list[dict[str, str]]


def _maths_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(5, 90)
    return rng.choice(
        (
            f"A shop sells {a} pencils a day at {b} cents each. How much money does it make in {c} days? Explain.",
            f"Tom has {a} marbles, gives away {b} and then buys {c} more. How many does he have? Show your steps.",
            f"A train travels {a * 10} km in {b} hours. What is its average speed? Explain your reasoning.",
            f"What is {a} percent of {c * 10}? Show the calculation step by step.",
        )
    )


def _docstring_texts(root: Path) -> list[str]:
    """First paragraph-rich module docstrings of the stdlib: text to summarise."""
    import ast

    texts = []
    for path in _stdlib_files(root):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and 300 <= len(doc) <= 1500:
            texts.append(doc)
    return texts


def distill_prompts(n: int, seed: int = 0, stdlib_root: Path | None = None) -> list[tuple[str, Messages]]:
    """`n` (category, chat messages), categories interleaved (chat twice per round: chat is what heads
    serve most)."""
    rng = random.Random(seed)
    chat = [t.format(topic=topic) for topic in TOPICS for t in CHAT_TEMPLATES]
    rng.shuffle(chat)
    code = [f"Write a Python function that {task}. Explain it briefly." for task in CODE_TASKS]
    translate = [f"Translate into {lang}: {s}" for s in TRANSLATION_SENTENCES for lang in LANGUAGES]
    rng.shuffle(translate)
    docs = _docstring_texts(stdlib_root or stdlib_path()) if n >= 7 else []
    rng.shuffle(docs)
    summarise = [f"Summarise this text in two sentences:\n\n{d}" for d in docs]
    pools: list[tuple[str, Callable[[int], str | None]]] = [
        ("chat", lambda i: chat[(2 * i) % len(chat)]),
        ("code", lambda i: code[i] if i < len(code) else None),
        ("maths", lambda i: _maths_prompt(rng)),
        ("chat", lambda i: chat[(2 * i + 1) % len(chat)]),
        ("translation", lambda i: translate[i] if i < len(translate) else None),
        ("summarisation", lambda i: summarise[i] if i < len(summarise) else None),
    ]
    out: list[tuple[str, Messages]] = []
    seen: set[str] = set()
    round_ = 0
    while len(out) < n and round_ < 10 * n + 10:
        for category, pool in pools:
            text = pool(round_)
            if text is not None and text not in seen and len(out) < n:
                seen.add(text)
                out.append((category, [{"role": "user", "content": text}]))
        round_ += 1
    return out


# --- standard library code -------------------------------------------------------------------------
def stdlib_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    return [
        p for p in sorted(root.rglob("*.py")) if not SKIPPED_STDLIB_DIRS & set(p.relative_to(root).parts[:-1])
    ]


def stdlib_examples(
    encode: Callable[[str], list[int]], max_tokens: int, seq_len: int, seed: int = 0, root: Path | None = None
) -> list[Example]:
    """Chunks of `seq_len` tokens from stdlib files taken in a seeded random order, `max_tokens` in all."""
    files = _stdlib_files(root or stdlib_path())
    random.Random(seed).shuffle(files)
    examples: list[Example] = []
    total = 0
    for path in files:
        if total >= max_tokens:
            break
        try:
            ids = encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        for start in range(0, len(ids), seq_len):
            chunk = ids[start : start + seq_len][: max_tokens - total]
            if len(chunk) >= MIN_SEQUENCE_TOKENS:
                examples.append(Example(chunk, "code"))
                total += len(chunk)
    return examples


# --- the data set ------------------------------------------------------------------------------------
@dataclass
class Example:
    """One teacher-forced sequence. Feature row j is the target's hidden state at position start + j;
    `features` is set when they were recorded while the target generated the text (distilled answers)."""

    tokens: list[int]
    source: str  # "code" | "distilled" | a caller's name
    start: int = 0
    features: torch.Tensor | None = None  # [rows, hidden] bf16

    def to_state(self) -> dict:
        empty = torch.zeros(0, dtype=torch.bfloat16)
        return {"tokens": self.tokens, "source": self.source, "start": self.start, "features": empty}

    @classmethod
    def from_state(cls, state: dict) -> Example:
        feats = state["features"]
        return cls(state["tokens"], state["source"], state["start"], feats if feats.numel() else None)


@dataclass
class TrainingData:
    """Examples split into train and held-out."""

    train: list[Example] = field(default_factory=list)
    heldout: list[Example] = field(default_factory=list)

    def add(self, examples: list[Example], heldout_every: int = 20) -> None:
        """Every `heldout_every`-th example is held out (at least one of two or more). Call once per
        source, so that every source is evaluated."""
        for i, ex in enumerate(examples):
            held = len(examples) >= 2 and i % heldout_every == min(heldout_every // 2, len(examples) - 1)
            (self.heldout if held else self.train).append(ex)

    def summary(self) -> dict:
        out: dict[str, dict] = {}
        for split, examples in (("train", self.train), ("heldout", self.heldout)):
            for ex in examples:
                row = out.setdefault(
                    ex.source, {f"{a}_{b}": 0 for a in ("train", "heldout") for b in ("sequences", "tokens")}
                )
                row[f"{split}_sequences"] += 1
                row[f"{split}_tokens"] += len(ex.tokens)
        return dict(sorted(out.items()))

    def to_state(self, with_features: bool = True) -> dict:
        """For torch.save(weights_only=True): plain lists, dicts and tensors."""

        def state(ex: Example) -> dict:
            d = ex.to_state()
            if with_features and ex.features is not None:
                d["features"] = ex.features
            return d

        return {"train": [state(e) for e in self.train], "heldout": [state(e) for e in self.heldout]}

    @classmethod
    def from_state(cls, state: dict) -> TrainingData:
        return cls(
            [Example.from_state(d) for d in state["train"]], [Example.from_state(d) for d in state["heldout"]]
        )


def frequency_ranked_vocab(examples: list[Example], vocab_size: int, n: int) -> torch.Tensor:
    """[n] target ids, most frequent first (ties by id); ids never seen fill the tail in id order.
    Counted over the tokens the heads are trained to predict (from the first feature row's next on)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ex in examples:
        labels = torch.tensor(ex.tokens[ex.start + 1 :], dtype=torch.int64)
        counts += torch.bincount(labels, minlength=vocab_size)[:vocab_size]
    # Stable sort on -count keeps id order among equal counts.
    return torch.sort(-counts, stable=True).indices[:n].clone()


def distill(
    llm: LLM,
    recorder: HiddenStateRecorder,
    prompts: list[tuple[str, Messages]],
    max_tokens: int,
    progress: bool = True,
    stop_at: float = math.inf,
) -> list[Example]:
    """The target's greedy answers, with the hidden states its engine produced them from (recorded by
    `recorder`, the engine's proposer), so the answers cost no second forward. The engine batches;
    no new batch starts after `stop_at` (time.perf_counter()). Source: "distilled/<category>"."""
    from tqdm import tqdm

    from specserve.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    batch = llm.engine.config.max_batch_size
    examples: list[Example] = []
    with tqdm(total=len(prompts), desc="distilling", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(prompts), batch):
            if time.perf_counter() >= stop_at:
                break
            chunk = prompts[start : start + batch]
            category_of = {tuple(llm.encode_prompt(m)): c for c, m in chunk}
            llm.generate([m for _, m in chunk], params)  # chat template applied; the recorder keeps the rest
            for rec in recorder.pop_finished():
                if len(rec.features):
                    tokens = rec.prompt_token_ids + rec.output_token_ids
                    source = f"distilled/{category_of.get(tuple(rec.prompt_token_ids), 'other')}"
                    examples.append(Example(tokens, source, len(rec.prompt_token_ids) - 1, rec.features))
            bar.update(len(chunk))
    return examples
