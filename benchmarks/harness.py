"""The side-by-side harness every benchmark shares: arms, their interleaved run order, the report envelope
and the files a report is written to.

An arm is one named configuration (a method, a speculation mode, a quantization) measured again and again.
Machines here are shared and noisy, so arms are never run one after the other: each round runs every arm
once, back to back on the same input, and the order rotates from round to round so no arm always goes first
(warm caches, thermal state and load bursts spread evenly). Speed claims are then paired ratios between
neighbours of the same round (`keyed` + `stats.compare`), robust to a burst of load hitting one pair.

A script is: arms -> `rounds` (each script runs its own arm, sync or async) -> rows and a summary ->
`envelope` + `write_report` (<kind>.json, <kind>.md, plots) -> `print_report`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

from .common import command_line, default_output_dir, machine_info, now_iso, write_json

A = TypeVar("A")
I = TypeVar("I")  # noqa: E741 - the item a round measures (a prompt, a concurrency level)
logger = logging.getLogger("specserve.bench")


@dataclass(frozen=True)
class Arm(Generic[A]):
    """A named configuration measured repeatedly: `runner` does one measurement, `note` says how it was set up."""

    name: str
    runner: A
    note: str | None = None


# --- run order ------------------------------------------------------------------------------------------
def rotation(arms: Sequence[A], shift: int) -> list[A]:
    """`arms` started at position `shift` (mod len): round r of a rotation puts a different arm first."""
    if not arms:
        return []
    shift %= len(arms)
    return [*arms[shift:], *arms[:shift]]


@dataclass(frozen=True)
class Round(Generic[A, I]):
    """Every arm once, in `arms` order, on one item in one repeat."""

    repeat: int
    index: int  # the item's position in the item list
    item: I
    arms: list[A]
    last_of_group: bool  # the last round of its repeat (repeats outer) or of its item (items outer)


def rounds(
    arms: Sequence[A], items: Sequence[I], repeats: int, *, repeats_outer: bool = True
) -> Iterator[Round[A, I]]:
    """The interleaved schedule: for each repeat, for each item (or item-major with repeats_outer=False),
    one round of every arm, rotated by repeat + item index."""
    outer, inner = (
        (range(repeats), range(len(items))) if repeats_outer else (range(len(items)), range(repeats))
    )
    for o in outer:
        for n, i in enumerate(inner):
            rep, index = (o, i) if repeats_outer else (i, o)
            last = n == len(inner) - 1
            yield Round(rep, index, items[index], rotation(arms, rep + index), last)


def alternated_seconds(
    arms: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    prepare: Callable[[str], object] | None = None,
) -> dict[str, list[float]]:
    """Wall seconds of each arm's call over `repeats` rounds, after `warmup` rounds that are dropped;
    every round calls each arm once, in reversed order every other round, so a slow spell of the
    machine lands on all arms of a round rather than on all repeats of one arm. `prepare(name)` runs
    untimed before each call (e.g. switching a model's attention backend to the arm's)."""
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            if prepare is not None:
                prepare(name)
            start = time.perf_counter()
            arms[name]()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def keyed(rows: Iterable[Mapping[str, Any]], value: str, *keys: str) -> dict[Hashable, Any]:
    """{(row[k] for k in keys): row[value]}: one arm's measurements ready to pair with another's."""
    return {tuple(r[k] for k in keys): r[value] for r in rows}


# --- report envelope and output files ----------------------------------------------------------------------
def envelope(schema: str, subcommand: str, argv: list[str]) -> dict[str, Any]:
    """The fields that open every report: what produced it, when, and on which machine."""
    return {
        "schema": schema,
        "created": now_iso(),
        "command": command_line(subcommand, argv),
        "machine": machine_info(),
    }


def add_output_args(parser: argparse.ArgumentParser, kind: str) -> None:
    o = parser.add_argument_group("output")
    o.add_argument(
        "--output-dir",
        default=None,
        help=f"where {kind}.json/.md/.png go (default bench-results/{kind}-<time>)",
    )
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")


def fail(command: str, message: str) -> NoReturn:
    """`command: message` on stderr as one line, exit code 2 (bad input, as for any CLI flag)."""
    print(f"{command}: {message}", file=sys.stderr)
    raise SystemExit(2)


def int_list(text: str) -> list[int]:
    """A comma list of positive integers (argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers (comma list), got {text!r}")
    return values


def positive_int(text: str) -> int:
    """A positive integer (argparse type)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def output_dir(args: argparse.Namespace, kind: str) -> Path:
    out = Path(args.output_dir) if args.output_dir else default_output_dir(kind)
    out.mkdir(parents=True, exist_ok=True)
    return out


def pyplot() -> Any:
    """matplotlib.pyplot on Agg (files only, no display), or None with a warning: plots are optional."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib not installed: no plots (pip install matplotlib)")
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)


def save_ratio_bars(
    labels: list[str], ratios: list[float], path: Path, ylabel: str, title: str, color: str = "tab:blue"
) -> list[str]:
    """One bar per row of paired ratios, a line at 1 (level): [the PNG's path], or [] without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(labels)), 4))
    ax.bar(range(len(labels)), ratios, color=color)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return [save_figure(plt, fig, path)]


def markdown_document(lines: list[str], report: Mapping[str, Any]) -> str:
    """The report's Markdown lines, then its plots as images (they sit next to the .md file)."""
    lines = [*lines, *(f"![{Path(f).stem}]({Path(f).name})" for f in report["files"].get("plots", []))]
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    report: dict[str, Any],
    out_dir: Path,
    kind: str,
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], list[str]],
    plots: bool = True,
) -> None:
    """<kind>.json, <kind>.md and the plots; report["files"] lists them (the Markdown links the plots)."""
    report["files"] = {
        "json": str(out_dir / f"{kind}.json"),
        "markdown": str(out_dir / f"{kind}.md"),
        "plots": plot(report, out_dir) if plots else [],
    }
    write_json(out_dir / f"{kind}.json", report)
    (out_dir / f"{kind}.md").write_text(markdown(report))


def print_report(report: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> None:
    """The Markdown on stdout, where the JSON went on stderr (stdout stays pipeable)."""
    sys.stdout.write(markdown(report))
    print(f"\nwrote {report['files']['json']}", file=sys.stderr)
