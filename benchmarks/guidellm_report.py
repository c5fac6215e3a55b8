"""`specserve bench guidellm DIR`: what `benchmarks/guidellm_compare.sh` left in DIR, side by side.

The script runs guidellm (the vLLM project's load generator) against one server, level by level, once
with the server's default speculation and once with speculation off per request, and guidellm writes
one JSON report per run: `c<level>-<arm>.json`, or `c<level>-<arm>-r<repeat>.json` with REPEATS > 1.
This report reads them back and pairs each level's arms repeat by repeat (they ran back to back), so
the claim is the median of paired ratios of guidellm's own output tokens per second, as everywhere in
`bench`; guidellm's console tables stay next to its JSON for anyone who wants them. The report lists each
run's start and end as `cells`, as `bench serve` does, so a server's step log of the same runs is cut
into them by `bench steps --serve-report`.

    specserve serve --step-log steps.jsonl ... &
    benchmarks/guidellm_compare.sh                      # OUT=DIR, see its header
    specserve bench guidellm DIR --output-dir DIR
    specserve bench steps steps.jsonl --serve-report DIR/guidellm.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from . import harness
from .common import fmt, md_table
from .harness import (
    add_output_args,
    envelope,
    markdown_document,
    output_dir,
    print_report,
    save_ratio_bars,
    write_report,
)
from .stats import compare, geomean, median

SCHEMA = "specserve.bench.guidellm/1"
KIND = "guidellm"
ARMS = ("default", "off")  # the script's arm names: the server's speculation as it runs it, and off
RUN_HEADER = [
    "concurrency",
    "repeat",
    "arm",
    "requests ok",
    "failed",
    "s",
    "out tok/s",
    "TTFT p50 s",
    "ITL p50 s",
]
SUMMARY_HEADER = [
    "concurrency",
    "default tok/s",
    "off tok/s",
    "pairs",
    "default / off",
    "geomean",
    "ahead",
    "failed",
]
RUN_FILE = re.compile(r"^c(?P<level>\d+)-(?P<arm>[a-z]+)(?:-r(?P<repeat>\d+))?\.json$")


def fail(message: str) -> NoReturn:
    harness.fail("specserve bench guidellm", message)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve bench guidellm",
        description="guidellm runs of benchmarks/guidellm_compare.sh, default vs off, as paired ratios.",
    )
    p.add_argument("directory", help="the OUT directory the script wrote guidellm's JSON reports to")
    add_output_args(p, KIND)
    return p


def _metric(metrics: Mapping[str, Any], name: str, statistic: str) -> float | None:
    value = metrics.get(name, {}).get("successful", {}).get(statistic)
    return float(value) if isinstance(value, int | float) else None


def read_run(path: Path) -> dict[str, Any]:
    """One guidellm JSON report as a row: its level, arm and repeat (from the file name) and what it
    measured. guidellm writes one benchmark per strategy; the script runs one strategy per file."""
    match = RUN_FILE.match(path.name)
    if match is None:
        fail(f"{path.name}: not a file of guidellm_compare.sh (c<level>-<arm>[-r<repeat>].json)")
    try:
        data = json.loads(path.read_text())
        (bench,) = data["benchmarks"]
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{path}: not a guidellm report with one benchmark ({type(e).__name__}: {e})")
    ttft = _metric(metrics, "time_to_first_token_ms", "median")
    itl = _metric(metrics, "inter_token_latency_ms", "median")
    return {
        "level": int(match["level"]),
        "arm": match["arm"],
        "repeat": int(match["repeat"] or 0),
        "file": path.name,
        "successful": int(totals.get("successful", 0)),
        "errored": int(totals.get("errored", 0)),
        "incomplete": int(totals.get("incomplete", 0)),
        "duration_s": float(bench.get("duration", 0.0)),
        "output_tokens": _metric(metrics, "output_token_count", "total_sum"),
        "output_tokens_per_s": _metric(metrics, "output_tokens_per_second", "mean"),
        "ttft_p50_s": ttft / 1000 if ttft is not None else None,
        "itl_p50_s": itl / 1000 if itl is not None else None,
        # Wall-clock times (time.time(), as a server's --step-log): where the run's steps lie in the log.
        "started": float(bench.get("start_time", 0.0)),
        "ended": float(bench.get("end_time", 0.0)),
    }


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: each arm's median output tokens per second, and default / off paired by repeat."""
    out = []
    for level in sorted({r["level"] for r in rows}):
        at_level = [r for r in rows if r["level"] == level]
        arm_rate = {
            arm: {r["repeat"]: r["output_tokens_per_s"] for r in at_level if r["arm"] == arm} for arm in ARMS
        }
        paired = compare(arm_rate["default"], arm_rate["off"])
        out.append(
            {
                "level": level,
                "default_tokens_per_s": median(arm_rate["default"].values()),
                "off_tokens_per_s": median(arm_rate["off"].values()),
                "ratios": paired.ratios,
                "median_ratio": paired.median,
                "geomean_ratio": geomean(paired.ratios),
                "ahead": paired.ahead,
                "failed": sum(r["errored"] + r["incomplete"] for r in at_level),
            }
        )
    return out


