"""`specserve train-draft`: bad input is one error line and exit code 2; a tiny run writes a head."""

from __future__ import annotations

import json

import pytest

from specserve.api.cli import main


def _fails(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["train-draft", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specserve: error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--method", "eagle"], "--output DIR is required"),
        (
            ["--method", "eagle", "--output", "x", "--num-heads", "3"],
            "--num-heads: not a --method eagle option",
        ),
        (["--method", "eagle", "--output", "x", "--projection-lr", "0"], "not a --method eagle option"),
        (["--method", "medusa", "--output", "x", "--unroll", "2"], "--unroll: not a --method medusa option"),
        (["--method", "eagle", "--output", "x", "--unroll", "0"], "--unroll must be in [1, 8]"),
        (["--method", "eagle", "--output", "x", "--lr", "0"], "--lr must be > 0"),
        (["--method", "lookahead", "--output", "x"], "--method must be one of medusa, eagle"),
        (["--method", "medusa"], "--output DIR is required"),
        (["--method", "medusa", "--output", "x", "--num-heads", "0"], "--num-heads"),
        (["--method", "medusa", "--output", "x", "--draft-vocab-size", "0"], "--draft-vocab-size"),
        (["--method", "medusa", "--output", "x", "--max-minutes", "-1"], "--max-minutes"),
        (["--method", "medusa", "--output", "x", "--precision", "int4"], "--precision"),
        (["--method", "medusa", "--output", "x", "--max-steps", "ten"], "invalid int value"),
        (["--method", "medusa", "--output", "x", "--no-such-flag"], "unrecognized arguments"),
        (
            ["--method", "eagle", "--output", "x", "--data-from", "y", "--distill-prompts", "8"],
            "--data-from takes that run's data set as it is: drop --distill-prompts",
        ),
        (
            ["--method", "medusa", "--output", "x", "--data-from", "y", "--code-tokens", "9"],
            "drop --code-tokens",
        ),
    ],
)
def test_bad_arguments_are_one_line_exit_2(capsys, argv, match):
    assert match in _fails(capsys, *argv)


def test_bad_input_found_at_start_up_is_one_line_exit_2(capsys, tiny_llama_dir, tmp_path):
    common = ["--method", "medusa", "--model-path", str(tiny_llama_dir), "--threads", "1", "--no-progress"]
    assert "--draft-vocab-size must be in [1, 320]" in _fails(
        capsys, *common, "--output", str(tmp_path / "a"), "--draft-vocab-size", "400"
    )
    assert "--resume: no checkpoint" in _fails(capsys, *common, "--output", str(tmp_path / "b"), "--resume")
    (tmp_path / "file").write_text("")
    assert "is a file" in _fails(capsys, *common, "--output", str(tmp_path / "file"))
    assert "does not exist" in _fails(
        capsys, "--method", "medusa", "--model-path", str(tmp_path / "nope"), "--output", str(tmp_path / "c")
    )
    assert "no checkpoint/data.pt there" in _fails(
        capsys, *common, "--output", str(tmp_path / "d"), "--data-from", str(tmp_path / "nothing")
    )
    other = tmp_path / "other-run" / "checkpoint"
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"model_path": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}))
    (other / "data.pt").write_bytes(b"")
    assert "built for target Qwen/Qwen2.5-Coder-1.5B-Instruct, not" in _fails(
        capsys, *common, "--output", str(tmp_path / "e"), "--data-from", str(tmp_path / "other-run")
    )


def test_tiny_run_writes_head_and_report(capsys, tiny_llama_dir, tmp_path):
    out = tmp_path / "head"
    main(
        ["train-draft", "--method", "medusa", "--model-path", str(tiny_llama_dir), "--output", str(out)]
        + ["--num-heads", "2", "--max-steps", "3", "--code-tokens", "2000", "--draft-vocab-size", "64"]
        + ["--threads", "1", "--no-progress", "--quantization-encoding", "float32"]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["hidden_size"] == 64 and config["vocab_size"] == 320
    assert (out / "draft_vocab.safetensors").exists() and (out / "train_report.json").exists()


def test_tiny_eagle_run_writes_head_and_report(capsys, tiny_llama_dir, tmp_path):
    out = tmp_path / "head"
    main(
        ["train-draft", "--method", "eagle", "--model-path", str(tiny_llama_dir), "--output", str(out)]
        + ["--max-steps", "2", "--code-tokens", "1500", "--draft-vocab-size", "64", "--eval-positions", "3"]
        + ["--threads", "1", "--no-progress"]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and len(summary["heldout_top1"]) == 3
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 64 and config["vocab_size"] == 320
    assert (out / "model.safetensors").exists() and (out / "draft_vocab.safetensors").exists()
    report = json.loads((out / "train_report.json").read_text())
    assert report["method"] == "eagle" and report["head"]["draft_vocab_size"] == 64
    # A second run on the first one's data set (another learning rate): same sequences, nothing rebuilt.
    again = tmp_path / "again"
    main(
        ["train-draft", "--method", "eagle", "--model-path", str(tiny_llama_dir), "--output", str(again)]
        + ["--data-from", str(out), "--max-steps", "1", "--lr", "5e-4", "--eval-positions", "3"]
        + ["--threads", "1", "--no-progress"]
    )
    reused = json.loads((again / "train_report.json").read_text())
    assert reused["data"]["sources"] == report["data"]["sources"] and reused["data"]["data_from"] == str(out)
    assert report["data"]["data_from"] is None and reused["data"]["distill_seconds"] == 0
