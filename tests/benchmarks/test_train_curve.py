"""train_curve reads train-draft reports into a table and a plot."""

from __future__ import annotations

import json

import pytest

from specserve.benchmarks import train_curve


def _report(tmp_path, method="eagle"):
    curve = [
        {
            "step": s,
            "elapsed_seconds": 60.0 * s,
            "tokens_seen": 100 * s,
            "all": {"chain_acceptance": [0.1 * s, 0.05 * s], "expected_acceptance_length": 1 + 0.15 * s},
        }
        for s in (0, 1, 2)
    ]
    path = tmp_path / method / "train_report.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"method": method, "curve": curve}))
    return path


def test_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert (
        train_curve.main([str(_report(tmp_path)), str(_report(tmp_path, "medusa")), "--plot", str(png)]) == 0
    )
    out = capsys.readouterr().out
    assert "| 2 | 2.0 | 200 | 0.20 0.10 | 1.300 |" in out and "### medusa" in out
    assert png.stat().st_size > 1000


def test_not_a_report_is_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="not a train-draft report"):
        train_curve.main([str(bad)])
