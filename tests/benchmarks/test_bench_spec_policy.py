"""Smoke test: the batch-1 policy benchmark (off, static K sweep, adaptive) on the tiny model."""

from __future__ import annotations

import json

from specserve.benchmarks import bench_spec_policy


def test_policy_bench_reports_oracle_and_adaptive(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--model-path", str(tiny_llama_dir), "--quantization-encoding", "float32"]
    args += ["--categories", "code,qa", "--max-tokens", "8", "--k-sweep", "1,5", "--max-length", "512"]
    args += ["--output-dir", str(out), "--no-progress"]
    assert bench_spec_policy.main(args) == 0
    report = json.loads((out / "spec_policy.json").read_text())
    assert report["schema"] == bench_spec_policy.SCHEMA
    arms = {r["arm"] for r in report["results"]}
    assert arms == {"off", "k1", "k5", "adaptive"}
    for cat in report["summary"]["per_category"]:
        assert cat["oracle_k"] in (1, 5)
        assert cat["adaptive_vs_oracle"] > 0 and cat["adaptive_vs_k5"] > 0
        assert cat["lossless"]  # float32: every arm decodes the same tokens
    static = [r for r in report["results"] if r["arm"] == "k5"]
    assert all(set(r["k_histogram"]) <= {"5", "4", "3", "2", "1", "0"} for r in static)
    assert sum(int(n) for r in static for n in r["k_histogram"].values()) > 0
    assert report["cost_curve"] and report["summary"]["adaptive_k_histogram"]
    assert "adaptive / oracle" in (out / "spec_policy.md").read_text()
    assert (out / "spec_policy.png").read_bytes()[:4] == b"\x89PNG"
