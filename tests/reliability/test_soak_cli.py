"""`specserve soak`: argument checking (loopback only, exit 2) and a short real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specserve.benchmarks import soak


@pytest.mark.parametrize(
    "argv",
    [
        ["--base-url", "http://10.1.2.3:8000"],
        ["--base-url", "http://example.com:8000"],
        ["--base-url", "https://127.0.0.1:8000"],
        ["--base-url", "http://127.0.0.1:99999"],
        ["--duration", "5x"],
        ["--duration", "0"],
        ["--duration", "48h"],
        ["--concurrency", "0"],
        ["--concurrency", "many"],
        ["--server-pid", "999999999"],
        ["--bogus"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        soak.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve soak: error: ") and err.count("\n") == 1, err


def test_loopback_forms_accepted():
    for url in (
        "http://127.0.0.1:8000",
        "http://localhost:8000/",
        "http://[::1]:8000/v1",
        "http://127.0.0.2:1",
    ):
        assert soak.check_loopback(url).startswith("http://")


def test_short_soak_run_via_the_cli(roomy_server, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        "-m",
        "specserve.api.cli",
        "soak",
        "--base-url",
        roomy_server.api_url,
        "--duration",
        "4s",
        "--concurrency",
        "8",
        "--server-pid",
        str(roomy_server.process.pid),
        "--sample-interval",
        "1",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "requests: ok" in proc.stdout and "p99" in proc.stdout and "server memory" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["ok"] > 0 and summary["failed"] == 0
    assert summary["memory"]["samples"] >= 3 and summary["memory"]["first_mib"] > 50
    assert "api_key" not in json.loads(out.read_text())["args"]
