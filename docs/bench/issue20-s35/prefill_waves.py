"""Where a closed-loop cell's steps went, by kind: plain steps of the full batch (their median forward),
drafting steps, steps that prefill prompts (with whatever decodes ride along) and steps with fewer
sequences; read from a step log and closed_loop.py's cells.json.

    ARMS=nodraft,adaptive OUT=dir python ../issue20-tail-s33/closed_loop.py 16 4
    python prefill_waves.py dir/steps.jsonl dir/cells.json 16
"""

from __future__ import annotations

import json
import statistics
import sys


def main() -> None:
    steps_path, cells_path, clients = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cells = json.load(open(cells_path))["cells"]  # noqa: SIM115 (read whole)
    steps = [json.loads(line) for line in open(steps_path)]  # noqa: SIM115
    for c in cells:
        own = [s for s in steps if c["started"] <= s["time"] <= c["ended"]]
        full = [
            s for s in own if s["num_sequences"] == clients and not s["drafting"] and not s["prefill_tokens"]
        ]
        drafting = [s for s in own if s["drafting"]]
        prefill = [s for s in own if s["prefill_tokens"]]
        fewer = [
            s for s in own if not s["prefill_tokens"] and not s["drafting"] and s["num_sequences"] < clients
        ]

        def secs(group: list[dict]) -> float:
            return sum(s["step_seconds"] for s in group)

        plain_ms = statistics.median(s["forward_seconds"] for s in full) * 1e3 if full else float("nan")
        print(
            f"{c['mode']:9s} r{c['repeat']}: {len(own)} steps, {secs(own):.2f} s; plain x{clients} {len(full)}"
            f" ({plain_ms:.1f} ms median forward); drafting {len(drafting)} ({secs(drafting):.2f} s);"
            f" prefilling {len(prefill)} ({secs(prefill):.2f} s); fewer sequences {len(fewer)} ({secs(fewer):.2f} s)"
        )


if __name__ == "__main__":
    main()
