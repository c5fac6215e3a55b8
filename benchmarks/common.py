"""Shared helpers for the benchmark commands: machine description, output folder, JSON/Markdown writing."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        from specserve import __version__

        info["specserve"] = __version__
    except ImportError:
        pass
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def command_line(subcommand: str, argv: list[str]) -> str:
    """The command that reproduces a run: `specserve bench <subcommand>`, or for the module-only
    benchmarks (bench_attention, bench_sampler, ...) `python -m specserve.benchmarks.<module>`."""
    if subcommand.startswith("bench_"):
        head = ["python", "-m", f"specserve.benchmarks.{subcommand}"]
    else:
        head = ["specserve", "bench", subcommand]
    return " ".join([*head, *(shlex.quote(a) for a in argv)])


def default_output_dir(kind: str) -> Path:
    return Path("bench-results") / f"{kind}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}{suffix}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def progress(total: int, desc: str, disable: bool = False):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)
