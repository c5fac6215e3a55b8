"""`specserve generate` end to end, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specserve.api.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_generate_json_on_tiny_model(tiny_llama_dir):
    r = run_cli(
        "generate",
        "--model-path",
        str(tiny_llama_dir),
        "--prompt",
        "hello",
        "--output",
        "json",
        "--quantization-encoding",
        "float32",
        "--max-kv-cache-tokens",
        "2048",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in (
        "text",
        "token_ids",
        "prompt_tokens",
        "generated_tokens",
        "finish_reason",
        "elapsed_s",
        "decode_tokens_per_s",
        "spec",
    ):
        assert key in out
    assert out["generated_tokens"] == 6 == len(out["token_ids"])
    assert out["spec"]["method"] == "ngram"
    assert set(out["spec"]) >= {
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "acceptance_rate",
        "mean_acceptance_length",
        "per_position_acceptance",
    }


def test_generate_appends_every_step_to_the_step_log(tiny_llama_dir, tmp_path):
    """One JSON line per engine step: the StepRecord's fields, when it ended, and how many of its
    requests had speculation on. A second run appends."""
    log = tmp_path / "steps.jsonl"
    args = ["generate", "--model-path", str(tiny_llama_dir), "--prompt", "hello hello hello"]
    args += ["--quantization-encoding", "float32", "--max-kv-cache-tokens", "2048", "--max-new-tokens", "6"]
    args += ["--ignore-eos", "--step-log", str(log)]
    for run in (1, 2):
        r = run_cli(*args, timeout=300)
        assert r.returncode == 0, r.stderr
        steps = [json.loads(line) for line in log.read_text().splitlines()]
        assert sum(s["emitted_tokens"] for s in steps) == 6 * run
    assert steps[0]["prefill_tokens"] > 1 and steps[0]["num_sequences"] == 1
    assert all(s["speculating"] == 1 for s in steps)  # the default ngram proposer, on for the request
    assert {"time", "drafting", "draft_tokens", "setup_tokens", "step_seconds", "predicted_seconds"} <= set(
        steps[0]
    )
    # Every decode step the controller weighed says why it drafted what it did.
    weighed = [s for s in steps if s["predicted_tokens"] is not None and not s["quiet"]]
    assert weighed and all(s["required_gain"] >= 1.0 and 0.0 < s["gain_factor"] <= 1.0 for s in weighed)
    assert all(s["headroom"] >= 0.0 for s in weighed)


def test_env_vars_configure_flags(tiny_llama_dir):
    r = run_cli(
        "generate",
        "--prompt",
        "hello",
        "--output",
        "json",
        "--max-new-tokens",
        "4",
        env={
            "SPECSERVE_MODEL_PATH": str(tiny_llama_dir),
            "SPECSERVE_QUANTIZATION_ENCODING": "float32",
            "SPECSERVE_MAX_KV_CACHE_TOKENS": "2048",
            "SPECSERVE_SPECULATIVE_METHOD": "none",
        },
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["spec"]["method"] == "none"


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--no-such-flag"],
        ["generate", "--prompt", "x", "--max-num-steps", "many"],
        ["generate", "--prompt", "x", "--device-memory-utilization", "1.5"],
        ["generate", "--prompt", "x", "--quantization-encoding", "int3"],
        ["generate", "--prompt", "x", "--int4-group-size", "48"],
        ["generate", "--prompt", "x", "--draft-int4-group-size", "256"],
        ["generate"],
        ["generate", "--prompt", "x", "--model-path", "/no/such/dir/model"],
        ["serve", "--port", "not-a-port"],
        ["generate", "--prompt", "x", "--speculative-method", "ngram,,draft_model"],
        ["generate", "--prompt", "x", "--speculative-method", "ngram,ngram"],
        ["generate", "--prompt", "x", "--speculative-method", "auto,ngram"],
        ["generate", "--prompt", "x", "--speculative-policy", "sometimes"],
        ["generate", "--prompt", "x", "--speculative-method", "ngram,no_such_proposer"],
    ],
)
def test_bad_flags_exit_2_with_one_line(args):
    r = run_cli(*args, env={"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if "specserve: error:" in ln]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--devices", "tpu"], {}),
        (["--devices", "gpu:0,1"], {}),
        (["--draft-model-path", "/no/such/draft", "--draft-devices", "cuda0"], {}),
        ([], {"SPECSERVE_DEVICES": "metal"}),
    ],
)
def test_unknown_devices_value_is_a_one_line_error(args, env):
    """It used to mean CPU, silently."""
    r = run_cli("generate", "--prompt", "x", *args, env={"HF_HUB_OFFLINE": "1", **env}, timeout=120)
    assert r.returncode == 2
    (line,) = [ln for ln in r.stderr.splitlines() if "specserve: error:" in ln]
    assert "devices" in line and "unknown device" in line and "use cpu, gpu or gpu:N" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("value", ["gpu", "cuda", "gpu:1"])
def test_gpu_without_cuda_names_what_is_available(value):
    r = run_cli("generate", "--prompt", "x", "--devices", value, env={"HF_HUB_OFFLINE": "1"}, timeout=120)
    assert r.returncode == 2
    (line,) = [ln for ln in r.stderr.splitlines() if "specserve: error:" in ln]
    assert line.startswith(f"specserve: error: --devices {value}: no CUDA GPU") and "available: cpu" in line
    assert "Traceback" not in r.stderr


def test_help_groups_flags():
    r = run_cli("generate", "--help")
    assert r.returncode == 0
    for group in ("model:", "speculative decoding:", "engine:", "generation:"):
        assert group in r.stdout
    assert "--draft-quantization-encoding" in r.stdout and "--num-speculative-tokens" in r.stdout


def test_embedded_default_answers_in_english():
    """No model flags: the embedded SmolLM2-135M-Instruct (from its PyPI carrier) answers a simple question."""
    r = run_cli(
        "generate", "--prompt", "What is the capital of France?", "--output", "json", "--max-new-tokens", "30"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
