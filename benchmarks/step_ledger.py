"""Where each speculation mode's time goes at a fixed concurrency: every engine step, added up by kind.

In-process (no HTTP): one engine, closed-loop cells of `--requests` requests kept `--concurrency` at a
time, one cell per mode (speculation off, static K, adaptive: per-request settings on the same engine),
the mode order rotating from round to round as in `bench serve`. Each step is a `StepRecord` from the
engine; a cell's steps are put in kinds (prefill: the step ran a prefill chunk; probe: its only drafts
were the controller's probes; drafting; plain), and per kind the report gives steps, seconds (draft /
forward), emitted tokens and tokens per second, and, for the adaptive controller's drafting steps, what it
expected against what they did. A mode that loses to speculation off shows here whether it lost in the
steps that drafted, in catch-ups, in probes or in prefill and plain steps that ran slower (the machine).

    specserve bench ledger --concurrency 2 --requests 8 --max-tokens 48 \\
        --model-path Qwen/Qwen2.5-Coder-1.5B-Instruct --draft-model-path Qwen/Qwen2.5-Coder-0.5B-Instruct \\
        --draft-quantization-encoding int4
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .common import fmt, md_table, progress
from .harness import (
    Arm,
    add_output_args,
    envelope,
    markdown_document,
    output_dir,
    print_report,
    pyplot,
    rounds,
    save_figure,
    write_report,
)
from .prompt_sets import load_prompts, parse_categories

SCHEMA = "specserve.bench.step_ledger/1"
KIND = "step_ledger"
KINDS = ("prefill", "plain", "drafting", "probe")
# A step whose proposers fed at least this many catch-up tokens per drafting request is a catch-up
# (the controller's SETUP_MIN_TOKENS): its drafting steps are counted apart from the others.
CATCH_UP_TOKENS = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench ledger", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="target (default: the embedded SmolLM2-135M)")
    p.add_argument("--draft-model-path", default=None, help="draft model (default: n-gram lookup)")
    p.add_argument("--speculative-method", default=None, help="default: the engine's auto")
    p.add_argument("--quantization-encoding", default="bfloat16")
    p.add_argument("--draft-quantization-encoding", default=None)
    p.add_argument("--modes", default="off,adaptive", help="comma list of off, static, adaptive")
    p.add_argument("--static-k", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--requests", type=int, default=8, help="requests per cell")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--categories", default=None, help="prompt categories (default all)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--max-kv-cache-tokens", type=int, default=65536)
    p.add_argument(
        "--admit-per-step",
        type=int,
        default=0,
        help="add at most this many requests per engine step, as requests arriving over HTTP one by one"
        " are (0: every free slot at once)",
    )
    add_output_args(p, KIND)
    return p


def _arms(modes: list[str], static_k: int) -> list[Arm[dict[str, Any]]]:
    settings = {
        "off": {"speculative_enabled": False},
        "static": {"speculative_policy": "static", "num_speculative_tokens": static_k},
        "adaptive": {"speculative_policy": "adaptive"},
    }
    unknown = [m for m in modes if m not in settings]
    if unknown or not modes:
        raise SystemExit(
            f"specserve bench ledger: --modes takes off, static, adaptive (got {','.join(modes) or 'none'})"
        )
    return [Arm(m, settings[m]) for m in modes]


def _engine(args: argparse.Namespace) -> Any:
    from specserve.engine import LLM

    kwargs: dict[str, Any] = {
        "quantization_encoding": args.quantization_encoding,
        "max_length": args.max_length,
        "max_kv_cache_tokens": args.max_kv_cache_tokens,
    }
    if args.draft_model_path:
        kwargs["draft_model_path"] = args.draft_model_path
        kwargs["draft_quantization_encoding"] = args.draft_quantization_encoding or args.quantization_encoding
    if args.speculative_method:
        kwargs["speculative_method"] = args.speculative_method
    return LLM(args.model_path, **kwargs)


def step_kind(step: Any) -> str:
    if step.prefill_tokens:
        return "prefill"
    if not step.drafting:
        return "plain"
    return "probe" if step.probes == step.drafting else "drafting"


def run_cell(
    llm: Any,
    prompts: list[list[int]],
    runner: dict[str, Any],
    concurrency: int,
    requests: int,
    max_tokens: int,
    admit_per_step: int = 0,
) -> dict[str, Any]:
    """Keep `concurrency` requests of one mode in flight until `requests` finished: wall time, tokens,
    and every step the engine ran meanwhile. With `admit_per_step`, at most that many are added before
    each step: served, prompts arrive one by one and each is prefilled next to the others' decodes (on
    the AVX-512 EPYC the Qwen pair at 8 clients lost 7% served and was level here with all 8 prompts
    admitted at once)."""
    from specserve.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **runner)
    engine.stats.drain_events()
    live: set[str] = set()
    issued = tokens = 0
    start = time.perf_counter()
    while issued < requests or live:
        admitted = 0
        while (
            len(live) < concurrency
            and issued < requests
            and (not admit_per_step or admitted < admit_per_step)
        ):
            request = engine.make_request(prompts[issued % len(prompts)], params)
            engine.add_request(request)
            live.add(request.request_id)
            issued += 1
            admitted += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                live.discard(out.request_id)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "steps": engine.stats.drain_events().steps}


def ledger(steps: list[Any]) -> dict[str, dict[str, float]]:
    """Per kind of step: count, seconds (all, proposer, target forward), emitted tokens, tokens/s; and
    the drafting steps without a catch-up apart (`drafting_no_catch_up`), with the controller's
    expectation of them."""
    rows: dict[str, dict[str, float]] = {}

    def add(kind: str, s: Any) -> None:
        r = rows.setdefault(kind, dict.fromkeys(("steps", "seconds", "draft_s", "forward_s", "tokens"), 0.0))
        r["steps"] += 1
        r["seconds"] += s.step_seconds
        r["draft_s"] += s.draft_seconds
        r["forward_s"] += s.forward_seconds
        r["tokens"] += s.emitted_tokens
        if s.predicted_tokens is not None and s.predicted_seconds is not None:
            r["predicted_tokens"] = r.get("predicted_tokens", 0.0) + s.predicted_tokens
            r["predicted_seconds"] = r.get("predicted_seconds", 0.0) + s.predicted_seconds

    for s in steps:
        kind = step_kind(s)
        add(kind, s)
        if kind == "drafting" and s.setup_tokens < CATCH_UP_TOKENS * s.drafting:
            add("drafting_no_catch_up", s)
    for r in rows.values():
        r["tok_s"] = r["tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0
    return rows


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        raise SystemExit(
            "specserve bench ledger: --concurrency, --requests and --max-tokens must be positive"
        )
    if args.admit_per_step < 0:
        raise SystemExit("specserve bench ledger: --admit-per-step must be 0 (all at once) or positive")
    arms = _arms([m.strip() for m in args.modes.split(",") if m.strip()], args.static_k)
    llm = _engine(args)
    prompt_set = load_prompts(parse_categories(args.categories))
    prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in prompt_set]
    for arm in arms:  # warm-up: kernels, caches, the controller's first calibration
        run_cell(llm, prompts[:1], arm.runner, concurrency=1, requests=1, max_tokens=8)
    cells = []
    schedule = list(rounds(arms, [args.concurrency], args.repeats, repeats_outer=False))
    with progress(len(schedule) * len(arms), "step ledger", args.no_progress) as bar:
        for rnd in schedule:
            for arm in rnd.arms:
                cell = run_cell(
                    llm,
                    prompts,
                    arm.runner,
                    args.concurrency,
                    args.requests,
                    args.max_tokens,
                    args.admit_per_step,
                )
                cells.append(
                    {
                        "mode": arm.name,
                        "repeat": rnd.repeat,
                        "seconds": cell["seconds"],
                        "tokens": cell["tokens"],
                        "tok_s": cell["tokens"] / cell["seconds"],
                        "ledger": ledger(cell["steps"]),
                    }
                )
                bar.update(1)
    report = envelope(SCHEMA, "ledger", argv)
    report["config"] = {**vars(args), "method": llm.engine.proposer_name}
    report["cells"] = cells
    report["summary"] = summarize(cells)
    return report


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Each mode's tokens/s against speculation off's in the same repeat (the median of the ratios)."""
    import statistics

    off = {c["repeat"]: c["tok_s"] for c in cells if c["mode"] == "off"}
    ratios: dict[str, list[float]] = {}
    for c in cells:
        if c["mode"] != "off" and c["repeat"] in off:
            ratios.setdefault(c["mode"], []).append(c["tok_s"] / off[c["repeat"]])
    return {"vs_off": {m: statistics.median(r) for m, r in ratios.items()}}


