"""Shared helpers for tests/reliability: metrics, idle checks, raw HTTP, greedy references."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp

from specserve.benchmarks.soak import scrape_metrics

GAUGES = (
    "specserve:num_requests_running",
    "specserve:num_requests_waiting",
    "specserve:kv_cache_usage_perc",
)


def assert_openai_error(body: Any, status_type: str | None = None) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    if status_type:
        assert body["error"]["type"] == status_type, body


async def metrics(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        return await scrape_metrics(s, base_url, headers)


async def wait_idle(base_url: str, timeout: float = 30.0, headers=None) -> dict[str, float]:
    """Poll /metrics until nothing runs, nothing waits and every KV block is free; return the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(base_url, headers)
        if all(m.get(g) == 0 for g in GAUGES):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: { {g: m.get(g) for g in GAUGES} }")
        await asyncio.sleep(0.2)


async def post_json(
    session: aiohttp.ClientSession, url: str, payload: Any = None, **kwargs: Any
) -> tuple[int, Any]:
    async with session.post(url, json=payload, **kwargs) as r:
        raw = await r.read()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw


async def raw_http(
    port: int, request: bytes, *, read_timeout: float = 30.0, close_after_write: bool = False
) -> bytes:
    """Send raw bytes to 127.0.0.1:port; return everything the server sends until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        if close_after_write:
            return b""
        return await asyncio.wait_for(reader.read(-1), read_timeout)
    finally:
        writer.close()
        await writer.wait_closed()


def http_request(path: str, body: bytes, content_type: str = "application/json", extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


def parse_http(raw: bytes) -> tuple[int, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


async def greedy_texts(
    api_url: str, prompts: list[str], max_tokens: int, *, speculative: bool, stream: bool = False
) -> list[str]:
    """Greedy completions of all prompts, sent concurrently; ignore_eos so every one runs full length."""

    async def one(session: aiohttp.ClientSession, prompt: str) -> str:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "speculative": {"enabled": speculative},
            "stream": stream,
        }
        async with session.post(api_url + "/completions", json=body) as r:
            assert r.status == 200, await r.text()
            if not stream:
                data = await r.json()
                assert data["usage"]["completion_tokens"] == max_tokens, data["usage"]
                return data["choices"][0]["text"]
            text = ""
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
            return text

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s:
        return list(await asyncio.gather(*(one(s, p) for p in prompts)))


async def labelled_metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(base_url + "/metrics") as r:
        text = await r.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def wait_for_running(base_url: str, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (await metrics(base_url)).get("specserve:num_requests_running", 0) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"fewer than {n} requests running after {timeout} s")
        await asyncio.sleep(0.05)


def assert_clean_log(log: str) -> None:
    """No ERROR records and no tracebacks in a server log (malformed HTTP is a one-line WARNING)."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", log)
    bad = [r for r in records if "ERROR" in r or "Traceback" in r or "internal error" in r]
    assert not bad, "\n".join(bad)[-4000:]