def build_report(directory: Path, argv: list[str]) -> dict[str, Any]:
    if not directory.is_dir():
        fail(f"{directory}: no such directory")
    rows = [read_run(p) for p in sorted(directory.glob("c*.json"))]
    if not rows:
        fail(f"{directory}: no guidellm reports (c<level>-<arm>[-r<repeat>].json) in it")
    unknown = sorted({r["arm"] for r in rows} - set(ARMS))
    if unknown:
        fail(f"{directory}: arms {unknown} are not the script's ({', '.join(ARMS)})")
    rows.sort(key=lambda r: (r["level"], r["repeat"], r["arm"]))
    keys = [(r["level"], r["arm"], r["repeat"]) for r in rows]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:  # c4-off.json next to c4-off-r0.json: two runs claim one repeat
        level, arm, repeat = twice[0]
        fail(f"{directory}: two reports for concurrency {level}, arm {arm}, repeat {repeat}")
    report = envelope(SCHEMA, KIND, argv)
    report.update(directory=str(directory), runs=rows, summary=summarize(rows))
    report["cells"] = [  # bench serve's shape, for `bench steps --serve-report`
        {
            "concurrency": r["level"],
            "mode": r["arm"],
            "repeat": r["repeat"],
            "started": r["started"],
            "ended": r["ended"],
        }
        for r in sorted(rows, key=lambda r: r["started"])
    ]
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# specserve bench guidellm",
        "",
        f"`{report['command']}`",
        "",
        f"guidellm's JSON reports in `{report['directory']}` (benchmarks/guidellm_compare.sh): the server's"
        " default speculation against speculation off per request, each level's arms back to back in"
        " every repeat. Output tok/s is guidellm's own (mean over the run); ratios are default / off of"
        " the same repeat.",
        "",
    ]
    lines.append(
        md_table(
            RUN_HEADER,
            [
                [
                    str(r["level"]),
                    str(r["repeat"]),
                    r["arm"],
                    str(r["successful"]),
                    str(r["errored"] + r["incomplete"]),
                    fmt(r["duration_s"], 1),
                    fmt(r["output_tokens_per_s"], 2),
                    fmt(r["ttft_p50_s"], 3),
                    fmt(r["itl_p50_s"], 3),
                ]
                for r in report["runs"]
            ],
        )
    )
    lines += ["", "Default against off, per concurrency (median of the paired repeats):", ""]
    lines.append(
        md_table(
            SUMMARY_HEADER,
            [
                [
                    str(s["level"]),
                    fmt(s["default_tokens_per_s"], 2),
                    fmt(s["off_tokens_per_s"], 2),
                    " ".join(f"{x:.3f}" for x in s["ratios"]),
                    fmt(s["median_ratio"], 3, "x"),
                    fmt(s["geomean_ratio"], 3, "x"),
                    f"{s['ahead']}/{len(s['ratios'])}",
                    str(s["failed"]),
                ]
                for s in report["summary"]
            ],
        )
    )
    lines.append("")
    return markdown_document(lines, report)


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    summary = [s for s in report["summary"] if s["median_ratio"] is not None]
    if not summary:
        return []
    return save_ratio_bars(
        [f"{s['level']} clients" for s in summary],
        [s["median_ratio"] for s in summary],
        out_dir / f"{KIND}.png",
        "default / off (output tok/s)",
        "guidellm: server default vs speculation off",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    report = build_report(Path(args.directory), argv)
    write_report(report, output_dir(args, KIND), KIND, markdown, plot, plots=not args.no_plots)
    print_report(report, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
