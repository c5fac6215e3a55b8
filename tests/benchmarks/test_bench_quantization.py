"""bench_quantization end to end on the tiny models: its JSON, its ratios and its lossless check."""

from __future__ import annotations

import json

import pytest

from specserve.benchmarks import bench_quantization


def test_tiny_run_reports_every_config_and_int4_speculation_matches_int4_plain(
    tiny_llama_dir, tiny_draft_dir, tmp_path, capsys
):
    out = tmp_path / "q.json"
    configs = ["bf16 plain", "int4 plain", "int4 + int4 draft"]
    rc = bench_quantization.main(
        [
            "--target", str(tiny_llama_dir),
            "--draft", str(tiny_draft_dir),
            "--configs", ",".join(configs),
            "--repeats", "2",
            "--max-tokens", "12",
            "--mode", "e2e",
            "--cache-dir", str(tmp_path / "cache"),
            "--json-out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert list(summary) == configs  # no llama.cpp row: the tiny target is not a GGUF
    assert len(report["runs"]) == 2 * len(configs)
    for name in configs:
        row = summary[name]
        assert row["decode_tok_s_median"] > 0 and len(row["decode_tok_s"]) == 2
        assert row["speedup_vs_bf16_plain"] == pytest.approx(
            row["decode_tok_s_median"] / summary["bf16 plain"]["decode_tok_s_median"]
        )
        assert row["speedup_vs_llama_cpp"] is None
    spec = summary["int4 + int4 draft"]
    assert spec["k"] == 3  # the engine's default for a quantized target
    assert 0 <= spec["acceptance_rate"] <= 1 and 1 <= spec["mean_accepted_len"] <= 4
    # Lossless with respect to its own (quantized) target, token for token.
    assert spec["same_tokens_as_own_plain"] is True
    assert summary["int4 plain"]["same_tokens_as_own_plain"] is None  # plain has nothing to match
    assert summary["bf16 plain"]["same_tokens_as_bf16_plain"] is True
    table = capsys.readouterr().out
    assert "| int4 + int4 draft | 3 |" in table


def test_unknown_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_quantization.main(["--configs", "int4 plain,int3 plain", "--mode", "e2e"])
    assert exc.value.code == 2
    assert "unknown config 'int3 plain'" in capsys.readouterr().err
