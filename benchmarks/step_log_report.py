"""`specserve bench steps LOG`: a server's step log (`--step-log`) added up per run of one mode.

`bench ledger` measures in-process; a served benchmark only shows its requests' latencies. With
`specserve serve --step-log steps.jsonl` every engine step is a JSON line, and this report cuts the log
into runs of one mode, as `bench serve` runs its cells (speculation toggled per request, one cell at a
time): a step whose requests all had speculation off belongs to an "off" run, one whose requests all had
it on to an "on" run; a step holding both (the end of one cell overlapping the start of the next) stays
with the run before it; two cells of one mode in a row are one run. Given the `serve.json` of the same
run (`--serve-report`), the log is cut by its cells' start and end times instead, one table per cell.
Per run and kind of step, the same table as `bench ledger`: steps, seconds
(proposer, target forward), emitted tokens, tokens per second of step time, and what the speculation
controller expected of its drafting steps. With a serve report, each pair of cells' ratio is also split
into the work each mode had the engine do and the speed its forwards ran at (step_work_price.py).

    specserve serve --step-log steps.jsonl ... &
    specserve bench serve --base-url http://127.0.0.1:8000 --modes off,adaptive ...
    specserve bench steps steps.jsonl --serve-report bench-results/serve-.../serve.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

from . import harness
from .common import fmt, md_table
from .harness import add_output_args, envelope, markdown_document, output_dir, print_report, write_report
from .step_cost_fit import fit_decode_costs
from .step_ledger import KIND_HEADER, KINDS, kind_rows, ledger
from .step_ledger import plot as ledger_plot
from .step_work_price import price_cells

SCHEMA = "specserve.bench.step_log/1"
KIND = "step_log"
FIELDS = ("num_sequences", "prefill_tokens", "drafting", "probes", "setup_tokens", "emitted_tokens")
SECONDS = ("step_seconds", "draft_seconds", "forward_seconds")


def fail(message: str) -> NoReturn:
    harness.fail("specserve bench steps", message)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve bench steps",
        description="A step log (serve --step-log) added up per run of one mode and kind of step.",
    )
    p.add_argument("log", help="the step log: one JSON object per engine step")
    p.add_argument("--min-steps", type=int, default=5, help="runs with fewer steps are left out (default 5)")
    p.add_argument(
        "--serve-report",
        default=None,
        help="a bench serve serve.json (or bench guidellm guidellm.json) of the same run: steps are cut by"
        " its cells' start and end times"
        " instead of by mode (cells of one mode in a row stay apart; warm-up steps are left out)",
    )
    add_output_args(p, KIND)
    return p


def read_steps(path: Path) -> list[SimpleNamespace]:
    """The log's steps; a line that is not a step is a one-line error naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"{path}: {exc.strerror or exc}")
    steps = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or any(not isinstance(row.get(f), int) for f in FIELDS):
                raise ValueError
            if any(not isinstance(row.get(f), (int, float)) for f in SECONDS):
                raise ValueError
            steps.append(SimpleNamespace(**row))
        except ValueError:
            fail(f"{path}:{number}: not a step log line")
    return steps


def mode_of(step: SimpleNamespace) -> str | None:
    """off / on, or None for a step holding requests of both."""
    speculating = getattr(step, "speculating", None)
    if speculating is None:
        fail("a step has no 'speculating' count: not a log from serve --step-log")
    if speculating == 0:
        return "off"
    return "on" if speculating == step.num_sequences else None


def runs(steps: list[SimpleNamespace]) -> list[tuple[str, list[SimpleNamespace]]]:
    """Consecutive steps of one mode; a step of both modes stays with the run before it."""
    out: list[tuple[str, list[SimpleNamespace]]] = []
    for step in steps:
        mode = mode_of(step) or (out[-1][0] if out else "off")
        if not out or out[-1][0] != mode:
            out.append((mode, []))
        out[-1][1].append(step)
    return out


def serve_cells(path: Path) -> list[tuple[str, int, float, float]]:
    """(label, repeat, started, ended) of each cell of a bench serve report, in its order."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return [
            (f"c{c['concurrency']} {c['mode']}", int(c["repeat"]), float(c["started"]), float(c["ended"]))
            for c in cells
        ]
    except OSError as exc:
        fail(f"{path}: {exc.strerror or exc}")
    except (ValueError, KeyError, TypeError):
        fail(f"{path}: not a bench serve report with cell times (serve.json from this version)")


def cut_by_cells(
    steps: list[SimpleNamespace], cells: list[tuple[str, int, float, float]]
) -> list[tuple[str, int, list[SimpleNamespace]]]:
    """Each cell's steps: those that ended inside its time window (steps outside every cell go)."""
    out = []
    for label, repeat, started, ended in cells:
        out.append((label, repeat, [s for s in steps if started <= s.time <= ended]))
    return out


