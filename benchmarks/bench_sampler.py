"""Sampling and verification costs side by side: each shortcut against the whole-vocabulary path it
replaces, on one model's real logits. Per batch shape (sequences x rows each, i.e. 1 + drafts) and
operation, the median time of each arm, per row, and the paired ratio whole / shortcut (> 1: the
shortcut is faster). Operations:

- greedy: deciding greedy windows (`verify_windows`: the argmax of the rows) against the full path
  (clone, softmax, one-hot rows, the rejection sampler);
- top_k: the k-th score per row by a partial selection (topk) against a sort of the vocabulary;
- top_p: the top-p boundary from the most likely tokens (a sort only for the rows it leaves) against
  a sort of every row.

    python -m specserve.benchmarks.bench_sampler --sequences 1,16,32 --rows-each 1,5
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.request import Request
from specserve.engine.runner import SequenceInput, forward_sequences
from specserve.engine.sampler import _apply_top_k, _apply_top_p, _top_p_lowest_kept_by_sort
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tokenizer import Tokenizer
from specserve.engine.verifier import Window, _sample_windows, verify_windows

from .common import fmt, md_table, progress
from .harness import (
    add_output_args,
    envelope,
    int_list,
    markdown_document,
    output_dir,
    positive_int,
    print_report,
    save_ratio_bars,
    write_report,
)
from .prompt_sets import CATEGORIES, load_prompts

SCHEMA = "specserve.bench.sampler/1"
KIND = "sampler"
BLOCK_SIZE = 16
OPERATIONS = ("greedy", "top_k", "top_p")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_sampler", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="model (default: the embedded SmolLM2-135M)")
    p.add_argument("--quantization-encoding", default="bfloat16")
    p.add_argument("--sequences", type=int_list, default=[1, 16, 32], help="batch sizes (comma list)")
    p.add_argument(
        "--rows-each", type=int_list, default=[1, 5], help="rows per sequence: 1 + its drafts (comma list)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="of the top_k and top_p rows")
    p.add_argument("--top-k", type=positive_int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--repeats", type=positive_int, default=7, help="timed calls per arm and shape")
    p.add_argument("--cache-dir", default=None)
    add_output_args(p, KIND)
    return p


def _real_logits(args: argparse.Namespace) -> torch.Tensor:
    """[T, V] float32: the model's logits at every position of the prompt sets' first prompts, so the
    rows have a language model's shapes (peaked after a name, flat at a sentence's start)."""
    spec = ModelSpec(model_path=args.model_path, quantization_encoding=args.quantization_encoding)
    loaded = load_model(spec, args.cache_dir)
    tokenizer = Tokenizer(loaded.directory, loaded.arch.eos_token_ids)
    text = "\n".join(m["content"] for p in load_prompts(list(CATEGORIES), 1) for m in p.messages)
    ids = tokenizer.encode(text)[:512]
    kv_cache = loaded.model.allocate_kv_cache(len(ids) + BLOCK_SIZE + 1, spec.dtype, spec.device)
    seq = SequenceInput(ids, 0, list(range(-(-len(ids) // BLOCK_SIZE))), len(ids))
    with torch.inference_mode():
        hidden = forward_sequences(loaded.model, kv_cache, [seq], BLOCK_SIZE)
        return loaded.model.compute_logits(hidden).float()


def _arms(
    operation: str, logits: torch.Tensor, sequences: int, rows_each: int, args: argparse.Namespace
) -> dict[str, Callable[[], object]]:
    """{"whole": ..., "shortcut": ...}: the same work on `logits` ([sequences * rows_each, V])."""
    if operation == "greedy":
        params = SamplingParams(max_tokens=8, temperature=0.0)
        argmax = logits.argmax(dim=-1).tolist()
        windows = []
        for s in range(sequences):
            start = s * rows_each
            # Drafts the target would keep, so every row is read.
            drafts = argmax[start : start + rows_each - 1]
            windows.append(Window(Request(f"r{s}", [1, 2, 3], params), drafts, None, None))
        return {
            "whole": lambda: _sample_windows(logits, windows),
            "shortcut": lambda: verify_windows(logits, windows),
        }
    scores = logits / args.temperature
    rows = logits.shape[0]
    if operation == "top_k":
        k = args.top_k
        params = [SamplingParams(max_tokens=8, temperature=args.temperature, top_k=k)] * rows

        def top_k_by_sort() -> object:
            kth = scores.sort(dim=-1, descending=True).values[:, k - 1 : k]  # [N, 1]
            return scores.masked_fill(scores < kth, -math.inf)

        return {"whole": top_k_by_sort, "shortcut": lambda: _apply_top_k(scores.clone(), params)}
    params = [SamplingParams(max_tokens=8, temperature=args.temperature, top_p=args.top_p)] * rows
    limit = torch.full((rows,), 1.0 - args.top_p)

    def top_p_by_sort() -> object:
        lowest_kept = _top_p_lowest_kept_by_sort(scores, limit)  # [N]
        return scores.masked_fill(scores < lowest_kept.unsqueeze(1), -math.inf)

    return {"whole": top_p_by_sort, "shortcut": lambda: _apply_top_p(scores.clone(), params)}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    source = _real_logits(args)  # [T, V]
    shapes = [(op, s, r) for op in OPERATIONS for s in args.sequences for r in args.rows_each]
    results: list[dict[str, Any]] = []
    with progress(len(shapes), "sampler", args.no_progress) as bar:
        for operation, sequences, rows_each in shapes:
            num_rows = sequences * rows_each
            # Positions drawn at random (seeded), so a small batch is not the text's flat first rows.
            gen = torch.Generator().manual_seed(num_rows)
            picks = torch.randint(0, source.shape[0], (num_rows,), generator=gen)
            arms = _arms(operation, source[picks].contiguous(), sequences, rows_each, args)
            times: dict[str, list[float]] = {name: [] for name in arms}
            for rep in range(args.repeats + 1):  # the first round warms up and is dropped
                for name in arms if rep % 2 == 0 else reversed(list(arms)):
                    seconds = _timed(arms[name])
                    if rep > 0:
                        times[name].append(seconds)
            ratios = [a / b for a, b in zip(times["whole"], times["shortcut"], strict=True)]
            results.append(
                {
                    "operation": operation,
                    "sequences": sequences,
                    "rows_each": rows_each,
                    "whole_ms": [t * 1e3 for t in times["whole"]],
                    "shortcut_ms": [t * 1e3 for t in times["shortcut"]],
                    "whole_ms_per_row": statistics.median(times["whole"]) * 1e3 / num_rows,
                    "shortcut_ms_per_row": statistics.median(times["shortcut"]) * 1e3 / num_rows,
                    "whole_over_shortcut": statistics.median(ratios),
                }
            )
            bar.update(1)
    report = envelope(SCHEMA, "bench_sampler", argv)
    report.update(
        config={k: v for k, v in vars(args).items() if k not in ("output_dir", "no_plots", "no_progress")},
        threads=torch.get_num_threads(),
        vocab=int(source.shape[1]),
        results=results,
    )
    return report


def markdown(report: dict[str, Any]) -> str:
    rows = [
        [
            r["operation"],
            str(r["sequences"]),
            str(r["rows_each"]),
            fmt(r["whole_ms_per_row"], 3),
            fmt(r["shortcut_ms_per_row"], 3),
            fmt(r["whole_over_shortcut"], 1, "x"),
        ]
        for r in report["results"]
    ]
    header = ["operation", "sequences", "rows each", "whole ms/row", "shortcut ms/row", "whole / shortcut"]
    config = report["config"]
    lines = [
        "# sampling and verification",
        "",
        f"`{report['command']}`",
        "",
        f"Real logits of {config['model_path'] or 'the embedded SmolLM2-135M'} (vocabulary"
        f" {report['vocab']}, {report['threads']} threads); top_k {config['top_k']} and top_p"
        f" {config['top_p']} rows at temperature {config['temperature']}. Median of {config['repeats']}"
        " calls per arm; the ratio is the median of paired ratios.",
        "",
        md_table(header, rows),
    ]
    return markdown_document(lines, report)


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    results = report["results"]
    return save_ratio_bars(
        [f"{r['operation']} {r['sequences']}x{r['rows_each']}" for r in results],
        [r["whole_over_shortcut"] for r in results],
        out_dir / f"{KIND}.png",
        "whole-vocabulary time / shortcut time",
        "operation sequences x rows each",
        color="tab:green",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 < args.top_p < 1.0 or not args.temperature > 0:
        parser.error("--top-p must be in (0, 1) and --temperature above 0")
    report = run(args, argv)
    write_report(report, output_dir(args, KIND), KIND, markdown, plot, plots=not args.no_plots)
    print_report(report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
