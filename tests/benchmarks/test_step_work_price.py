"""`bench steps`' cells priced alike: a pair's ratio split into the work each mode did and the speed
its forwards ran at."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specserve.benchmarks import step_log_report
from specserve.benchmarks.step_work_price import fit_line, price_cells

# The machine's line, in seconds: prompt steps 30 ms, decode-only steps 20 ms, 1 ms a prompt token,
# 4 ms a decode row, 2 ms a draft row.
LINE = (0.030, 0.020, 0.001, 0.004, 0.002)


def _step(sequences, prompt=0, drafts=0, slow=1.0, outside=0.0, emitted=None, time=0.0, rows=None):
    """`rows`: decode rows (default one per sequence; a wave of new prompts has none)."""
    rows = sequences if rows is None else rows
    with_prompt = 1 if prompt else 0
    forward = slow * (
        LINE[0] * with_prompt
        + LINE[1] * (1 - with_prompt)
        + LINE[2] * prompt
        + LINE[3] * rows
        + LINE[4] * drafts
    )
    return SimpleNamespace(
        time=time,
        speculating=0,
        num_sequences=sequences,
        num_tokens=prompt + rows + drafts,
        prefill_tokens=prompt,
        drafting=1 if drafts else 0,
        draft_tokens=drafts,
        probes=0,
        setup_tokens=0,
        emitted_tokens=rows + drafts // 2 if emitted is None else emitted,
        draft_seconds=0.0,
        forward_seconds=forward,
        step_seconds=forward + outside,
        predicted_tokens=None,
        predicted_seconds=None,
    )


def _lockstep(slow=1.0):
    """A wave of 8 prompts prefilled together, then 12 decode steps of 8 sequences and 4 of 6."""
    wave = [_step(8, prompt=800, rows=0, slow=slow, emitted=8)]
    return wave + [_step(8 if i < 12 else 6, slow=slow) for i in range(16)]


def _spread(slow=1.0):
    """The same prompts one at a time beside decode rows, and steps with drafts."""
    steps = [_step(7, prompt=100, slow=slow, emitted=8) for _ in range(8)]
    return steps + [_step(8, drafts=4 * (i % 2), slow=slow) for i in range(12)]


def test_the_line_is_recovered_from_steps_of_every_shape():
    coef, (slowness,) = fit_line([_lockstep() + _spread()])
    assert coef == pytest.approx(LINE, abs=1e-9) and slowness == pytest.approx(1.0)


def test_each_cell_gets_its_own_speed_under_one_line():
    """Three cells at 0.9x, 1x and 1.2x the line's time: the line up to scale, their slownesses."""
    cells = [_lockstep(0.9) + _spread(0.9), _lockstep() + _spread(), _lockstep(1.2) + _spread(1.2)]
    coef, slowness = fit_line(cells)
    scale = slowness[1]
    assert [w / scale for w in slowness] == pytest.approx([0.9, 1.0, 1.2])
    assert coef * scale == pytest.approx(LINE, abs=1e-9)


def test_a_slow_spell_in_the_only_cells_with_draft_rows_is_speed_not_their_price():
    """Draft rows occur only in the speculating cell, which ran 20% slow: one line over both cells
    would price a draft row with that slowness in it; a speed per cell keeps the row at its price."""
    off = _lockstep() + [_step(8, prompt=400, rows=0, emitted=8)] + [_step(8) for _ in range(6)]
    adaptive = _spread(slow=1.2)
    price = price_cells([("c8 off", 0, off), ("c8 adaptive", 0, adaptive)])
    assert price["coefficients_ms"]["per_draft_row_ms"] / price["coefficients_ms"]["per_decode_row_ms"] == (
        pytest.approx(LINE[4] / LINE[3])
    )
    (pair,) = price["pairs"]
    assert pair["speed"] == pytest.approx(1 / 1.2)
    at_line_speed = _spread()
    work = (sum(s.emitted_tokens for s in at_line_speed) / sum(s.forward_seconds for s in at_line_speed)) / (
        sum(s.emitted_tokens for s in off) / sum(s.forward_seconds for s in off)
    )
    assert pair["work"] == pytest.approx(work)


def test_the_same_work_run_slower_is_all_speed():
    """The second mode ran the same steps 10% slower: work 1.0, the measured loss is speed."""
    price = price_cells([("c8 off", 0, _lockstep()), ("c8 adaptive", 0, _lockstep(slow=1.1))])
    (pair,) = price["pairs"]
    assert pair["mode"] == "c8 adaptive" and pair["reference"] == "c8 off"
    assert pair["work"] == pytest.approx(1.0)
    assert pair["speed"] == pytest.approx(1 / 1.1)
    assert pair["measured"] == pytest.approx(1 / 1.1)


