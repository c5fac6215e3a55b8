"""Logs on a real server (127.0.0.1): --log-format json lines parse, carry the request id from X-Request-Id
and the access fields, hold no prompt text; --no-access-log; bad logging flags are one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import aiohttp
import pytest
from server_harness import start_server

PROMPT = "zebra-orchid-quartz secret prompt text"  # must never reach the log


@pytest.fixture(scope="module")
def json_server(tiny_llama_dir, tmp_path_factory):
    srv = start_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("json-logs"),
        "--served-model-name",
        "tiny",
        "--log-format",
        "json",
    )
    yield srv
    srv.stop()


def _records(log: str) -> list[dict]:
    """Every line of the server's output except the ready line must be a JSON log record."""
    lines = [line for line in log.splitlines() if line.strip() and not line.startswith("Server ready on")]
    return [json.loads(line) for line in lines]


def _access(records: list[dict], request_id: str) -> dict:
    found = [r for r in records if r["logger"] == "specserve.access" and r.get("request_id") == request_id]
    assert len(found) == 1, found
    return found[0]


async def test_json_access_lines_carry_the_request_id(json_server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}
    async with aiohttp.ClientSession() as s:
        async with s.post(
            json_server.api_url + "/chat/completions", json=chat, headers={"X-Request-Id": "trace-abc.123"}
        ) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "trace-abc.123"
            usage = (await r.json())["usage"]
        # Streamed: the header is on the prepared stream too; an id with spaces is replaced.
        async with s.post(
            json_server.api_url + "/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True},
            headers={"X-Request-Id": "not a sane id"},
        ) as r:
            streamed_id = r.headers["X-Request-Id"]
            await r.read()
        async with s.post(json_server.api_url + "/completions", json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404
            failed_id = r.headers["X-Request-Id"]
        async with s.get(json_server.base_url + "/health", headers={"X-Request-Id": "probe-1"}) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "probe-1"
    assert re.fullmatch(r"[0-9a-f]{32}", streamed_id) and re.fullmatch(r"[0-9a-f]{32}", failed_id)
    json_server.stop()  # flushes and closes the log; the module's other tests do not need the server
    records = _records(json_server.log())
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    line = _access(records, "trace-abc.123")
    assert line["level"] == "INFO" and line["method"] == "POST" and line["route"] == "/v1/chat/completions"
    assert line["status"] == 200 and line["latency_s"] >= 0 and line["remote"] == "127.0.0.1"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    streamed = _access(records, streamed_id)
    assert streamed["route"] == "/v1/completions" and streamed["status"] == 200
    assert 1 <= streamed["completion_tokens"] <= 4
    assert _access(records, failed_id)["status"] == 404
    assert not [r for r in records if r.get("request_id") == "probe-1"]  # probes log at DEBUG only
    assert PROMPT not in json_server.log() and "zebra" not in json_server.log()


async def test_no_access_log(tiny_llama_dir, tmp_path):
    srv = start_server(tiny_llama_dir, tmp_path, "--no-access-log", "--log-level", "debug")
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        async with aiohttp.ClientSession() as s, s.post(srv.api_url + "/completions", json=body) as r:
            assert r.status == 200 and r.headers["X-Request-Id"]  # ids still flow without the log
    finally:
        srv.stop()
    assert "specserve.access" not in srv.log()
    assert " DEBUG " in srv.log()  # text format at the chosen level


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["--log-level", "loud"], {}, "argument --log-level: invalid choice: 'loud'"),
        (["--log-format", "xml"], {}, "argument --log-format: invalid choice: 'xml'"),
        ([], {"SPECSERVE_LOG_FORMAT": "xml"}, "--log-format: 'xml' is not one of text, json"),
        ([], {"SPECSERVE_LOG_LEVEL": "verbose"}, "--log-level: 'verbose' is not one of"),
        (
            ["--step-log", "/nonexistent-dir/steps.jsonl"],
            {},
            "--step-log /nonexistent-dir/steps.jsonl: no directory",
        ),
        (["--step-log", "/"], {}, "--step-log /: is a directory"),
    ],
)
def test_bad_logging_flags_are_one_line_errors(args, env, message):
    out = subprocess.run(
        [sys.executable, "-m", "specserve.api.cli", "serve", "--model-path", "/nonexistent", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
