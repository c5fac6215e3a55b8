"""Attention backends side by side: one model's whole forward (all layers, paged KV) per batch shape,
with torch SDPA everywhere, with SDPA for prefill chunks and torch matmuls for decodes and verification
windows (`matmul`), and with the default CPU backend (the paged-decode kernel for those where it builds,
else the matmuls). Arms alternate within every repeat; the table gives the median forward time of each
and the paired ratios SDPA / default and matmul / default (> 1: the default is faster).

    python -m specserve.benchmarks.bench_attention --model-path Qwen/Qwen2.5-Coder-1.5B-Instruct \\
        --sequences 1,4,8,16 --context 256,1024 --queries 1,5

`--context-spread F` gives the sequences of a batch contexts spread evenly from (1 - F) x context up to
context, as requests that started apart have: the padded paths attend every sequence to the longest.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from specserve.engine.attention import (
    AttentionBackend,
    cpu_paged_attention,
    paged_attention,
    select_attention_backend,
)
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.models.decoder import CausalDecoder
from specserve.engine.runner import SequenceInput, forward_sequences

from .common import fmt, md_table, progress
from .harness import (
    add_output_args,
    alternated_seconds,
    envelope,
    int_list,
    markdown_document,
    output_dir,
    positive_int,
    print_report,
    save_ratio_bars,
    write_report,
)

SCHEMA = "specserve.bench.attention/2"
KIND = "attention"
BLOCK_SIZE = 16


def random_kv_cache(
    model: CausalDecoder, num_slots: int, spec: ModelSpec
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A KV cache of random K/V rather than a prefilled prompt's: attention costs the same over any
    values (but not over untouched zero pages, which all map to one page in the cache)."""
    kv_cache = model.allocate_kv_cache(num_slots, spec.dtype, spec.device)
    for keys, values in kv_cache:
        keys.normal_()
        values.normal_()
    return kv_cache


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_attention", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="model (default: the embedded SmolLM2-135M)")
    p.add_argument("--quantization-encoding", default="bfloat16")
    p.add_argument("--sequences", type=int_list, default=[1, 4, 8], help="batch sizes (comma list)")
    p.add_argument("--context", type=int_list, default=[256, 1024], help="tokens already cached per sequence")
    p.add_argument("--queries", type=int_list, default=[1, 5], help="new tokens per sequence (1 = decode)")
    p.add_argument(
        "--context-spread",
        type=spread,
        default=0.0,
        help="contexts of a batch spread evenly from (1 - F) x context up to context (default 0: all equal)",
    )
    p.add_argument("--repeats", type=positive_int, default=5, help="timed forwards per arm and shape")
    p.add_argument(
        "--thread",
        choices=("worker", "main"),
        default="worker",
        help="run the forwards in a worker thread, as `specserve serve` runs its steps, or in the main"
        " thread, as an in-process LLM.generate does (glibc's heap treats their temporaries differently)",
    )
    p.add_argument("--cache-dir", default=None)
    add_output_args(p, KIND)
    return p


def spread(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1): {text!r}")
    return value


def contexts_of(num_seqs: int, context: int, spread: float) -> list[int]:
    """Each sequence's cached context: evenly from (1 - spread) x context to context (the last, or a
    lone sequence, has the whole context)."""
    width = context * spread
    return [round(context - width * (num_seqs - 1 - i) / max(num_seqs - 1, 1)) for i in range(num_seqs)]


def _sequences(tables: list[list[int]], contexts: list[int], queries: int) -> list[SequenceInput]:
    return [
        SequenceInput([1] * queries, c, table, queries) for table, c in zip(tables, contexts, strict=True)
    ]


def _use(model: CausalDecoder, backend: AttentionBackend) -> None:
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = backend


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    if args.thread == "main":
        return _run(args, argv)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-attention") as worker:
        return worker.submit(_run, args, argv).result()


