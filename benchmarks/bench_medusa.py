"""Batch 1, greedy: Medusa and EAGLE heads (from `specserve train-draft`) against n-gram lookup, a draft model and plain.

One engine per arm (the proposer is an engine setting), all on the same target; every round runs each
arm once on one prompt, rotated, so slow drifts of a shared machine hit every arm alike. Reports decode
speed (tokens after the first / time after the first), ratios against plain and medusa / ngram (paired
per prompt and repeat), per-position acceptance, and the proposal cost: proposer seconds per drafting
step against a plain decode step.

    python -m specserve.benchmarks.bench_medusa --medusa-heads-path DIR --categories multi_turn,qa
    python -m specserve.benchmarks.bench_medusa --eagle-head-path DIR --arms plain,ngram,eagle,eagle-static
    python -m specserve.benchmarks.bench_medusa --model-path T --eagle-head-path DIR \
        --draft-model-path D --arms plain,eagle-static,draft-static   # draft in int4 by default
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import stats as st
from .common import fmt, md_table, progress
from .harness import (
    add_output_args,
    envelope,
    markdown_document,
    output_dir,
    print_report,
    rounds,
    write_report,
)
from .prompt_sets import load_prompts, parse_categories

SCHEMA = "specserve.bench.medusa/1"
KIND = "medusa"
# arm -> engine settings; "{heads}" / "{eagle}" / "{draft}" are replaced by --medusa-heads-path /
# --eagle-head-path / --draft-model-path (the draft model runs in --draft-quantization-encoding)
ARMS: dict[str, dict[str, Any]] = {
    "plain": {"speculative_method": "none"},
    "ngram": {"speculative_method": "ngram"},
    "ngram-static": {"speculative_method": "ngram", "speculative_policy": "static"},
    "medusa": {"speculative_method": "medusa", "medusa_heads_path": "{heads}"},
    "medusa-static": {
        "speculative_method": "medusa",
        "medusa_heads_path": "{heads}",
        "speculative_policy": "static",
    },
    "eagle": {"speculative_method": "eagle", "speculative_head_path": "{eagle}"},
    "eagle-static": {
        "speculative_method": "eagle",
        "speculative_head_path": "{eagle}",
        "speculative_policy": "static",
    },
    "draft": {"speculative_method": "draft_model", "draft_model_path": "{draft}"},
    "draft-static": {
        "speculative_method": "draft_model",
        "draft_model_path": "{draft}",
        "speculative_policy": "static",
    },
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_medusa", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="target (default: the embedded SmolLM2-135M)")
    p.add_argument("--medusa-heads-path", default=None, help="Medusa heads (train-draft --method medusa)")
    p.add_argument("--eagle-head-path", default=None, help="an EAGLE head (train-draft --method eagle)")
    p.add_argument("--draft-model-path", default=None, help="a draft model, for the draft arms")
    p.add_argument("--quantization-encoding", default="bfloat16")
    p.add_argument("--draft-quantization-encoding", default="int4", help="the draft model's (default: int4)")
    p.add_argument("--arms", default="plain,ngram,medusa,ngram-static,medusa-static", help=", ".join(ARMS))
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: the engine's)")
    p.add_argument("--categories", default="multi_turn,qa")
    p.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    add_output_args(p, KIND)
    return p


def _engine(args: argparse.Namespace, arm: str) -> Any:
    from specserve.engine import LLM

    paths = {
        "{heads}": args.medusa_heads_path,
        "{eagle}": args.eagle_head_path,
        "{draft}": args.draft_model_path,
    }
    settings = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in ARMS[arm].items()}
    if "draft_model_path" in settings:
        settings["draft_quantization_encoding"] = args.draft_quantization_encoding
    if args.num_speculative_tokens is not None and arm != "plain":
        settings["num_speculative_tokens"] = args.num_speculative_tokens
    return LLM(
        args.model_path,
        quantization_encoding=args.quantization_encoding,
        max_length=args.max_length,
        max_kv_cache_tokens=2 * args.max_length,
        max_batch_size=1,
        **settings,
    )


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from specserve.engine import SamplingParams

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or "plain" not in arms:
        raise SystemExit(f"bench_medusa: --arms needs plain and names from {', '.join(ARMS)}; got {unknown}")
    for prefix, path, flag in (
        ("medusa", args.medusa_heads_path, "--medusa-heads-path"),
        ("eagle", args.eagle_head_path, "--eagle-head-path"),
        ("draft", args.draft_model_path, "--draft-model-path"),
    ):
        if path is None and any(a.startswith(prefix) for a in arms):
            raise SystemExit(f"bench_medusa: the {prefix} arms need {flag}")
    engines = {arm: _engine(args, arm) for arm in arms}
    prompt_set = load_prompts(parse_categories(args.categories), args.per_category)
    tokenizer = engines["plain"].tokenizer
    prompts = [tokenizer.apply_chat_template(p.messages) for p in prompt_set]
    for llm in engines.values():  # warm-up: kernels, caches, the controller's first calibration
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0), use_chat_template=False)
    results: list[dict[str, Any]] = []
    schedule = list(rounds(arms, list(range(len(prompts))), args.repeats))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with progress(len(schedule) * len(arms), "bench medusa", args.no_progress) as bar:
        for rnd in schedule:
            for arm in rnd.arms:
                results.append(
                    _measure(engines[arm], arm, prompts[rnd.item], params)
                    | {
                        "prompt": prompt_set[rnd.item].id,
                        "category": prompt_set[rnd.item].category,
                        "repeat": rnd.repeat,
                    }
                )
                bar.update(1)
    report = envelope(SCHEMA, "bench_medusa", argv)
    report["config"] = {**vars(args), "arms": arms}
    report["summary"] = summarize(results, arms)
    report["results"] = results
    return report


def _measure(llm: Any, arm: str, prompt: list[int], params: Any) -> dict[str, Any]:
    spec = llm.engine.stats.spec
    before = (spec.draft_seconds, spec.verify_seconds, spec.num_drafts)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_chat_template=False)[0]
    seconds = time.perf_counter() - start
    draft_s, verify_s, drafts = (
        spec.draft_seconds - before[0],
        spec.verify_seconds - before[1],
        spec.num_drafts - before[2],
    )
    decode_s = seconds - (out.first_token_s or 0.0)
    s = out.spec
    return {
        "arm": arm,
        "tokens": list(out.token_ids),
        "seconds": seconds,
        "decode_tok_s": (len(out.token_ids) - 1) / decode_s if decode_s > 0 else None,
        "ms_per_token": 1000 * decode_s / max(1, len(out.token_ids) - 1),
        "num_drafts": s.num_drafts,
        "mean_k": s.mean_k,
        "acceptance_rate": s.acceptance_rate if s.num_draft_tokens else None,
        "mean_acceptance_length": s.mean_acceptance_length if s.num_drafts else None,
        "per_position_acceptance": s.per_position_acceptance(),
        "draft_ms_per_round": 1000 * draft_s / drafts if drafts else None,
        "verify_ms_per_round": 1000 * verify_s / drafts if drafts else None,
    }


def summarize(results: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    def speed(arm: str, rows: list[dict[str, Any]]) -> dict[Any, float]:
        return {(r["prompt"], r["repeat"]): r["decode_tok_s"] for r in rows if r["arm"] == arm}

    def block(rows: list[dict[str, Any]]) -> dict[str, Any]:
        plain = speed("plain", rows)
        plain_ms = st.median(r["ms_per_token"] for r in rows if r["arm"] == "plain")
        out: dict[str, Any] = {}
        for arm in arms:
            mine = [r for r in rows if r["arm"] == arm]
            draft_ms = st.median(r["draft_ms_per_round"] for r in mine)
            out[arm] = {
                "decode_tok_s": st.median(r["decode_tok_s"] for r in mine),
                "vs_plain": st.compare(speed(arm, rows), plain).median,
                "vs_ngram": st.compare(speed(arm, rows), speed("ngram", rows)).median
                if "ngram" in arms
                else None,
                "acceptance_rate": st.median(r["acceptance_rate"] for r in mine),
                "mean_acceptance_length": st.median(r["mean_acceptance_length"] for r in mine),
                "per_position_acceptance": _mean_lists([r["per_position_acceptance"] for r in mine]),
                "mean_k": st.median(r["mean_k"] for r in mine),
                "draft_ms_per_round": draft_ms,
                "draft_cost_vs_plain_step": draft_ms / plain_ms if draft_ms and plain_ms else None,
                "same_tokens_as_plain": all(
                    r["tokens"]
                    == next(o["tokens"] for o in rows if o["arm"] == "plain" and o["prompt"] == r["prompt"])
                    for r in mine
                ),
            }
        return out

    categories = list(dict.fromkeys(r["category"] for r in results))
    return {
        "all": block(results),
        "per_category": {c: block([r for r in results if r["category"] == c]) for c in categories},
    }


def _mean_lists(lists: list[list[float]]) -> list[float]:
    width = max((len(x) for x in lists), default=0)
    return [st.mean(x[i] for x in lists if len(x) > i) or 0.0 for i in range(width)]


def markdown(report: dict[str, Any]) -> str:
    cfg, summ = report["config"], report["summary"]
    header = ["scope", "arm", "decode tok/s", "vs plain", "vs ngram", "acceptance", "mean length"]
    header += ["per-position acceptance", "mean k", "draft ms / round", "draft / plain step", "same tokens"]
    rows = []
    for scope, block in [("all", summ["all"]), *summ["per_category"].items()]:
        for arm, a in block.items():
            rows.append(
                [
                    scope,
                    arm,
                    fmt(a["decode_tok_s"]),
                    fmt(a["vs_plain"], 2, "x"),
                    fmt(a["vs_ngram"], 2, "x"),
                    fmt(a["acceptance_rate"], 3),
                    fmt(a["mean_acceptance_length"], 2),
                    " ".join(f"{x:.2f}" for x in a["per_position_acceptance"]) or "–",
                    fmt(a["mean_k"], 2),
                    fmt(a["draft_ms_per_round"], 1),
                    fmt(a["draft_cost_vs_plain_step"], 2),
                    "yes" if a["same_tokens_as_plain"] else "NO",
                ]
            )
    lines = [
        "# bench medusa / eagle heads (batch 1, greedy)",
        "",
        f"`{report['command']}`",
        "",
        f"Medusa {cfg['medusa_heads_path']}, EAGLE {cfg.get('eagle_head_path')}, {cfg['quantization_encoding']} target, {cfg['max_tokens']} tokens,"
        f" EOS ignored, {cfg['repeats']} repeat(s), arms interleaved; ratios are paired medians.",
        "",
        md_table(header, rows),
        "",
    ]
    return markdown_document(lines, report)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run(args, argv)
    write_report(report, output_dir(args, KIND), KIND, markdown, lambda r, d: [], plots=False)
    print_report(report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
