"""bench_attention end to end on the tiny model: one row per shape, every arm timed, paired ratios."""

from __future__ import annotations

import json
import statistics

import pytest

from specserve.benchmarks import bench_attention


@pytest.mark.parametrize("thread", ["worker", "main"])
def test_tiny_run_times_both_backends_for_every_shape(tiny_llama_dir, tmp_path, capsys, thread):
    rc = bench_attention.main(
        [
            "--thread", thread,
            "--model-path", str(tiny_llama_dir),
            "--sequences", "1,3",
            "--context", "40",
            "--queries", "1,20",
            "--repeats", "2",
            "--context-spread", "0.5",
            "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(tmp_path / "out"),
            "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "out" / "attention.json").read_text())
    assert report["schema"] == bench_attention.SCHEMA and report["config"]["thread"] == thread
    shapes = [(r["sequences"], r["context"], r["queries"]) for r in report["results"]]
    assert shapes == [(1, 40, 1), (1, 40, 20), (3, 40, 1), (3, 40, 20)]
    assert [r["contexts"] for r in report["results"]] == [[40], [40], [20, 30, 40], [20, 30, 40]]
    assert report["default_backend"] == "cpu_sdpa_prefill_kernel_decode"  # gcc is on this machine
    for row in report["results"]:
        assert len(row["sdpa_ms"]) == len(row["matmul_ms"]) == len(row["default_ms"]) == 2
        assert min(row["sdpa_ms"] + row["matmul_ms"] + row["default_ms"]) > 0
        for arm in ("sdpa", "matmul"):
            ratios = [a / b for a, b in zip(row[f"{arm}_ms"], row["default_ms"], strict=True)]
            assert row[f"{arm}_over_default"] == pytest.approx(statistics.median(ratios))
    assert (tmp_path / "out" / "attention.png").exists()
    assert "| sequences | context |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--sequences", "0,4"],
        ["--context", "many"],
        ["--repeats", "0"],
        ["--thread", "other"],
        ["--context-spread", "1"],
        ["--context-spread", "wide"],
    ],
)
def test_bad_arguments_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error:" in err[-1]
