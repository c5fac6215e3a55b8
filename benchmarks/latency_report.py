"""The human side of a `bench latency` report: latency.md and its plots, drawn from the report dict alone
(so a saved latency.json can be re-rendered)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import fmt, md_table
from .harness import markdown_document, pyplot, save_figure
from .runners import HF_PLAIN, SS_PLAIN

Report = dict[str, Any]


def markdown(report: Report) -> str:
    methods = [m["name"] for m in report["methods"]]
    lines = _intro(report)
    lines += [md_table(*_overall_table(report, methods)), ""]
    lines += _structured_table(report, methods)
    lines += _category_tables(report, methods)
    lines += _position_table(report, methods)
    lines += _throughput(report)
    lines += _notes(report)
    return markdown_document(lines, report)


def _intro(report: Report) -> list[str]:
    cfg, mach = report["config"], report["machine"]
    return [
        "# specserve bench latency",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {mach.get('cpu_model')}, {mach.get('cpu_count')} CPUs, torch threads {mach.get('torch_threads')}, "
        f"{mach.get('memory_gib')} GiB; torch {mach.get('torch')}, transformers {mach.get('transformers')}. "
        f"{report['created']}.",
        "",
        f"Model `{cfg['model_path'] or 'embedded default'}`"
        + (f", draft `{cfg['draft_model_path']}`" if cfg["draft_model_path"] else "")
        + f", {cfg['quantization_encoding']}, batch 1 greedy, {cfg['max_new_tokens']} new tokens"
        f" ({'EOS ignored' if cfg['ignore_eos'] else 'stop at EOS'}), K={cfg['num_speculative_tokens']},"
        f" {cfg['repeats']} interleaved repeats after {cfg['warmup']} warm-up; headline metric: {cfg['metric']} tokens/s;"
        " speedups are medians of per-(prompt, repeat) ratios."
        + _format_sentence(cfg.get("response_format", "text")),
        "",
    ]


def _format_sentence(response_format: str) -> str:
    if response_format == "text":
        return ""
    what = (
        "a JSON schema from prompts/json_schemas.json"
        if response_format == "json_schema"
        else "a JSON object"
    )
    return (
        f" Response format {response_format}: every prompt asks for {what} and is decoded under its grammar"
        " (a complete output ends the request, so runs may stop before the token limit)."
    )


def _baselines(methods: list[str]) -> list[str]:
    """The speedup_vs_<name> columns the summary has, specserve's first."""
    return [
        name for name, m in (("specserve_plain", SS_PLAIN), ("transformers_plain", HF_PLAIN)) if m in methods
    ]


def _overall_table(report: Report, methods: list[str]) -> tuple[list[str], list[list[str]]]:
    summ = report["summary"]
    bases = _baselines(methods)
    header = ["method", "tok/s", "decode tok/s", "TTFT s"]
    header += [f"vs {b.replace('_', ' ')}" for b in bases]
    header += [
        "accept rate",
        "mean accept len",
        "draft s / verify s",
        "greedy = plain",
        "= other engine's plain",
    ]
    rows = []
    for m in methods:
        o = summ[m]["overall"]
        sp = o["spec"]
        row = [
            f"`{m}`",
            fmt(o["median_tokens_per_s"]),
            fmt(o["median_decode_tokens_per_s"]),
            fmt(o["median_first_token_s"], 3),
        ]
        row += [fmt(o.get(f"speedup_vs_{b}"), 2, "x") for b in bases]
        row.append(fmt(sp["acceptance_rate"]) if sp else "–")
        # Without speculation stats, tokens per target forward stands in for the acceptance length.
        mal = sp["mean_acceptance_length"] if sp else o.get("tokens_per_target_step")
        row.append(fmt(mal) + ("" if sp or mal is None else " (tok/step)"))
        row.append(f"{fmt(o['draft_s'])} / {fmt(o['verify_s'])}" if o["draft_s"] is not None else "–")
        ident = o["greedy_identical_to_plain"]
        row.append(
            "–"
            if ident is None
            else ("yes" if ident else f"no ({fmt(o['identical_fraction'] * 100, 0)}% of runs)")
        )
        cross = o.get("identical_to_other_engine_plain_fraction")
        row.append("–" if cross is None else f"{fmt(cross * 100, 0)}% of runs")
        rows.append(row)
    return header, rows


def _structured_table(report: Report, methods: list[str]) -> list[str]:
    """Constrained runs: validity, forced tokens and the grammar matcher's share of the time."""
    summ = report["summary"]
    shown = [m for m in methods if summ[m]["overall"].get("structured")]
    if not shown:
        return []
    header = [
        "method",
        "tok/s",
        "vs specserve plain",
        "valid JSON",
        "hit length limit",
        "forced tok / output",
        "tokens / output",
        "accept rate",
        "grammar share of time",
        "grammar share of decode time",
    ]
    rows = []
    for m in shown:
        o = summ[m]["overall"]
        so, sp = o["structured"], o["spec"]
        valid = so["valid_fraction"]
        rows.append(
            [
                f"`{m}`",
                fmt(o["median_tokens_per_s"]),
                fmt(o.get("speedup_vs_specserve_plain"), 2, "x"),
                f"{fmt(valid * 100, 0)}% of {so['n']}" if valid is not None else "–",
                str(so["num_hit_length"]),
                fmt(so["forced_tokens_per_output"], 1),
                fmt(so["mean_generated_tokens"], 1),
                fmt(sp["acceptance_rate"]) if sp else "–",
                _percent(so["grammar_fraction"]),
                _percent(so.get("grammar_decode_fraction")),
            ]
        )
    return [
        f"Structured output ({report['config']['response_format']}): valid = parses and validates "
        "(an output cut by the token limit counts as invalid); grammar share = the matcher's time "
        "(masks, draft checks, commits) over the requests' total time, and over their time after the "
        "first token (decode).",
        "",
        md_table(header, rows),
        "",
    ]


