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

import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.engine import LLM

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


def distill_prompts(n: int, seed: int = 0, stdlib_root: Path | None = None) -> list[Messages]:
    """`n` chat prompts, categories interleaved (chat twice per round: chat is what heads serve most)."""
    rng = random.Random(seed)
    chat = [t.format(topic=topic) for topic in TOPICS for t in CHAT_TEMPLATES]
    rng.shuffle(chat)
    code = [f"Write a Python function that {task}. Explain it briefly." for task in CODE_TASKS]
    translate = [f"Translate into {lang}: {s}" for s in TRANSLATION_SENTENCES for lang in LANGUAGES]
    rng.shuffle(translate)
    docs = _docstring_texts(stdlib_root or stdlib_path()) if n >= 7 else []
    rng.shuffle(docs)
    summarise = [f"Summarise this text in two sentences:\n\n{d}" for d in docs]
    pools: list[Callable[[int], str | None]] = [
        lambda i: chat[(2 * i) % len(chat)],
        lambda i: code[i] if i < len(code) else None,
        lambda i: _maths_prompt(rng),
        lambda i: chat[(2 * i + 1) % len(chat)],
        lambda i: translate[i] if i < len(translate) else None,
        lambda i: summarise[i] if i < len(summarise) else None,
    ]
    out: list[Messages] = []
    seen: set[str] = set()
    round_ = 0
    while len(out) < n and round_ < 10 * n + 10:
        for pool in pools:
            text = pool(round_)
            if text is not None and text not in seen and len(out) < n:
                seen.add(text)
                out.append([{"role": "user", "content": text}])
        round_ += 1
    return out


# --- standard library code -------------------------------------------------------------------------
def stdlib_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    return [
        p for p in sorted(root.rglob("*.py")) if not SKIPPED_STDLIB_DIRS & set(p.relative_to(root).parts[:-1])
    ]


def stdlib_sequences(
    encode: Callable[[str], list[int]], max_tokens: int, seq_len: int, seed: int = 0, root: Path | None = None
) -> list[list[int]]:
    """Chunks of `seq_len` tokens from stdlib files taken in a seeded random order, `max_tokens` in all."""
    files = _stdlib_files(root or stdlib_path())
    random.Random(seed).shuffle(files)
    sequences: list[list[int]] = []
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
                sequences.append(chunk)
                total += len(chunk)
    return sequences


# --- the data set ------------------------------------------------------------------------------------
@dataclass
class TrainingData:
    """Token sequences with their source ("code" / "distilled"), split into train and held-out."""

    train: list[list[int]] = field(default_factory=list)
    train_sources: list[str] = field(default_factory=list)
    heldout: list[list[int]] = field(default_factory=list)
    heldout_sources: list[str] = field(default_factory=list)

    def add(self, source: str, sequences: list[list[int]], heldout_every: int = 20) -> None:
        """Every `heldout_every`-th sequence of the source is held out (at least one of two or more)."""
        for i, seq in enumerate(sequences):
            held = len(sequences) >= 2 and i % heldout_every == min(heldout_every // 2, len(sequences) - 1)
            (self.heldout if held else self.train).append(seq)
            (self.heldout_sources if held else self.train_sources).append(source)

    def summary(self) -> dict:
        out = {}
        for source in sorted(set(self.train_sources) | set(self.heldout_sources)):
            train = [s for s, src in zip(self.train, self.train_sources, strict=True) if src == source]
            held = [s for s, src in zip(self.heldout, self.heldout_sources, strict=True) if src == source]
            out[source] = {
                "train_sequences": len(train),
                "train_tokens": sum(map(len, train)),
                "heldout_sequences": len(held),
                "heldout_tokens": sum(map(len, held)),
            }
        return out

    def to_state(self) -> dict:
        return {k: getattr(self, k) for k in ("train", "train_sources", "heldout", "heldout_sources")}

    @classmethod
    def from_state(cls, state: dict) -> TrainingData:
        return cls(**{k: state[k] for k in ("train", "train_sources", "heldout", "heldout_sources")})


def frequency_ranked_vocab(sequences: list[list[int]], vocab_size: int, n: int) -> torch.Tensor:
    """[n] target ids, most frequent first (ties by id); ids never seen fill the tail in id order."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        counts += torch.bincount(torch.tensor(seq, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    # Stable sort on -count keeps id order among equal counts.
    return torch.sort(-counts, stable=True).indices[:n].clone()


def distill(llm: LLM, prompts: list[Messages], max_tokens: int, batch_size: int = 16, progress: bool = True):
    """The target's greedy answers, prompt and answer as one sequence each (the engine batches)."""
    from tqdm import tqdm

    from specserve.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    sequences: list[list[int]] = []
    with tqdm(total=len(prompts), desc="distilling", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            for out in llm.generate(chunk, params):  # chat template applied
                if out.error is None:
                    sequences.append(out.prompt_token_ids + out.token_ids)
            bar.update(len(chunk))
    return sequences
