"""`serve_probe.py` (docs/bench/issue20-heap-retention-s31) that also appends every garbage collection
(start time, seconds, generation, objects collected, thread) to the JSON-lines file $GC_PROBE.

    GC_PROBE=gc.jsonl PROBE=probe.jsonl python gc_probe.py serve --port 8716 ... --step-log steps.jsonl
"""

import gc
import json
import os
import runpy
import threading
import time
from pathlib import Path

log = open(os.environ["GC_PROBE"], "a", buffering=1)  # noqa: SIM115  # open for the server's life
started: dict[int, float] = {}


def record(phase: str, info: dict) -> None:
    thread = threading.get_ident()
    if phase == "start":
        started[thread] = time.perf_counter()
        return
    seconds = time.perf_counter() - started.pop(thread, time.perf_counter())
    entry = {"time": time.time(), "seconds": seconds, "generation": info["generation"], "thread": thread}
    log.write(json.dumps(entry | {"collected": info["collected"]}) + "\n")


gc.callbacks.append(record)
probe = Path(__file__).resolve().parents[1] / "issue20-heap-retention-s31" / "serve_probe.py"
runpy.run_path(str(probe), run_name="__main__")
