"""The human side of a `bench serve` report: serve.md and serve.png, drawn from the report dict alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import fmt, md_table
from .harness import markdown_document, pyplot, save_figure

Report = dict[str, Any]
CELL_HEADER = [
    "concurrency",
    "spec",
    "req/s",
    "out tok/s",
    "TTFT p50/p90/p99 s",
    "ITL p50/p90/p99 s",
    "TPOT p50 s",
    "E2E p50 s",
    "accept rate",
    "mean accept len",
    "failed",
]


def markdown(report: Report) -> str:
    lines = _intro(report)
    lines += [
        md_table(CELL_HEADER, [_cell_row(cell, report["config"]["repeats"]) for cell in report["cells"]]),
        "",
    ]
    modes = report["config"]["modes"]
    if "off" in modes and len(modes) > 1:
        lines += _vs_off(report["summary"], modes)
        lines += _scaling(report["summary"], modes)
    return markdown_document(lines, report)


def _intro(report: Report) -> list[str]:
    cfg, mach = report["config"], report["machine"]
    launched = report["server"].get("launched_with")
    return [
        "# specserve bench serve",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {mach.get('cpu_model')}, {mach.get('cpu_count')} CPUs, {mach.get('memory_gib')} GiB; "
        f"{report['created']}. Server: {report['server']['base_url']}"
        + (f" launched with `{' '.join(launched)}`" if launched else "")
        + ".",
        "",
        f"Streaming chat completions, greedy, {_lengths(cfg)} output tokens (EOS ignored), requests per "
        f"cell {cfg['requests_per_level']}, {cfg['repeats']} repeat(s); speculation toggled per request on one "
        "server. ITL = gap between streamed chunks (a chunk may carry several accepted tokens); "
        "TPOT = (E2E - TTFT) / (tokens - 1).",
        "",
    ]


def _lengths(cfg: dict[str, Any]) -> str:
    low, high = cfg.get("max_tokens_range") or (cfg["max_tokens"], cfg["max_tokens"])
    if low == high:
        return str(low)
    return f"{low}-{high} (uniform per request, the same lengths in every mode)"


def _cell_row(cell: dict[str, Any], repeats: int) -> list[str]:
    def trio(d: dict[str, float | None]) -> str:
        return "/".join(fmt(d.get(k), 3) for k in ("p50", "p90", "p99"))

    return [
        str(cell["concurrency"]) + (f" (r{cell['repeat']})" if repeats > 1 else ""),
        cell["mode"],
        fmt(cell["requests_per_s"], 3),
        fmt(cell["output_tokens_per_s"]),
        trio(cell["ttft_s"]),
        trio(cell["itl_s"]),
        fmt(cell["tpot_s"]["p50"], 3),
        fmt(cell["e2e_s"]["p50"], 2),
        fmt(cell["acceptance_rate"]),
        fmt(cell["mean_acceptance_length"]),
        str(cell["failed"]),
    ]


def ratio_key(mode: str) -> str:
    """The summary key of a mode's paired speed ratio against speculation off."""
    return "spec_speedup_output_tokens_per_s" if mode == "on" else f"{mode}_vs_off"


def _vs_off(summary: list[dict[str, Any]], modes: list[str]) -> list[str]:
    others = [m for m in modes if m != "off"]
    rows = [
        [
            str(s["concurrency"]),
            *(fmt(s[m]["output_tokens_per_s"]) for m in modes),
            *(fmt(s.get(ratio_key(m)), 2, "x") for m in others),
            *(fmt(s[m].get("mean_k"), 2) for m in others),
        ]
        for s in summary
    ]
    header = [
        "concurrency",
        *(f"{m} tok/s" for m in modes),
        *(f"{m} / off" for m in others),
        *(f"mean k {m}" for m in others),
    ]
    return [
        "Each mode against speculation off (output tokens/s; ratios are medians of paired repeats;"
        " mean k = drafts allowed per decode step, per request, median):",
        "",
        md_table(header, rows),
        "",
    ]


def _scaling(summary: list[dict[str, Any]], modes: list[str]) -> list[str]:
    """Total output tokens/s against concurrency 1 (only when the sweep starts there)."""
    base = summary[0]
    if base["concurrency"] != 1:
        return []
    rows = [
        [
            str(s["concurrency"]),
            *(
                fmt((s[m]["output_tokens_per_s"] or 0) / base[m]["output_tokens_per_s"], 2, "x")
                if base[m]["output_tokens_per_s"]
                else "–"
                for m in modes
            ),
        ]
        for s in summary
    ]
    return [
        "Total output tokens/s relative to concurrency 1:",
        "",
        md_table(["concurrency", *(f"spec {m}" for m in modes)], rows),
        "",
    ]


MODE_COLORS = {"off": "tab:blue", "on": "tab:orange", "static": "tab:red", "adaptive": "tab:green"}


def plot(report: Report, out_dir: Path) -> list[str]:
    """Three panels against concurrency: output tokens/s, ITL (with TPOT dashed) and TTFT, per mode."""
    plt = pyplot()
    if plt is None:
        return []
    summ = report["summary"]
    xs = [s["concurrency"] for s in summ]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    panels = [
        ("output_tokens_per_s", "output tokens/s", 1.0),
        ("itl_p50_s", "ITL p50 (ms)", 1000.0),
        ("ttft_p50_s", "TTFT p50 (ms)", 1000.0),
    ]
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for mode in report["config"]["modes"]:
            color = MODE_COLORS.get(mode, "tab:gray")
            ax.plot(
                xs, [(s[mode][key] or 0) * scale for s in summ], marker="o", color=color, label=f"spec {mode}"
            )
            if key == "itl_p50_s":
                ys = [(s[mode]["tpot_p50_s"] or 0) * scale for s in summ]
                ax.plot(xs, ys, marker="x", color=color, linestyle="--", label=f"TPOT p50 spec {mode}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("concurrency", fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
    return [save_figure(plt, fig, out_dir / "serve.png")]