def build_report(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    if args.min_steps < 1:
        fail("--min-steps must be >= 1")
    steps = read_steps(Path(args.log))
    if args.serve_report:
        if any(not isinstance(getattr(s, "time", None), (int, float)) for s in steps):
            fail("a step has no 'time': not a log from serve --step-log")
        groups = cut_by_cells(steps, serve_cells(Path(args.serve_report)))
    else:
        groups = [(mode, index, run) for index, (mode, run) in enumerate(runs(steps))]
    cells = []
    kept = [(mode, index, steps) for mode, index, steps in groups if len(steps) >= args.min_steps]
    for mode, index, steps in kept:
        seconds = sum(s.step_seconds for s in steps)
        tokens = sum(s.emitted_tokens for s in steps)
        cells.append(
            {
                "mode": mode,
                "repeat": index,  # the cell's repeat, or the run's place in the log
                "max_sequences": max(s.num_sequences for s in steps),
                "steps": len(steps),
                "seconds": seconds,
                "tokens": tokens,
                "tok_s": tokens / seconds if seconds > 0 else 0.0,
                "ledger": ledger(steps),
            }
        )
    report = envelope(SCHEMA, "steps", argv)
    report["config"] = {"log": args.log, "min_steps": args.min_steps, "serve_report": args.serve_report}
    report["cells"] = cells
    report["cost_fit"] = fit_decode_costs([s for _, _, steps in kept for s in steps])
    # Pairs by repeat exist only where a serve report names the cells.
    report["work_price"] = price_cells(kept) if args.serve_report else None
    return report


COST_FIT_HEADER = [
    "sequences",
    "steps (drafting)",
    "measured: base / a sequence / a draft row, ms",
    "predicted: base / a sequence / a draft row, ms",
]


def _fit_row(fit: dict[str, Any]) -> list[str]:
    def trio(line: dict[str, float | None]) -> str:
        return " / ".join(fmt(line[k], 2) for k in ("base_ms", "per_sequence_ms", "per_draft_ms"))

    return [
        fit["sequences"],
        f"{fit['steps']} ({fit['drafting_steps']})",
        trio(fit["measured"]),
        trio(fit["predicted"]),
    ]


def markdown(report: dict[str, Any]) -> str:
    runs_table = [
        [
            f"{c['mode']} (r{c['repeat']})",
            f"{c['max_sequences']}",
            f"{c['steps']}",
            fmt(c["seconds"], 1),
            f"{c['tokens']}",
            fmt(c["tok_s"], 2),
        ]
        for c in report["cells"]
    ]
    lines = [
        "# step log",
        "",
        f"`{report['command']}`",
        "",
        (
            f"The cells of `{report['config']['serve_report']}` in `{report['config']['log']}` (r = repeat;"
            if report["config"].get("serve_report")
            else f"Runs of one mode in `{report['config']['log']}` (r = the run's place in the log;"
        )
        + f" seconds are step time; kinds: {', '.join(KINDS)}; drafting_no_catch_up = drafting steps"
        " without a catch-up).",
        "",
        md_table(["run", "most sequences", "steps", "seconds", "tokens", "tok/s"], runs_table),
        "",
        md_table(KIND_HEADER, kind_rows(report["cells"])),
        "",
    ]
    fits = report.get("cost_fit") or []
    if fits:
        lines += [
            "The controller's cost model against the steps it decided (decode steps, every run above):"
            " ms = base + a x sequences + b x draft tokens, least squares per batch bucket, on the"
            " measured step seconds and on the controller's predictions of the same steps (b: what a"
            " draft row costs).",
            "",
            md_table(COST_FIT_HEADER, [_fit_row(f) for f in fits]),
            "",
        ]
    lines += work_price_lines(report.get("work_price"))
    return markdown_document(lines, report)


def work_price_lines(price: dict[str, Any] | None) -> list[str]:
    """The pairs' ratios split into the work each mode did and the speed its forwards ran at."""
    if not price or not price["pairs"]:
        return []
    coef = price["coefficients_ms"]
    pair_rows = [
        [f"{p['mode']} / {p['reference']} (r{p['repeat']})"]
        + [fmt(p[k], 3) for k in ("measured", "work", "speed")]
        for p in price["pairs"]
    ]
    summary_rows = [
        [f"{s['mode']} / {s['reference']}", f"{s['pairs']}"]
        + [
            f"{fmt(s[k + '_median'], 3)} / {fmt(s[k + '_geometric'], 3)}"
            for k in ("measured", "work", "speed")
        ]
        for s in price["summary"]
    ]
    return [
        "Each cell's work priced alike: one line fitted over every cell's forwards with a speed per cell (ms: "
        + ", ".join(f"{name} {fmt(value, 2)}" for name, value in coef.items())
        + "), plus what the cell measured outside its forwards. measured = tokens over step time against"
        " the reference cell of the same repeat and level; work = the same over priced time (what the mode had the"
        " engine do); speed = how fast its forwards ran against the line, relative to the reference's"
        " (measured is about work x speed).",
        "",
        md_table(["pair", "measured", "work", "speed"], pair_rows),
        "",
        md_table(["modes", "pairs", "measured: median / geometric", "work", "speed"], summary_rows),
        "",
    ]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    report = build_report(args, argv)
    out = output_dir(args, KIND)
    write_report(
        report, out, KIND, markdown, lambda r, d: ledger_plot(r, d, f"{KIND}.png"), not args.no_plots
    )
    print_report(report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
