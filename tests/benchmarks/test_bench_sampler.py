"""bench_sampler end to end on the tiny model: every operation and shape timed in both arms, paired ratios."""

from __future__ import annotations

import json
import statistics

import pytest

from specserve.benchmarks import bench_sampler


def test_tiny_run_times_both_arms_for_every_operation_and_shape(tiny_llama_dir, tmp_path, capsys):
    rc = bench_sampler.main(
        [
            "--model-path", str(tiny_llama_dir),
            "--sequences", "1,3",
            "--rows-each", "1,4",
            "--repeats", "2",
            "--cache-dir", str(tmp_path / "cache"),
            "--output-dir", str(tmp_path / "out"),
            "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "out" / "sampler.json").read_text())
    assert report["schema"] == bench_sampler.SCHEMA
    shapes = [(r["operation"], r["sequences"], r["rows_each"]) for r in report["results"]]
    assert shapes == [(op, s, r) for op in ("greedy", "top_k", "top_p") for s in (1, 3) for r in (1, 4)]
    for row in report["results"]:
        assert len(row["whole_ms"]) == len(row["shortcut_ms"]) == 2
        assert min(row["whole_ms"] + row["shortcut_ms"]) > 0
        ratios = [a / b for a, b in zip(row["whole_ms"], row["shortcut_ms"], strict=True)]
        assert row["whole_over_shortcut"] == pytest.approx(statistics.median(ratios))
    assert (tmp_path / "out" / "sampler.png").exists()
    assert "| operation | sequences |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--sequences", "0"],
        ["--rows-each", "x"],
        ["--repeats", "0"],
        ["--top-k", "-1"],
        ["--top-p", "1.0"],
        ["--temperature", "0"],
    ],
)
def test_bad_arguments_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_sampler.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error:" in err[-1]


def test_the_recorded_command_runs_the_module(tiny_llama_dir, tmp_path):
    argv = ["--model-path", str(tiny_llama_dir), "--sequences", "1", "--rows-each", "1", "--repeats", "1"]
    argv += ["--output-dir", str(tmp_path), "--no-progress", "--no-plots"]
    assert bench_sampler.main(argv) == 0
    report = json.loads((tmp_path / "sampler.json").read_text())
    assert report["command"].startswith("python -m specserve.benchmarks.bench_sampler --model-path ")