def kind_rows(cells: list[dict[str, Any]]) -> list[list[str]]:
    """One table row per cell and kind of step (KIND_HEADER): its steps, time, tokens, and for
    drafting steps what the controller expected of them."""
    rows = []
    for c in cells:
        for kind in (*KINDS, "drafting_no_catch_up"):
            r = c["ledger"].get(kind)
            if r is None:
                continue
            expected = ""
            if kind.startswith("drafting") and r.get("predicted_seconds"):
                expected = f"{r['predicted_tokens']:.0f} tok in {r['predicted_seconds']:.1f} s"
            rows.append(
                [
                    f"{c['mode']} (r{c['repeat']})",
                    kind,
                    f"{r['steps']:.0f}",
                    fmt(r["seconds"], 1),
                    fmt(r["draft_s"], 1),
                    fmt(r["forward_s"], 1),
                    f"{r['tokens']:.0f}",
                    fmt(r["tok_s"], 2),
                    expected,
                ]
            )
    return rows


KIND_HEADER = ["cell", "steps", "n", "s", "draft s", "forward s", "tokens", "tok/s", "controller expected"]


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    cells = [
        [f"{c['mode']} (r{c['repeat']})", fmt(c["seconds"], 1), f"{c['tokens']}", fmt(c["tok_s"], 2)]
        for c in report["cells"]
    ]
    vs_off = ", ".join(f"{m} {fmt(v, 2, 'x')}" for m, v in report["summary"]["vs_off"].items())
    lines = [
        "# step ledger",
        "",
        f"`{report['command']}`",
        "",
        f"Method {cfg['method']}, {cfg['concurrency']} concurrent requests, {cfg['requests']} per cell,"
        f" {cfg['max_tokens']} tokens (greedy, EOS ignored), {cfg['repeats']} repeat(s)"
        + (f", at most {cfg['admit_per_step']} admitted per step" if cfg.get("admit_per_step") else "")
        + ". Against off"
        f" (median of paired repeats): {vs_off or 'no off arm'}.",
        "",
        md_table(["cell", "seconds", "tokens", "tok/s"], cells),
        "",
        md_table(KIND_HEADER, kind_rows(report["cells"])),
        "",
    ]
    return markdown_document(lines, report)


def plot(report: dict[str, Any], out_dir: Any, name: str = "step_ledger.png") -> list[str]:
    """Seconds per kind of step, stacked, one bar per cell, with the cell's tokens/s over it."""
    plt = pyplot()
    if plt is None:
        return []
    cells = report["cells"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(cells)), 3.5))
    xs = range(len(cells))
    bottom = [0.0] * len(cells)
    for kind in KINDS:
        heights = [c["ledger"].get(kind, {}).get("seconds", 0.0) for c in cells]
        ax.bar(xs, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, c, top in zip(xs, cells, bottom, strict=True):
        ax.text(x, top, f"{c['tok_s']:.2f} tok/s", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.15 * max(bottom, default=1.0))  # room for the labels
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{c['mode']} r{c['repeat']}" for c in cells], fontsize=7)
    ax.set_ylabel("seconds", fontsize=8)
    ax.set_title("where each cell's time went", fontsize=9)
    ax.legend(fontsize=7)
    return [save_figure(plt, fig, out_dir / name)]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    report = run(args, argv)
    write_report(report, output_dir(args, KIND), KIND, markdown, plot, plots=not args.no_plots)
    print_report(report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
