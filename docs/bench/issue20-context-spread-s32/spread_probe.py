"""`specserve serve` that appends, for every target batch of 8 decoding sequences (one query row each),
the time and the sequences' context lengths to the JSON-lines file $SPREAD (join to the step log by
time: a step's record is written after its batch's).

    SPREAD=spread.jsonl python spread_probe.py serve --port 8716 ... --step-log steps.jsonl
"""

import json
import os
import sys
import time

import specserve.engine.runner as runner
from specserve.api.cli import run

log = open(os.environ["SPREAD"], "a", buffering=1)  # noqa: SIM115  # open for the server's life
ragged_batch = runner.ragged_batch


def recorded_batch(seqs, block_size, device, pad_slot):
    if len(seqs) == 8 and all(len(s.token_ids) == 1 for s in seqs):
        lengths = [s.start_position + 1 for s in seqs]
        log.write(json.dumps({"time": time.time(), "contexts": lengths}) + "\n")
    return ragged_batch(seqs, block_size, device, pad_slot)


runner.ragged_batch = recorded_batch
sys.argv = ["specserve", *sys.argv[1:]]
run()
