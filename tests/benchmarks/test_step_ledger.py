"""Smoke test: the step ledger (every engine step of a cell, added up by kind) on the tiny model."""

from __future__ import annotations

import json

import pytest

from specserve.api.tools import BENCH_COMMANDS
from specserve.benchmarks import step_ledger


def test_step_ledger_accounts_for_every_token_of_every_cell(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--model-path", str(tiny_llama_dir), "--quantization-encoding", "float32"]
    args += ["--modes", "off,static,adaptive", "--concurrency", "2", "--requests", "3", "--max-tokens", "12"]
    args += ["--categories", "code,qa", "--max-length", "512", "--max-kv-cache-tokens", "4096"]
    args += ["--repeats", "2", "--output-dir", str(out), "--no-progress"]
    assert step_ledger.main(args) == 0
    report = json.loads((out / "step_ledger.json").read_text())
    assert report["schema"] == step_ledger.SCHEMA
    cells = report["cells"]
    assert sorted((c["mode"], c["repeat"]) for c in cells) == [
        (m, r) for m in ("adaptive", "off", "static") for r in (0, 1)
    ]
    for cell in cells:
        assert cell["tokens"] == 3 * 12  # EOS ignored
        kinds = cell["ledger"]
        # Every emitted token was emitted by one step of one kind; the steps ran inside the cell's time.
        assert sum(kinds[k]["tokens"] for k in step_ledger.KINDS if k in kinds) == cell["tokens"]
        assert sum(kinds[k]["seconds"] for k in step_ledger.KINDS if k in kinds) <= cell["seconds"]
        assert kinds["prefill"]["steps"] >= 1
        if cell["mode"] == "off":
            assert not {"drafting", "probe"} & set(kinds)
        if cell["mode"] == "static":
            assert kinds["drafting"]["steps"] >= 1
    assert set(report["summary"]["vs_off"]) == {"static", "adaptive"}
    assert "| cell | steps |" in (out / "step_ledger.md").read_text()
    assert (out / "step_ledger.png").read_bytes()[:4] == b"\x89PNG"


def _refusal(tiny_llama_dir, tmp_path, *flags: str) -> str:
    """The message `bench ledger` exits with for these flags (it must refuse them)."""
    with pytest.raises(SystemExit) as exc:
        step_ledger.main(["--model-path", str(tiny_llama_dir), *flags, "--output-dir", str(tmp_path)])
    return str(exc.value)


def test_unknown_mode_is_a_one_line_error(tiny_llama_dir, tmp_path, capsys):
    assert BENCH_COMMANDS["ledger"][0] == step_ledger.__name__  # `specserve bench ledger`
    assert "--modes takes off, static, adaptive" in _refusal(tiny_llama_dir, tmp_path, "--modes", "off,fast")


def test_admit_per_step_prefills_arriving_prompts_in_steps_of_their_own(tiny_llama_dir, tmp_path):
    """All at once, a free slot's prompts share one prefill step; one per step (as served requests
    arrive), every prompt starts in a step of its own."""
    prefill_steps = {}
    for admit in (0, 1):
        out = tmp_path / f"admit{admit}"
        args = ["--model-path", str(tiny_llama_dir), "--quantization-encoding", "float32"]
        args += ["--modes", "off", "--concurrency", "3", "--requests", "3", "--max-tokens", "6"]
        args += ["--categories", "qa", "--max-length", "512", "--max-kv-cache-tokens", "4096"]
        args += ["--admit-per-step", str(admit), "--output-dir", str(out), "--no-progress", "--no-plots"]
        assert step_ledger.main(args) == 0
        report = json.loads((out / "step_ledger.json").read_text())
        assert report["config"]["admit_per_step"] == admit
        (cell,) = report["cells"]
        assert cell["tokens"] == 3 * 6
        prefill_steps[admit] = cell["ledger"]["prefill"]["steps"]
        if admit:
            assert "at most 1 admitted per step" in (out / "step_ledger.md").read_text()
    assert prefill_steps == {0: 1, 1: 3}


def test_negative_admit_per_step_is_a_one_line_error(tiny_llama_dir, tmp_path):
    message = _refusal(tiny_llama_dir, tmp_path, "--admit-per-step", "-1")
    assert "--admit-per-step must be 0 (all at once) or positive" in message
