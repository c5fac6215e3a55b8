"""`specserve serve` that appends, for every forward, how the block tables it reads are laid out to the
JSON-lines file $PROBE: consecutive block pairs of each sequence's used blocks that are adjacent ids
(or descending), and the ids' span. Made the probe.jsonl of probe8/ and c8new/.

    PROBE=probe.jsonl python layout_probe.py serve --port 8711 ... --step-log steps.jsonl
    python layout_probe.py --report probe8      # per cell: plain 8-sequence forwards and their layout
"""

import bisect
import json
import os
import statistics as st
import sys
import time
from itertools import pairwise
from pathlib import Path


def serve() -> None:
    import specserve.engine.runner as runner
    from specserve.api.cli import run

    probe = open(os.environ["PROBE"], "a", buffering=1)  # noqa: SIM115  # open for the server's life
    batch = runner.ragged_batch

    def measured_batch(seqs, block_size, device, pad_slot):
        pairs = adjacent = descending = blocks = 0
        lo, hi = 1 << 60, -1
        for s in seqs:
            used = s.block_ids[: -(-(s.start_position + len(s.token_ids)) // block_size)]
            blocks += len(used)
            if used:
                lo, hi = min(lo, *used), max(hi, *used)
            for a, b in pairwise(used):
                pairs += 1
                adjacent += b == a + 1
                descending += b == a - 1
        record = {"time": time.time(), "seqs": len(seqs), "tokens": sum(len(s.token_ids) for s in seqs)}
        record |= {"blocks": blocks, "pairs": pairs}
        probe.write(
            json.dumps({**record, "adjacent": adjacent, "descending": descending, "lo": lo, "hi": hi}) + "\n"
        )
        return batch(seqs, block_size, device, pad_slot)

    runner.ragged_batch = measured_batch
    sys.argv = ["specserve", *sys.argv[1:]]
    run()


def report(run: Path) -> None:
    from types import SimpleNamespace

    from specserve.benchmarks.step_log_report import cut_by_cells, serve_cells

    steps = [SimpleNamespace(**json.loads(line)) for line in (run / "steps.jsonl").read_text().splitlines()]
    probes = [json.loads(line) for line in (run / "probe.jsonl").read_text().splitlines()]
    times = [p["time"] for p in probes]
    for step in steps:  # the last forward recorded before the step was logged
        step.probe = probes[bisect.bisect_left(times, step.time) - 1]
    print("cell | plain@8 forwards | median ms | adjacent pairs | descending | span of ids | blocks")
    for label, repeat, group in cut_by_cells(steps, serve_cells(run / "serve.json")):
        plain = [s for s in group if s.prefill_tokens == 0 and s.draft_tokens == 0 and s.num_sequences == 8]
        share = st.median(s.probe["adjacent"] / max(1, s.probe["pairs"]) for s in plain)
        down = st.median(s.probe["descending"] / max(1, s.probe["pairs"]) for s in plain)
        span = st.median(s.probe["hi"] - s.probe["lo"] for s in plain)
        blocks = st.median(s.probe["blocks"] for s in plain)
        ms = 1e3 * st.median(s.forward_seconds for s in plain)
        print(
            f"r{repeat} {label.split()[-1]} | {len(plain)} | {ms:.1f} | {share:.2f} | {down:.2f} | {span:.0f} | {blocks:.0f}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--report"]:
        report(Path(__file__).parent / sys.argv[2])
    else:
        serve()
