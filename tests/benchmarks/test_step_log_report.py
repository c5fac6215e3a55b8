"""`specserve bench steps`: a real engine's step log, cut into runs of one mode and added up."""

from __future__ import annotations

import json
import time

import pytest

from specserve.api.tools import BENCH_COMMANDS
from specserve.benchmarks import step_log_report
from specserve.engine import SamplingParams


def test_a_step_log_is_cut_into_runs_of_one_mode_that_account_for_every_token(tiny_llama_dir, tmp_path):
    from tiny_models import make_llm, mixed_prompts

    log = tmp_path / "steps.jsonl"
    llm = make_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=3, step_log=str(log))
    prompts = mixed_prompts(3, seed=5)
    emitted = []
    for enabled in (False, True, False):  # cells as bench serve runs them: off, on, off
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative_enabled=enabled)
        outs = llm.generate(prompts, params, use_chat_template=False)
        emitted.append(sum(len(o.token_ids) for o in outs))
    out = tmp_path / "report"
    assert BENCH_COMMANDS["steps"][0] == step_log_report.__name__  # `specserve bench steps`
    assert (
        step_log_report.main([str(log), "--output-dir", str(out), "--no-progress", "--min-steps", "1"]) == 0
    )
    report = json.loads((out / "step_log.json").read_text())
    assert report["schema"] == step_log_report.SCHEMA
    cells = report["cells"]
    assert [c["mode"] for c in cells] == ["off", "on", "off"]
    assert [c["tokens"] for c in cells] == emitted == [48, 48, 48]
    for cell in cells:
        kinds = cell["ledger"]
        assert sum(kinds[k]["tokens"] for k in step_log_report.KINDS if k in kinds) == cell["tokens"]
        assert cell["max_sequences"] == 3
    assert "drafting" in cells[1]["ledger"] and "drafting" not in cells[0]["ledger"]
    assert "| run | most sequences |" in (out / "step_log.md").read_text()
    assert (out / "step_log.png").read_bytes()[:4] == b"\x89PNG"
    # The "on" run's decode steps were decided by the controller: the cost model's fit against them
    # (3 sequences: one bucket, no spread of sequences, so only base and the draft row are fitted).
    (fit,) = report["cost_fit"]
    assert fit["sequences"] == "2-3" and fit["steps"] >= 8
    assert fit["measured"]["per_sequence_ms"] is None and fit["measured"]["base_ms"] > 0
    assert "| sequences | steps (drafting) |" in (out / "step_log.md").read_text()


def test_a_serve_report_cuts_the_log_by_its_cells_times(tiny_llama_dir, tmp_path):
    """Two cells of one mode in a row are one run by mode; with the bench serve report's cell times
    they stay two cells, and steps outside every cell (a warm-up) are left out."""
    from tiny_models import make_llm, mixed_prompts

    log = tmp_path / "steps.jsonl"
    llm = make_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=3, step_log=str(log))
    prompts = mixed_prompts(2, seed=6)
    cells = []
    for i, enabled in enumerate((True, True, True)):  # a warm-up, then two "on" cells in a row
        params = SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True, speculative_enabled=enabled)
        started = time.time()
        llm.generate(prompts, params, use_chat_template=False)
        if i:
            cells.append(
                {
                    "concurrency": 2,
                    "mode": "adaptive",
                    "repeat": i - 1,
                    "started": started,
                    "ended": time.time(),
                }
            )
    (tmp_path / "serve.json").write_text(json.dumps({"cells": cells}))
    out = tmp_path / "report"
    args = [str(log), "--serve-report", str(tmp_path / "serve.json"), "--output-dir", str(out), "--no-plots"]
    assert step_log_report.main([*args, "--min-steps", "1"]) == 0
    report = json.loads((out / "step_log.json").read_text())
    assert [(c["mode"], c["repeat"], c["tokens"]) for c in report["cells"]] == [
        ("c2 adaptive", 0, 2 * 7),
        ("c2 adaptive", 1, 2 * 8),
    ]
    by_mode = step_log_report.runs(step_log_report.read_steps(log))
    assert [(mode, sum(s.emitted_tokens for s in steps)) for mode, steps in by_mode] == [
        ("on", 2 * (6 + 7 + 8))
    ]


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"num_sequences": 1}\n', "steps.jsonl:1: not a step log line"),
        ("not json\n", "steps.jsonl:1: not a step log line"),
        (
            '{"num_sequences": 1, "prefill_tokens": 0, "drafting": 0, "probes": 0, "setup_tokens": 0,'
            ' "emitted_tokens": 1, "step_seconds": 0.1, "draft_seconds": 0.0, "forward_seconds": 0.1}\n',
            "no 'speculating' count",
        ),
        (
            '{"num_sequences": 1, "prefill_tokens": 0, "drafting": 0, "probes": 0, "setup_tokens": 0, '
            '"emitted_tokens": 1, "step_seconds": "slow"}\n',
            "steps.jsonl:1: not a step log line",
        ),
        (None, "No such file"),
    ],
)
def test_a_log_that_is_not_a_step_log_is_a_one_line_error(tmp_path, capsys, content, message):
    log = tmp_path / "steps.jsonl"
    if content is not None:
        log.write_text(content)
    with pytest.raises(SystemExit) as exc:
        step_log_report.main([str(log), "--output-dir", str(tmp_path / "out"), "--no-plots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_serve_report_without_cell_times_is_a_one_line_error(tmp_path, capsys):
    """A serve.json from before cells carried their times cannot cut a log: said in one line."""
    log = tmp_path / "steps.jsonl"
    step = {"num_sequences": 1, "prefill_tokens": 0, "drafting": 0, "probes": 0, "setup_tokens": 0}
    step |= {"emitted_tokens": 1, "step_seconds": 0.1, "draft_seconds": 0.0, "forward_seconds": 0.1}
    log.write_text(json.dumps({**step, "speculating": 0, "time": 1.0}) + "\n")
    report = tmp_path / "serve.json"
    report.write_text(json.dumps({"cells": [{"concurrency": 1, "mode": "off", "repeat": 0}]}))
    with pytest.raises(SystemExit) as exc:
        step_log_report.main([str(log), "--serve-report", str(report), "--output-dir", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a bench serve report with cell times" in err, err