def _run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    spec = ModelSpec(model_path=args.model_path, quantization_encoding=args.quantization_encoding)
    model = load_model(spec, args.cache_dir).model.eval()
    longest = max(args.context) + max(args.queries)
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    num_slots = max(args.sequences) * blocks_per_seq * BLOCK_SIZE + 1  # + the reserved padding slot
    kv_cache = random_kv_cache(model, num_slots, spec)
    shapes = [(s, c, q) for s in args.sequences for c in args.context for q in args.queries]
    default_name, default = select_attention_backend("cpu")
    arms = {"sdpa": paged_attention, "matmul": cpu_paged_attention, "default": default}
    rows: list[dict[str, Any]] = []
    with progress(len(shapes), "attention", args.no_progress) as bar:
        for num_seqs, context, queries in shapes:
            tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
            contexts = contexts_of(num_seqs, context, args.context_spread)
            forward = functools.partial(
                forward_sequences, model, kv_cache, _sequences(tables, contexts, queries), BLOCK_SIZE
            )
            # One warm-up round, dropped; each arm's backend switched in untimed before its forward.
            times = alternated_seconds(
                {name: forward for name in arms},
                args.repeats,
                prepare=lambda name: _use(model, arms[name]),
            )
            row: dict[str, Any] = {
                "sequences": num_seqs,
                "context": context,
                "contexts": contexts,
                "queries": queries,
            }
            for name in arms:
                row[f"{name}_ms"] = [t * 1e3 for t in times[name]]
                row[f"{name}_ms_median"] = statistics.median(times[name]) * 1e3
            for name in ("sdpa", "matmul"):
                ratios = [a / b for a, b in zip(times[name], times["default"], strict=True)]
                row[f"{name}_over_default"] = statistics.median(ratios)
            rows.append(row)
            bar.update(1)
    report = envelope(SCHEMA, "bench_attention", argv)
    report.update(
        config={k: v for k, v in vars(args).items() if k not in ("output_dir", "no_plots", "no_progress")},
        default_backend=default_name,
        threads=torch.get_num_threads(),
        results=rows,
    )
    return report


def markdown(report: dict[str, Any]) -> str:
    rows = [
        [
            str(r["sequences"]),
            str(r["context"]),
            str(r["queries"]),
            fmt(r["sdpa_ms_median"], 1),
            fmt(r["matmul_ms_median"], 1),
            fmt(r["default_ms_median"], 1),
            fmt(r["sdpa_over_default"], 2, "x"),
            fmt(r["matmul_over_default"], 2, "x"),
        ]
        for r in report["results"]
    ]
    header = [
        "sequences",
        "context",
        "new tokens each",
        "SDPA ms",
        "matmul ms",
        "default ms",
        "SDPA / default",
        "matmul / default",
    ]
    spread_note = (
        f" Contexts spread from {1 - report['config']['context_spread']:.2f}x the column's up to it."
        if report["config"]["context_spread"]
        else ""
    )
    lines = [
        "# attention backends",
        "",
        f"`{report['command']}`",
        "",
        f"Whole forward of {report['config']['model_path'] or 'the embedded SmolLM2-135M'}"
        f" ({report['config']['quantization_encoding']}, {report['threads']} threads, in the"
        f" {report['config']['thread']} thread), median of"
        f" {report['config']['repeats']} per arm; ratios are medians of paired ratios. Default backend:"
        f" `{report['default_backend']}`.{spread_note}",
        "",
        md_table(header, rows),
    ]
    return markdown_document(lines, report)


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    results = report["results"]
    return save_ratio_bars(
        [f"{r['sequences']}x{r['queries']} @{r['context']}" for r in results],
        [r["matmul_over_default"] for r in results],
        out_dir / f"{KIND}.png",
        "matmul forward time / default forward time",
        "sequences x new tokens @ cached context",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    report = run(args, argv)
    write_report(report, output_dir(args, KIND), KIND, markdown, plot, plots=not args.no_plots)
    print_report(report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
