"""Smoke test: `specserve bench serve --quick` against a real server on 127.0.0.1, and its JSON."""

from __future__ import annotations

import json

import pytest
from server_harness import start_server

from specserve.benchmarks import serve


def test_serve_quick_smoke(tiny_llama_dir, tmp_path):
    # The static policy drafts every step it may: whether the adaptive one drafts within 12 tokens
    # depends on the step times it measures (under the full suite's load it once drafted nothing).
    server = start_server(tiny_llama_dir, tmp_path, "--speculative-policy", "static")
    try:
        out = tmp_path / "out"
        code = serve.main(
            [
                "--quick",
                "--base-url",
                server.base_url,
                "--concurrency",
                "1,2",
                "--requests-per-level",
                "2",
                "--max-tokens",
                "12",
                "--categories",
                "qa,code",
                "--output-dir",
                str(out),
                "--no-progress",
            ]
        )
    finally:
        server.stop()
    assert code == 0
    report = json.loads((out / "serve.json").read_text())
    assert report["schema"] == serve.SCHEMA
    assert {"created", "command", "machine", "server", "config", "summary", "cells", "files"} <= set(report)
    assert [(c["concurrency"], c["mode"]) for c in report["cells"]] == [
        (1, "off"),
        (1, "on"),
        (2, "on"),
        (2, "off"),
    ]
    for cell in report["cells"]:
        assert cell["completed"] == 2 and cell["failed"] == 0
        assert cell["output_tokens"] == 24  # EOS ignored, 12 tokens each
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert set(cell[key]) == {"p50", "p90", "p99"}
        assert cell["ttft_s"]["p50"] > 0 and cell["output_tokens_per_s"] > 0
        # The per-request toggle really turns speculation off (ngram on the server by default).
        assert (cell["acceptance_rate"] is None) == (cell["mode"] == "off")
    # Each cell's wall-clock window (what `bench steps --serve-report` cuts a step log by), in order.
    windows = [(c["started"], c["ended"]) for c in report["cells"]]
    assert all(a <= b for a, b in windows)
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(windows, windows[1:], strict=False))
    summ = report["summary"]
    assert [s["concurrency"] for s in summ] == [1, 2]
    assert all(s["spec_speedup_output_tokens_per_s"] > 0 for s in summ)
    assert (out / "serve.png").read_bytes()[:4] == b"\x89PNG"
    assert "| concurrency |" in (out / "serve.md").read_text()


def test_serve_compares_static_and_adaptive_with_off(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path)
    try:
        out = tmp_path / "out"
        args = ["--base-url", server.base_url, "--concurrency", "1", "--requests-per-level", "2"]
        args += ["--max-tokens", "8", "--categories", "code", "--warmup", "0", "--no-progress"]
        args += ["--modes", "off,static,adaptive", "--static-k", "3", "--output-dir", str(out)]
        code = serve.main(args)
    finally:
        server.stop()
    assert code == 0
    report = json.loads((out / "serve.json").read_text())
    assert {c["mode"] for c in report["cells"]} == {"off", "static", "adaptive"}
    row = report["summary"][0]
    assert row["static_vs_off"] > 0 and row["adaptive_vs_off"] > 0
    assert row["off"]["mean_k"] == 0
    assert 2 <= row["static"]["mean_k"] <= 3  # k = 3 every step, less only where few tokens are left
    assert 0 <= row["adaptive"]["mean_k"] <= 32
    text = (out / "serve.md").read_text()
    assert "adaptive / off" in text and "mean k static" in text


def test_bad_static_k_and_mode_are_refused(capsys):
    assert serve.main(["--base-url", "http://127.0.0.1:1", "--static-k", "99", "--no-progress"]) == 2
    assert "--static-k" in capsys.readouterr().err
    assert serve.main(["--base-url", "http://127.0.0.1:1", "--modes", "off,fast", "--no-progress"]) == 2
    assert "--modes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1:1", "http://192.168.1.2"]
)
def test_refuses_non_loopback(url):
    with pytest.raises(serve.BenchError):
        serve.check_loopback(url)