def _percent(x: float | None) -> str:
    return "–" if x is None else fmt(x * 100, 1, "%")


def _categories(report: Report, methods: list[str]) -> list[str]:
    summ = report["summary"]
    return [c for c in report["config"]["categories"] if any(c in summ[m]["by_category"] for m in methods)]


def _category_tables(report: Report, methods: list[str]) -> list[str]:
    summ, cats = report["summary"], _categories(report, methods)

    def table(base: str) -> str:
        rows = [
            [f"`{m}`"]
            + [fmt(summ[m]["by_category"].get(c, {}).get(f"speedup_vs_{base}"), 2, "x") for c in cats]
            for m in methods
        ]
        return md_table(["method", *cats], rows)

    bases = _baselines(methods)
    if not bases:
        return []
    lines = [
        f"Speedup vs {bases[0].replace('_', ' ')} by category ({report['config']['metric']} tok/s):",
        "",
        table(bases[0]),
        "",
    ]
    if len(bases) == 2:
        lines += ["Speedup vs transformers plain by category:", "", table(bases[1]), ""]
    return lines


def _position_table(report: Report, methods: list[str]) -> list[str]:
    summ = report["summary"]
    rows = [
        [f"`{m}`", ", ".join(fmt(x) for x in summ[m]["overall"]["spec"]["per_position_acceptance"])]
        for m in methods
        if summ[m]["overall"]["spec"]
    ]
    if not rows:
        return []
    return [
        "Acceptance by draft position (fraction of verifications accepting position i):",
        "",
        md_table(["method", "positions 1..K"], rows),
        "",
    ]


def _throughput(report: Report) -> list[str]:
    tp = report.get("throughput")
    if not tp:
        return []
    return [
        f"Throughput: {tp['batch']} prompts submitted together to specserve:plain: "
        f"{fmt(tp['median_batch_tokens_per_s'])} tok/s total vs {fmt(tp['median_batch1_tokens_per_s'])} tok/s "
        f"at batch 1 = **{fmt(tp['ratio_vs_batch1'])}x** (median of per-repeat ratios).",
        "",
    ]


def _notes(report: Report) -> list[str]:
    notes = [f"- `{m['name']}`: {m['note']}" for m in report["methods"] if m.get("note")]
    notes += [f"- {k}: not run ({v})" for k, v in report.get("unavailable", {}).items()]
    return ["Notes:", "", *notes, ""] if notes else []


# --- plots -------------------------------------------------------------------------------------------------
def plot(report: Report, out_dir: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    methods = [m["name"] for m in report["methods"]]
    files = []
    if _baselines(methods):
        files.append(_plot_speedups(plt, report, methods, out_dir / "latency_speedup.png"))
    spec_methods = [m for m in methods if report["summary"][m]["overall"]["spec"]]
    if spec_methods:
        files.append(_plot_acceptance(plt, report, spec_methods, out_dir / "latency_acceptance.png"))
    return files


def _plot_speedups(plt: Any, report: Report, methods: list[str], path: Path) -> str:
    """One panel per baseline: every other method's speedup by category, grouped bars."""
    summ, cats, bases = report["summary"], _categories(report, methods), _baselines(methods)
    fig, axes = plt.subplots(len(bases), 1, figsize=(8, 2.6 * len(bases) + 0.6), squeeze=False)
    for ax, b in zip(axes[:, 0], bases, strict=True):
        shown = [m for m in methods if m != b.replace("_", ":")]
        width = 0.8 / max(1, len(shown))
        for i, m in enumerate(shown):
            vals = [summ[m]["by_category"].get(c, {}).get(f"speedup_vs_{b}") or 0 for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(cats))])
        ax.set_xticklabels(cats, fontsize=8)
        ax.set_ylabel(f"speedup vs\n{b.replace('_', ' ')}", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.legend(fontsize=7, ncol=3, loc="upper left")
    cfg = report["config"]
    fig.suptitle(
        f"{cfg['model_path'] or 'default model'} {cfg['quantization_encoding']}, batch 1 greedy, "
        f"{cfg['max_new_tokens']} tokens",
        fontsize=9,
    )
    return save_figure(plt, fig, path)


def _plot_acceptance(plt: Any, report: Report, methods: list[str], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 3))
    for m in methods:
        pp = report["summary"][m]["overall"]["spec"]["per_position_acceptance"]
        ax.plot(range(1, len(pp) + 1), pp, marker="o", label=m)
    ax.set_xlabel("draft position", fontsize=8)
    ax.set_ylabel("accepted fraction", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7)
    ax.set_title("acceptance by position", fontsize=9)
    return save_figure(plt, fig, path)
