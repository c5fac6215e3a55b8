"""The step log's writer on its own: a failed write never fails a step."""

from __future__ import annotations

import json
import logging

from specserve.engine.stats import StepRecord
from specserve.engine.step_log import StepLog


def _record(tokens: int) -> StepRecord:
    return StepRecord(1, tokens, 0, 0, 0, 0, 0, 1, 0.0, 0.01, 0.01)


def test_a_write_that_fails_is_logged_once_and_the_log_stops(tmp_path, caplog):
    where = tmp_path / "logs"
    where.mkdir()
    log = StepLog(str(where / "steps.jsonl"))
    log.write(_record(3), speculating=1)
    (where / "steps.jsonl").unlink()
    where.rmdir()  # the directory went away (a volume unmounted)
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        log.write(_record(4), speculating=0)
        log.write(_record(5), speculating=0)
    assert log.failed
    assert len([r for r in caplog.records if "step log" in r.getMessage()]) == 1
    where.mkdir()
    log.write(_record(6), speculating=0)  # stopped for good: nothing written
    assert not (where / "steps.jsonl").exists()


def test_a_line_is_the_record_with_its_time_and_speculating_requests(tmp_path):
    path = tmp_path / "steps.jsonl"
    StepLog(str(path)).write(_record(7), speculating=1)
    (line,) = path.read_text().splitlines()
    row = json.loads(line)
    assert row["num_tokens"] == 7 and row["speculating"] == 1 and row["time"] > 0
    assert row["predicted_tokens"] is None
