"""Smoke test: plain / ngram / medusa / eagle / draft model side by side on the tiny model (random heads, float32)."""

from __future__ import annotations

import json

import torch

from specserve.benchmarks import bench_medusa
from specserve.plugins.medusa import build_heads, save_medusa_heads


def test_medusa_bench_reports_acceptance_and_cost(tiny_llama_dir, tmp_path, eagle_head_dir):
    torch.manual_seed(0)
    heads = build_heads(num_heads=3, num_layers=1, hidden=64, vocab=32)
    save_medusa_heads(tmp_path / "heads", heads, 1, {"vocab_size": 320}, torch.arange(32))
    out = tmp_path / "out"
    args = ["--model-path", str(tiny_llama_dir), "--quantization-encoding", "float32"]
    args += ["--medusa-heads-path", str(tmp_path / "heads"), "--eagle-head-path", str(eagle_head_dir)]
    # The target as its own (float32) draft model: every draft is accepted.
    args += ["--draft-model-path", str(tiny_llama_dir), "--draft-quantization-encoding", "float32"]
    args += ["--arms", "plain,ngram,medusa-static,eagle-static,draft-static"]
    args += ["--per-category", "1", "--max-tokens", "8", "--repeats", "1", "--max-length", "512"]
    args += ["--output-dir", str(out), "--no-progress", "--threads", "1"]
    assert bench_medusa.main(args) == 0
    report = json.loads((out / "medusa.json").read_text())
    assert report["schema"] == bench_medusa.SCHEMA
    assert {r["arm"] for r in report["results"]} == {
        "plain",
        "ngram",
        "medusa-static",
        "eagle-static",
        "draft-static",
    }
    for block in [report["summary"]["all"], *report["summary"]["per_category"].values()]:
        assert all(arm["same_tokens_as_plain"] for arm in block.values())  # float32: lossless
        medusa = block["medusa-static"]
        assert medusa["draft_ms_per_round"] > 0 and len(medusa["per_position_acceptance"]) == 3
        assert block["plain"]["vs_plain"] == 1.0
        eagle = block["eagle-static"]
        assert eagle["draft_ms_per_round"] > 0 and eagle["per_position_acceptance"]
        assert block["draft-static"]["acceptance_rate"] == 1.0
    assert "draft / plain step" in (out / "medusa.md").read_text()
