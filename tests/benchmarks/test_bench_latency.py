"""Smoke test: `specserve bench latency --quick` on a tiny random model, and the JSON it writes."""

from __future__ import annotations

import json

import pytest

from specserve.api import tools
from specserve.benchmarks import latency, response_format
from specserve.benchmarks.prompt_sets import Prompt

RUN_KEYS = {
    "method",
    "prompt_id",
    "category",
    "repeat",
    "prompt_tokens",
    "generated_tokens",
    "elapsed_s",
    "first_token_s",
    "tokens_per_s",
    "decode_tokens_per_s",
    "identical_to_plain",
    "spec",
    "draft_s",
    "verify_s",
}
OVERALL_KEYS = {
    "median_tokens_per_s",
    "median_decode_tokens_per_s",
    "speedup_vs_specserve_plain",
    "speedup_vs_transformers_plain",
    "greedy_identical_to_plain",
    "spec",
    "draft_s",
    "verify_s",
}


def test_latency_quick_smoke(tiny_llama_dir, tiny_draft_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "--quick",
        "--model-path",
        str(tiny_llama_dir),
        "--draft-model-path",
        str(tiny_draft_dir),
        "--quantization-encoding",
        "float32",
        "--max-new-tokens",
        "6",
        "--categories",
        "qa,code",
        "--throughput-batch",
        "2",
        # Static: every step drafts, so the report's speculation statistics have something to show
        # (under the adaptive default a 6-token run on this tiny pair may draft nothing at all).
        "--speculative-policy",
        "static",
        "--output-dir",
        str(out),
        "--no-progress",
    ]
    with pytest.raises(SystemExit) as exc:
        tools.main("bench", ["latency", *argv])
    assert exc.value.code == 0
    assert "specserve:plain" in capsys.readouterr().out

    report = json.loads((out / "latency.json").read_text())
    assert report["schema"] == latency.SCHEMA
    assert {
        "created",
        "command",
        "machine",
        "config",
        "methods",
        "prompts",
        "summary",
        "runs",
        "files",
    } <= set(report)
    methods = [m["name"] for m in report["methods"]]
    # Every method applies (a draft was given) except llama.cpp: the tiny model is not a GGUF, or
    # llama-cpp-python is not installed; either way the report says why.
    assert methods == [m for m in latency.ALL_METHODS if m != latency.LC_PLAIN]
    assert latency.LC_PLAIN in report["unavailable"]
    assert report["config"]["repeats"] == 2 and report["config"]["max_new_tokens"] == 6
    assert report["config"]["speculative_policy"] == "static"
    assert len(report["runs"]) == 2 * len(report["prompts"]) * len(methods)
    for run in report["runs"]:
        assert set(run) >= RUN_KEYS
        assert run["generated_tokens"] == 6  # EOS ignored: every method does the same work
    for m in methods:
        overall = report["summary"][m]["overall"]
        assert set(overall) >= OVERALL_KEYS
        assert set(report["summary"][m]["by_category"]) == {"qa", "code"}
    spec = report["summary"]["specserve:draft_model"]["overall"]
    assert spec["spec"]["num_drafts"] > 0 and 1 <= len(spec["spec"]["per_position_acceptance"]) <= 5
    assert spec["draft_s"] > 0 and spec["verify_s"] > 0
    # float32 greedy speculation is lossless: identical to plain, token for token.
    for m in ("specserve:ngram", "specserve:draft_model"):
        assert report["summary"][m]["overall"]["greedy_identical_to_plain"] is True
    assert report["summary"]["specserve:plain"]["overall"]["speedup_vs_specserve_plain"] == 1.0
    assert report["throughput"]["batch"] == 2 and report["throughput"]["ratio_vs_batch1"] > 0
    assert (out / "latency.md").read_text().startswith("# specserve bench latency")
    for png in ("latency_speedup.png", "latency_acceptance.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_latency_unknown_method_and_missing_draft(tiny_llama_dir, tmp_path):
    with pytest.raises(SystemExit, match="unknown method"):
        latency.main(
            ["--model-path", str(tiny_llama_dir), "--methods", "warp", "--output-dir", str(tmp_path)]
        )
    with pytest.raises(SystemExit, match="need --draft-model-path"):
        latency.main(
            ["--model-path", str(tiny_llama_dir), "--methods", "draft_model", "--output-dir", str(tmp_path)]
        )


STRUCTURED_KEYS = {
    "n",
    "valid_fraction",
    "parses_fraction",
    "num_hit_length",
    "forced_tokens_per_output",
    "mean_generated_tokens",
    "grammar_s",
    "grammar_fraction",
    "grammar_decode_fraction",
}


def test_latency_response_format_json_schema(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    argv = [
        "--model-path",
        str(tiny_llama_dir),
        "--quantization-encoding",
        "float32",
        "--response-format",
        "json_schema",
        "--methods",
        "plain,ngram",
        "--categories",
        "qa,code",
        "--prompts-per-category",
        "1",
        "--max-new-tokens",
        "48",
        "--repeats",
        "1",
        "--output-dir",
        str(out),
        "--no-progress",
        "--no-plots",
    ]
    assert latency.main(argv) == 0
    report = json.loads((out / "latency.json").read_text())
    assert report["schema"] == latency.SCHEMA == "specserve.bench.latency/2"
    assert report["config"]["response_format"] == "json_schema"
    # Schemas cycle through the sorted names by prompt index.
    names = sorted(response_format.load_schemas())
    assert [p["schema_name"] for p in report["prompts"]] == names[:2]
    assert "cannot constrain" in report["unavailable"][latency.HF_PLAIN]
    for run in report["runs"]:
        assert {"schema_name", "grammar_s", "num_forced_tokens", "json_valid", "hit_length", "text"} <= set(
            run
        )
        assert run["grammar_s"] > 0
        # The grammar makes every output valid unless the token limit cut it.
        assert run["json_valid"] or run["hit_length"], run
    for m in ("specserve:plain", "specserve:ngram"):
        structured = report["summary"][m]["overall"]["structured"]
        assert set(structured) == STRUCTURED_KEYS
        assert 0 < structured["grammar_fraction"] < structured["grammar_decode_fraction"] < 1
    # Forced tokens are free drafts, so only the speculative arm has them; greedy output is unchanged.
    ngram = report["summary"]["specserve:ngram"]["overall"]
    assert ngram["structured"]["forced_tokens_per_output"] > 0
    assert ngram["greedy_identical_to_plain"] is True
    assert report["summary"]["specserve:plain"]["overall"]["structured"]["forced_tokens_per_output"] == 0
    assert "valid JSON" in (out / "latency.md").read_text()


def test_latency_response_format_refuses_unconstrained_methods(tiny_llama_dir, tmp_path, capsys):
    argv = ["--model-path", str(tiny_llama_dir), "--output-dir", str(tmp_path), "--response-format"]
    with pytest.raises(SystemExit) as exc:
        latency.main([*argv, "json_object", "--methods", "plain,hf_plain"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "transformers:plain cannot constrain output" in err


def test_response_format_prompts_and_checks():
    prompt = Prompt(
        "chat-1",
        "multi_turn",
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "list two"},
        ],
    )
    constraint = response_format.assign([prompt], "json_schema")["chat-1"]
    asked = response_format.with_instruction(prompt, constraint)
    assert asked.messages[:2] == prompt.messages[:2]  # earlier turns untouched
    assert prompt.messages[2]["content"] == "list two"  # the original is not mutated
    assert asked.messages[2]["content"].startswith(
        "list two\n\nAnswer only with JSON matching this schema: {"
    )
    assert response_format.assign([prompt], "text") == {}
    obj = response_format.Constraint("json_object")
    assert response_format.check('{"a":1}', obj, "stop")["json_valid"]
    assert response_format.check("[1]", obj, "stop")["json_error"] == "not an object"
    cut = response_format.check('{"a":1}', obj, "length")
    assert cut["json_parses"] and not cut["json_valid"] and cut["hit_length"]
    schema = response_format.Constraint("json_schema", "s", {"type": "object", "required": ["a"]})
    bad = response_format.check("{}", schema, "stop")
    assert bad["json_parses"] and not bad["json_valid"] and bad["json_error"].startswith("schema:")
    assert response_format.check("{", schema, "stop")["json_error"] == "not JSON"


def test_tools_dispatch(capsys):
    with pytest.raises(SystemExit) as exc:
        tools.main("bench", ["nope"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        tools.main("bench", [])
    assert exc.value.code == 2 and "latency" in capsys.readouterr().out


def test_soak_not_available_yet(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "specserve.benchmarks.soak" else real(name, *a),
    )
    with pytest.raises(SystemExit) as exc:
        tools.main("soak", [])
    assert exc.value.code == 2
    assert "specserve soak: not available yet" in capsys.readouterr().err