def test_other_work_at_the_same_speed_is_all_work():
    """Spread prompts and draft rows cost what the line says: speed 1.0, the ratio is the work's."""
    off, adaptive = _lockstep(), _spread()
    price = price_cells([("c8 off", 0, off), ("c8 adaptive", 0, adaptive)])
    (pair,) = price["pairs"]
    expected = (sum(s.emitted_tokens for s in adaptive) / sum(s.forward_seconds for s in adaptive)) / (
        sum(s.emitted_tokens for s in off) / sum(s.forward_seconds for s in off)
    )
    assert pair["speed"] == pytest.approx(1.0)
    assert pair["work"] == pytest.approx(expected) and pair["measured"] == pytest.approx(expected)
    assert expected != pytest.approx(1.0, abs=0.01)  # the two shapes do differ in cost


def test_time_outside_the_forwards_is_kept_as_measured():
    """The policy's own time (the engine's beside the forwards) counts in the work, unpriced."""
    off = _lockstep()
    adaptive = [
        _step(s.num_sequences, s.prefill_tokens, rows=s.num_tokens - s.prefill_tokens, outside=0.01)
        for s in off
    ]
    for a, o in zip(adaptive, off, strict=True):
        a.emitted_tokens = o.emitted_tokens
    (pair,) = price_cells([("c8 off", 0, off), ("c8 adaptive", 0, adaptive)])["pairs"]
    seconds = sum(s.forward_seconds for s in off)
    assert pair["work"] == pytest.approx(seconds / (seconds + 0.01 * len(off)))
    assert pair["speed"] == pytest.approx(1.0)


def test_pairs_are_by_repeat_against_off_wherever_it_is_listed():
    groups = [
        ("c8 adaptive", 0, _lockstep(slow=1.2)),
        ("c8 off", 0, _lockstep()),
        ("c8 off", 1, _lockstep(slow=1.2)),
        ("c8 adaptive", 1, _lockstep()),
        ("c8 adaptive", 2, _lockstep()),  # its off cell is missing: no pair
    ]
    price = price_cells(groups)
    assert [(p["mode"], p["repeat"]) for p in price["pairs"]] == [("c8 adaptive", 0), ("c8 adaptive", 1)]
    speeds = [p["speed"] for p in price["pairs"]]
    assert speeds == pytest.approx([1 / 1.2, 1.2])
    (summary,) = price["summary"]
    assert summary["pairs"] == 2 and summary["speed_geometric"] == pytest.approx(1.0)
    assert summary["work_median"] == pytest.approx(1.0)


def test_each_concurrency_is_paired_within_itself():
    """A run of several concurrencies: each level's cells against that level's off cells, not the first
    level's (where a 4-client cell against a 1-client one came out 2.4x)."""
    groups = [
        ("c1 off", 0, _spread()),
        ("c1 adaptive", 0, _spread(slow=1.2)),
        ("c8 off", 0, _lockstep()),
        ("c8 adaptive", 0, _lockstep(slow=0.8)),
        ("c8 static", 0, _lockstep()),
    ]
    price = price_cells(groups)
    pairs = {(p["mode"], p["reference"]): p["speed"] for p in price["pairs"]}
    assert pairs == pytest.approx(
        {("c1 adaptive", "c1 off"): 1 / 1.2, ("c8 adaptive", "c8 off"): 1 / 0.8, ("c8 static", "c8 off"): 1.0}
    )
    assert [(s["mode"], s["reference"]) for s in price["summary"]] == [
        ("c1 adaptive", "c1 off"),
        ("c8 adaptive", "c8 off"),
        ("c8 static", "c8 off"),
    ]


def test_a_log_without_step_shapes_is_not_priced():
    step = _step(8)
    del step.num_tokens
    assert price_cells([("c8 off", 0, [step])]) is None


def test_bench_steps_reports_the_split_for_a_serve_report(tmp_path):
    """Through `bench steps --serve-report`: the JSON carries the pairs, the Markdown their table."""
    steps, cells = [], []
    for repeat, (mode, slow) in enumerate([("off", 1.0), ("adaptive", 1.1)]):
        started = 100.0 * (repeat + 1)
        for i, s in enumerate(_lockstep(slow)):
            s.time = started + i
            s.speculating = 0 if mode == "off" else s.num_sequences
            steps.append(s)
        cells.append({"concurrency": 8, "mode": mode, "repeat": 0, "started": started, "ended": started + 50})
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(vars(s)) + "\n" for s in steps))
    (tmp_path / "serve.json").write_text(json.dumps({"cells": cells}))
    out = tmp_path / "report"
    argv = [str(log), "--serve-report", str(tmp_path / "serve.json"), "--output-dir", str(out), "--no-plots"]
    assert step_log_report.main(argv) == 0
    report = json.loads((out / "step_log.json").read_text())
    (pair,) = report["work_price"]["pairs"]
    assert pair["work"] == pytest.approx(1.0) and pair["speed"] == pytest.approx(1 / 1.1)
    text = (out / "step_log.md").read_text()
    assert "| c8 adaptive / c8 off (r0) | 0.909 | 1.000 | 0.909 |" in text
