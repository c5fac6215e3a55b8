"""Raw HTTP against a real server: error statuses and bodies, SSE framing, disconnects, shutdown."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from server_harness import start_server


def assert_openai_error(body: dict, status_type: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if status_type:
        assert body["error"]["type"] == status_type


async def _post(session, url, payload=None, data=None, headers=None):
    async with session.post(url, json=payload, data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def metric_value(session, base_url: str, name: str) -> float:
    async with session.get(base_url + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


async def test_validation_errors(server):
    url = server.api_url + "/completions"
    async with aiohttp.ClientSession() as s:
        status, body = await _post(s, url, data=b"{not json", headers={"Content-Type": "application/json"})
        assert status == 400
        assert_openai_error(body, "invalid_request_error")
        status, body = await _post(s, url, {"prompt": "x", "max_tokens": -3})
        assert status == 400 and body["error"]["param"] == "max_tokens"
        status, body = await _post(s, url, {"prompt": "x", "temperature": "hot"})
        assert status == 400 and body["error"]["param"] == "temperature"
        status, body = await _post(s, url, {"prompt": "x " * 5000, "max_tokens": 5})
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = await _post(s, url, {"max_tokens": 5})
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = await _post(s, url, {"prompt": "x", "model": "other"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body = await _post(s, server.api_url + "/chat/completions", {"messages": []})
        assert status == 400
        status, body = await _post(s, url, data=b"x" * (2 << 20))
        assert status == 413
        assert_openai_error(body)
        async with s.get(server.base_url + "/nope") as r:
            assert r.status == 404
            assert_openai_error(await r.json())


async def test_health_version_openapi(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base_url + "/health") as r:
            assert r.status == 200
        async with s.get(server.base_url + "/version") as r:
            assert "version" in await r.json()
        async with s.get(server.base_url + "/openapi.json") as r:
            doc = await r.json()
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= set(
            doc["paths"]
        )


async def test_sse_framing(server):
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            server.api_url + "/completions",
            json={"prompt": "abc", "max_tokens": 5, "stream": True, "temperature": 0},
        ) as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        chunk = json.loads(e[len("data: ") :])
        assert chunk["object"] == "text_completion"


async def test_concurrent_streams_with_early_disconnects(server):
    """32 concurrent streams, every third one hangs up after its first chunk; the rest complete."""
    url = server.api_url + "/completions"

    async def one(i: int, session: aiohttp.ClientSession):
        payload = {
            "prompt": f"request {i} " * 3,
            "max_tokens": 24,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with session.post(url, json=payload) as r:
            assert r.status == 200
            chunks = 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    chunks += 1
                    if i % 3 == 0 and chunks == 1:
                        return "dropped"  # leaving the context closes the connection mid-stream
                    if line.strip() == b"data: [DONE]":
                        return "done"
            return "truncated"

    # One session per client: a disconnect closes that client's TCP connection only.
    sessions = [aiohttp.ClientSession() for _ in range(32)]
    try:
        results = await asyncio.gather(*[one(i, sessions[i]) for i in range(32)])
    finally:
        for s in sessions:
            await s.close()
    assert results.count("done") == 32 - len(range(0, 32, 3))
    assert results.count("truncated") == 0
    async with aiohttp.ClientSession() as s:
        for _ in range(100):  # the aborts land within a step or two
            running = await metric_value(s, server.base_url, "specserve:num_requests_running")
            usage = await metric_value(s, server.base_url, "specserve:kv_cache_usage_perc")
            if running == 0 and usage == 0:
                break
            await asyncio.sleep(0.1)
        assert running == 0 and usage == 0.0
        assert await metric_value(s, server.base_url, "specserve:num_requests_waiting") == 0


async def test_api_key_and_overload(tiny_llama_dir, tmp_path):
    srv = start_server(
        tiny_llama_dir,
        tmp_path,
        "--api-key",
        "s3cret-key",
        "--max-batch-size",
        "1",
        "--max-waiting-requests",
        "1",
    )
    try:
        async with aiohttp.ClientSession() as s:
            url = srv.api_url + "/completions"
            status, body = await _post(s, url, {"prompt": "x", "max_tokens": 2})
            assert status == 401
            assert_openai_error(body, "authentication_error")
            status, _ = await _post(
                s, url, {"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer wrong"}
            )
            assert status == 401
            ok = {"Authorization": "Bearer s3cret-key"}
            status, _ = await _post(s, url, {"prompt": "x", "max_tokens": 2}, headers=ok)
            assert status == 200
            async with s.get(srv.base_url + "/health") as r:
                assert r.status == 200  # open without a key
            async with s.get(srv.base_url + "/v1/models") as r:
                assert r.status == 401
            many = await asyncio.gather(
                *[
                    _post(s, url, {"prompt": "y " * 20, "max_tokens": 40, "ignore_eos": True}, headers=ok)
                    for _ in range(6)
                ]
            )
            statuses = sorted(st for st, _ in many)
            assert 503 in statuses and 200 in statuses
            for st, body in many:
                if st == 503:
                    assert_openai_error(body, "service_unavailable")
        assert "s3cret-key" not in srv.log()
    finally:
        srv.stop()


async def test_graceful_shutdown_finishes_in_flight(tiny_llama_dir, tmp_path):
    srv = start_server(tiny_llama_dir, tmp_path)
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            _post(s, srv.api_url + "/completions", {"prompt": "z", "max_tokens": 200, "ignore_eos": True})
        )
        await asyncio.sleep(0.3)  # the request is in flight
        srv.process.send_signal(signal.SIGTERM)
        status, body = await task
    assert status == 200
    assert body["usage"]["completion_tokens"] == 200
    assert await asyncio.to_thread(srv.process.wait, 60) == 0
