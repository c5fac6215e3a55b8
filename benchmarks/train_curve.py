"""Held-out accuracy of draft heads against training time, from `specserve train-draft` reports.

Reads one or more train_report.json files (Medusa or EAGLE), prints a markdown table per report (step,
minutes, tokens seen, per-position chain acceptance, expected acceptance length) and, with --plot, draws
every report's expected acceptance length against wall-clock minutes into one PNG.

    python -m specserve.benchmarks.train_curve DIR/train_report.json [...] --plot curve.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .common import fmt, md_table


def load(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    if "curve" not in report or "method" not in report:
        raise SystemExit(f"train_curve: {path} is not a train-draft report (no 'curve'/'method')")
    return report


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per held-out evaluation: minutes since the run started, and the held-out numbers."""
    out = []
    for point in report["curve"]:
        held = point["all"]
        out.append(
            {
                "step": point["step"],
                "minutes": point["elapsed_seconds"] / 60,
                "tokens_seen": point.get("tokens_seen"),
                "chain_acceptance": held.get("chain_acceptance", []),
                "expected_acceptance_length": held.get("expected_acceptance_length"),
            }
        )
    return out


def markdown(path: Path, report: dict[str, Any]) -> str:
    header = ["step", "minutes", "tokens seen", "chain acceptance per draft position", "expected length"]
    body = [
        [
            str(r["step"]),
            fmt(r["minutes"], 1),
            str(r["tokens_seen"]),
            " ".join(f"{a:.2f}" for a in r["chain_acceptance"]),
            fmt(r["expected_acceptance_length"], 3),
        ]
        for r in rows(report)
    ]
    return f"### {report['method']}: {path}\n\n{md_table(header, body)}\n"


def plot(reports: list[tuple[Path, dict[str, Any]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for path, report in reports:
        points = rows(report)
        label = f"{report['method']} ({path.resolve().parent.name}/{path.name})"
        ax.plot(
            [p["minutes"] for p in points],
            [p["expected_acceptance_length"] for p in points],
            "o-",
            label=label,
        )
    ax.set_xlabel("wall-clock minutes (data building included)")
    ax.set_ylabel("held-out expected acceptance length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="train_curve", description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", type=Path, help="train_report.json files")
    p.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    args = p.parse_args(argv)
    reports = [(path, load(path)) for path in args.reports]
    for path, report in reports:
        print(markdown(path, report))
    if args.plot is not None:
        plot(reports, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
