"""Batch-invariant numerics: is greedy speculation token-identical to plain decoding, is plain decoding
independent of concurrency, and what does it cost? Side by side in one run.

Two engines on the same weights, one with batch-invariant attention (the default) and one with torch
SDPA (`--no-batch-invariant`); each decodes every prompt plainly and with speculation (toggled per
request), one request at a time and all at once. Arms are interleaved and rotated per round; speeds
are reported as paired ratios invariant / SDPA.

    python -m specserve.benchmarks.bench_batch_invariance --per-category 2 --max-tokens 96
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from specserve.engine import LLM, SamplingParams

from . import stats as st
from .common import md_table, progress
from .harness import Arm, add_output_args, envelope, output_dir, print_report, rounds, write_report
from .prompt_sets import CATEGORIES, load_prompts, parse_categories

SCHEMA = "specserve.bench.batch_invariance/1"
KIND = "batch_invariance"
BACKENDS = ("invariant", "sdpa")
MODES = ("plain", "spec")


@dataclass(frozen=True)
class Setup:
    backend: str  # "invariant" or "sdpa"
    mode: str  # "plain" or "spec"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_batch_invariance", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="target (default: the embedded SmolLM2-135M)")
    p.add_argument("--draft-model-path", default=None, help="speculate with this draft (default: n-gram)")
    p.add_argument("--quantization-encoding", default="bfloat16")
    p.add_argument("--draft-quantization-encoding", default=None)
    p.add_argument("--categories", default=None, help=f"comma list of {', '.join(CATEGORIES)} (default all)")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8, help="the 'all at once' level (besides 1)")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    add_output_args(p, KIND)
    return p


def load_engines(args: argparse.Namespace) -> dict[str, LLM]:
    common: dict[str, Any] = {
        "quantization_encoding": args.quantization_encoding,
        "speculative_method": "draft_model" if args.draft_model_path else "ngram",
        "max_batch_size": max(args.concurrency, 1),
    }
    if args.draft_model_path:
        common["draft_model_path"] = args.draft_model_path
        common["draft_quantization_encoding"] = args.draft_quantization_encoding
    if args.num_speculative_tokens is not None:
        common["num_speculative_tokens"] = args.num_speculative_tokens
    return {b: LLM(args.model_path, batch_invariant=b == "invariant", **common) for b in BACKENDS}


def measure(llm: LLM, prompts: list[list[int]], mode: str, concurrency: int, max_tokens: int) -> dict:
    """Decode every prompt (greedy, EOS ignored) `concurrency` at a time; tokens and decode speed."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, speculative_enabled=mode == "spec"
    )
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outs = llm.generate(prompts[i : i + concurrency], params, use_chat_template=False)
        tokens += [o.token_ids for o in outs]
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "tok_s": sum(map(len, tokens)) / elapsed, "seconds": elapsed}


def identical(a: list[list[int]], b: list[list[int]]) -> dict:
    same = [x == y for x, y in zip(a, b, strict=True)]
    first = [
        next((i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), None)
        for x, y in zip(a, b, strict=True)
    ]
    return {"identical": sum(same), "of": len(same), "first_difference": [f for f in first if f is not None]}


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    engines = load_engines(args)
    tokenizer = engines["invariant"].tokenizer
    prompt_set = load_prompts(parse_categories(args.categories), args.per_category)
    prompts = [tokenizer.apply_chat_template(p.messages) for p in prompt_set]
    arms = [Arm(f"{b}:{m}", Setup(b, m)) for b in BACKENDS for m in MODES]
    levels = [1, args.concurrency]
    results: list[dict] = []
    schedule = list(rounds(arms, levels, args.repeats))
    with progress(len(schedule) * len(arms), "batch invariance", args.no_progress) as bar:
        for rnd in schedule:
            for arm in rnd.arms:
                m = measure(engines[arm.runner.backend], prompts, arm.runner.mode, rnd.item, args.max_tokens)
                results.append({"arm": arm.name, "concurrency": rnd.item, "repeat": rnd.repeat, **m})
                bar.update(1)
    return summarize(args, argv, results, levels)


def summarize(args: argparse.Namespace, argv: list[str], results: list[dict], levels: list[int]) -> dict:
    def tokens(arm: str, level: int) -> list[list[int]]:
        return next(r["tokens"] for r in results if r["arm"] == arm and r["concurrency"] == level)

    top = levels[-1]
    exactness = {
        b: {
            "spec_vs_plain_c1": identical(tokens(f"{b}:spec", 1), tokens(f"{b}:plain", 1)),
            f"plain_c{top}_vs_c1": identical(tokens(f"{b}:plain", top), tokens(f"{b}:plain", 1)),
            f"spec_c{top}_vs_plain_c1": identical(tokens(f"{b}:spec", top), tokens(f"{b}:plain", 1)),
        }
        for b in BACKENDS
    }
    speed = []
    for mode in MODES:
        for level in levels:
            rows = [r for r in results if r["concurrency"] == level]
            inv = {r["repeat"]: r["tok_s"] for r in rows if r["arm"] == f"invariant:{mode}"}
            sdpa = {r["repeat"]: r["tok_s"] for r in rows if r["arm"] == f"sdpa:{mode}"}
            ratio = st.compare(inv, sdpa)
            speed.append(
                {
                    "mode": mode,
                    "concurrency": level,
                    "invariant_tok_s": st.median(inv.values()),
                    "sdpa_tok_s": st.median(sdpa.values()),
                    "invariant_over_sdpa": ratio.median,
                    "pairs": ratio.ratios,
                }
            )
    report = envelope(SCHEMA, "bench_batch_invariance", argv)
    report.update(
        config={k: v for k, v in vars(args).items() if k not in ("output_dir", "no_plots", "no_progress")},
        exactness=exactness,
        speed=speed,
        runs=[{k: v for k, v in r.items() if k != "tokens"} for r in results],
    )
    return report


def markdown(report: dict) -> str:
    lines = ["# Batch-invariant numerics", "", "## Token-identical outputs (greedy)", ""]
    rows = []
    for backend, checks in report["exactness"].items():
        for name, c in checks.items():
            rows.append([backend, name, f"{c['identical']}/{c['of']}", str(c["first_difference"][:6])])
    lines += [md_table(["attention", "comparison", "identical", "first differing token"], rows)]
    lines += ["", "## Decode speed (median tok/s; ratio = median of paired ratios)", ""]
    rows = [
        [
            s["mode"],
            str(s["concurrency"]),
            f"{s['invariant_tok_s']:.1f}",
            f"{s['sdpa_tok_s']:.1f}",
            f"{s['invariant_over_sdpa']:.3f}",
        ]
        for s in report["speed"]
    ]
    lines += [md_table(["mode", "concurrency", "invariant tok/s", "SDPA tok/s", "invariant / SDPA"], rows)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    report = run(args, argv)
    write_report(report, output_dir(args, KIND), KIND, markdown, lambda r, d: [], plots=False)
    print_report(report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