def test_remote_needs_allow_remote_and_api_key():
    url = "https://specserve.llm.svc.cluster.local:8000/v1"
    with pytest.raises(serve.BenchError, match="--allow-remote"):
        serve.check_loopback(url, api_key="k")  # a key alone is not the explicit opt-in
    with pytest.raises(serve.BenchError, match="--api-key"):
        serve.check_loopback(url, allow_remote=True)
    assert serve.check_loopback(url, allow_remote=True, api_key="k") == url.removesuffix("/v1")
    with pytest.raises(serve.BenchError, match="must look like"):
        serve.check_loopback("ftp://10.0.0.1:1", allow_remote=True, api_key="k")


def test_remote_flags_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    out = ["--output-dir", str(tmp_path)]
    assert serve.main(["--base-url", "http://10.0.0.1:8000", "--allow-remote", *out]) == 2
    assert "needs --api-key" in capsys.readouterr().err
    assert serve.main(["--launch", "--allow-remote", *out]) == 2
    assert "only applies to --base-url" in capsys.readouterr().err


def test_accepts_loopback():
    assert serve.check_loopback("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert serve.check_loopback("http://localhost:9") == "http://localhost:9"
    assert serve.check_loopback("http://[::1]:9") == "http://[::1]:9"


def test_plan_is_bounded(tmp_path, capsys):
    code = serve.main(
        [
            "--base-url",
            "http://127.0.0.1:1",
            "--concurrency",
            "64",
            "--requests-per-level",
            "1000",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 2 and "max-total-requests" in capsys.readouterr().err
    code = serve.main(["--base-url", "http://8.8.8.8:80", "--output-dir", str(tmp_path)])
    assert code == 2


def test_request_lengths_spread_the_same_way_for_every_mode():
    lengths = [serve.request_max_tokens(32, 0.5, i) for i in range(200)]
    assert lengths == [serve.request_max_tokens(32, 0.5, i) for i in range(200)]  # by index alone
    assert min(lengths) == 16 and max(lengths) == 48  # uniform over [16, 48]: both ends come up
    assert 28 < sum(lengths) / len(lengths) < 36
    assert {serve.request_max_tokens(32, 0.0, i) for i in range(50)} == {32}
    assert serve.max_tokens_range(1, 0.9) == (1, 2)


def test_mixed_lengths_against_a_server(tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir, tmp_path)
    try:
        out = tmp_path / "out"
        args = ["--base-url", server.base_url, "--concurrency", "2", "--requests-per-level", "6"]
        args += ["--max-tokens", "10", "--max-tokens-range-ratio", "0.5", "--categories", "qa"]
        args += ["--modes", "off,adaptive", "--warmup", "0", "--no-progress", "--output-dir", str(out)]
        code = serve.main(args)
    finally:
        server.stop()
    assert code == 0
    report = json.loads((out / "serve.json").read_text())
    assert report["config"]["max_tokens_range"] == [5, 15]
    totals = {c["mode"]: c["output_tokens"] for c in report["cells"]}
    expected = sum(serve.request_max_tokens(10, 0.5, i) for i in range(6))
    assert totals == {"off": expected, "adaptive": expected} and expected != 60
    assert "5-15 (uniform per request" in (out / "serve.md").read_text()


def test_bad_range_ratio_is_refused(capsys):
    args = ["--base-url", "http://127.0.0.1:1", "--no-progress", "--max-tokens-range-ratio", "1"]
    assert serve.main(args) == 2
    assert "--max-tokens-range-ratio must be in [0, 1)" in capsys.readouterr().err


def test_requests_per_client_sizes_each_cell():
    def plan(*argv: str) -> dict[int, int]:
        args = serve.build_parser().parse_args(
            ["--base-url", "http://127.0.0.1:1", "--concurrency", "1,4,16", *argv]
        )
        return serve._plan(args)[2]

    assert plan() == {1: 4, 4: 8, 16: 32}  # the default: 2 a client, at least 4
    assert plan("--requests-per-client", "5") == {1: 5, 4: 20, 16: 80}
    assert plan("--requests-per-client", "5", "--requests-per-level", "6") == {1: 6, 4: 6, 16: 6}


def test_bad_requests_per_client_is_refused(capsys):
    args = ["--base-url", "http://127.0.0.1:1", "--no-progress", "--requests-per-client", "0"]
    assert serve.main(args) == 2
    assert "--requests-per-client must be at least 1" in capsys.readouterr().err
