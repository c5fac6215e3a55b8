"""`specserve serve` that appends, for every target forward, the engine thread's page faults, the
process's system and user CPU time and the wall time to the JSON-lines file $PROBE (join to the step
log by time: a step's record is written after its forward's).

    PROBE=probe.jsonl python serve_probe.py serve --port 8716 ... --step-log steps.jsonl
"""

import json
import os
import sys
import time

import specserve.engine.engine_core as engine_core
from specserve.api.cli import run

probe = open(os.environ["PROBE"], "a", buffering=1)  # noqa: SIM115  # open for the server's life
forward = engine_core.EngineCore._forward


def faults(path: str) -> int:
    with open(path) as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt


def measured_forward(self, batch):
    start, thread, process, times = (
        time.perf_counter(),
        faults("/proc/thread-self/stat"),
        faults("/proc/self/stat"),
        os.times(),
    )
    result = forward(self, batch)
    after = os.times()
    record = {
        "time": time.time(),
        "forward": time.perf_counter() - start,
        "thread_minflt": faults("/proc/thread-self/stat") - thread,
        "minflt": faults("/proc/self/stat") - process,
        "system": after.system - times.system,
        "user": after.user - times.user,
    }
    probe.write(json.dumps(record) + "\n")
    return result


engine_core.EngineCore._forward = measured_forward
sys.argv = ["specserve", *sys.argv[1:]]
run()
