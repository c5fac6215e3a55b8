"""`--step-log PATH`: every engine step appended to a file as one JSON line.

What the step held, where its time went, what it emitted and what the speculation controller expected
of it (the fields of `StepRecord`), plus the wall-clock time it ended and how many of its requests had
speculation on (a benchmark that toggles speculation per request tells its cells apart by that).
`specserve bench steps PATH` adds the lines up per run of one mode and kind of step. Served, this is
the only view of the steps: the serving losses of the Qwen pair at 8-32 clients were found in such a
log and were not seen in-process (`bench ledger`).

Opened, appended and closed per step (tens of microseconds against steps of milliseconds or more), so
no handle outlives the engine and a file moved away (log rotation) is started again. A write that
fails is logged once and the log stops: it never fails a step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from .stats import StepRecord

logger = logging.getLogger("specserve.engine")


class StepLog:
    def __init__(self, path: str):
        self.path = Path(path)
        self.failed = False

    def write(self, record: StepRecord, speculating: int) -> None:
        if self.failed:
            return
        line = json.dumps({"time": time.time(), "speculating": speculating, **dataclasses.asdict(record)})
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError as exc:
            self.failed = True
            logger.warning("step log %s: %s; no further steps are written", self.path, exc)
