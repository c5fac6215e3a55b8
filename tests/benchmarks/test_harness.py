"""The shared benchmark harness: rotated run order, pairing measurements, and the files a report becomes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.benchmarks import harness
from specserve.benchmarks import stats as st


def test_rotation_starts_each_shift_at_a_different_arm():
    arms = ["a", "b", "c"]
    assert [harness.rotation(arms, s) for s in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert harness.rotation([], 3) == []


def test_rounds_repeat_major_rotate_by_repeat_plus_item():
    order = [(r.repeat, r.item, r.arms, r.last_of_group) for r in harness.rounds(["x", "y"], ["p", "q"], 2)]
    assert order == [
        (0, "p", ["x", "y"], False),
        (0, "q", ["y", "x"], True),  # the last prompt closes repeat 0
        (1, "p", ["y", "x"], False),
        (1, "q", ["x", "y"], True),
    ]


def test_rounds_item_major_keep_an_items_repeats_together():
    order = [
        (r.item, r.repeat, r.arms) for r in harness.rounds(["off", "on"], [1, 2], 2, repeats_outer=False)
    ]
    assert order == [
        (1, 0, ["off", "on"]),
        (1, 1, ["on", "off"]),
        (2, 0, ["on", "off"]),
        (2, 1, ["off", "on"]),
    ]


def test_every_arm_leads_equally_often():
    arms = ["a", "b", "c"]
    firsts = [r.arms[0] for r in harness.rounds(arms, [None], 6)]
    assert sorted(firsts) == sorted(arms * 2)
    assert all(sorted(r.arms) == arms for r in harness.rounds(arms, [0, 1], 3))


def test_keyed_pairs_rows_of_two_arms():
    rows = [
        {"arm": "on", "prompt": "p1", "repeat": 0, "tps": 20.0},
        {"arm": "on", "prompt": "p1", "repeat": 1, "tps": 30.0},
        {"arm": "off", "prompt": "p1", "repeat": 0, "tps": 10.0},
        {"arm": "off", "prompt": "p1", "repeat": 1, "tps": 40.0},
    ]
    on = harness.keyed((r for r in rows if r["arm"] == "on"), "tps", "prompt", "repeat")
    off = harness.keyed((r for r in rows if r["arm"] == "off"), "tps", "prompt", "repeat")
    assert on == {("p1", 0): 20.0, ("p1", 1): 30.0}
    pairs = st.compare(on, off)
    assert pairs.ratios == [2.0, 0.75]
    assert pairs.median == pytest.approx(1.375) and pairs.ahead == 1
    assert st.compare({}, off).median is None and st.compare({}, off).ahead == 0


def test_acceptance_counts_the_bonus_token():
    assert st.acceptance(4, 12, 6) == (0.5, 2.5)
    assert st.acceptance(0, 0, 0) == (None, None)


def test_write_report_writes_json_markdown_and_links_plots(tmp_path: Path):
    def plot(report: dict, out_dir: Path) -> list[str]:
        (out_dir / "k.png").write_bytes(b"png")
        return [str(out_dir / "k.png")]

    def markdown(report: dict) -> str:
        return harness.markdown_document(["# k", ""], report)

    report = {**harness.envelope("specserve.bench.k/1", "k", ["--x", "a b"]), "files": {}}
    harness.write_report(report, tmp_path, "k", markdown, plot)
    saved = json.loads((tmp_path / "k.json").read_text())
    assert saved["schema"] == "specserve.bench.k/1" and saved["command"] == "specserve bench k --x 'a b'"
    assert saved["files"]["plots"] == [str(tmp_path / "k.png")]
    assert (tmp_path / "k.md").read_text() == "# k\n\n![k](k.png)\n"
    harness.write_report(report, tmp_path, "k", markdown, plot, plots=False)
    assert report["files"]["plots"] == [] and "![" not in (tmp_path / "k.md").read_text()


def test_alternated_seconds_reverses_the_order_every_other_round_and_drops_the_warmup():
    calls: list[str] = []
    arms = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = harness.alternated_seconds(arms, repeats=3, warmup=2)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_alternated_seconds_prepares_each_arm_untimed_before_its_call():
    calls: list[str] = []
    arms = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    harness.alternated_seconds(
        arms, repeats=1, warmup=1, prepare=lambda name: calls.append(f"prepare {name}")
    )
    assert calls == ["prepare a", "a", "prepare b", "b", "prepare b", "b", "prepare a", "a"]
