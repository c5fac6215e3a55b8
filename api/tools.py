"""`specserve bench ...` and `specserve soak ...`: thin dispatch into specserve.benchmarks."""

from __future__ import annotations

import importlib
import importlib.util
import sys

BENCH_COMMANDS = {
    "latency": (
        "specserve.benchmarks.latency",
        "offline batch-1 decoding: specserve vs transformers, per proposer",
    ),
    "serve": (
        "specserve.benchmarks.serve",
        "load test against a running server: concurrency sweep, spec on vs off",
    ),
    "ledger": (
        "specserve.benchmarks.step_ledger",
        "in-process cells per speculation mode: where the time goes, engine step by step",
    ),
    "steps": (
        "specserve.benchmarks.step_log_report",
        "a server's step log (serve --step-log) added up per run of one mode, like ledger",
    ),
    "guidellm": (
        "specserve.benchmarks.guidellm_report",
        "guidellm runs of benchmarks/guidellm_compare.sh, default vs off, as paired ratios",
    ),
}


def _usage() -> str:
    names = ",".join(BENCH_COMMANDS)
    lines = [f"usage: specserve bench {{{names}}} [options]   (specserve bench COMMAND --help)", ""]
    lines += [f"  {name:8s} {desc}" for name, (_, desc) in BENCH_COMMANDS.items()]
    return "\n".join(lines)


def main(command: str, rest: list[str]) -> None:
    if command == "soak":
        if importlib.util.find_spec("specserve.benchmarks.soak") is None:
            print("specserve soak: not available yet", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(importlib.import_module("specserve.benchmarks.soak").main(rest) or 0)
    if command != "bench":
        print(f"specserve: unknown tool {command!r}", file=sys.stderr)
        raise SystemExit(2)
    if not rest or rest[0] in ("-h", "--help", "help"):
        print(_usage())
        raise SystemExit(0 if rest else 2)
    sub, args = rest[0], rest[1:]
    if sub not in BENCH_COMMANDS:
        print(
            f"specserve bench: unknown benchmark {sub!r}; choose from {', '.join(BENCH_COMMANDS)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    module = importlib.import_module(BENCH_COMMANDS[sub][0])
    raise SystemExit(module.main(args) or 0)
