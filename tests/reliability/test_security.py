"""--api-key: every endpoint but the open ones needs it, and the key never reaches the logs."""

from __future__ import annotations

import json

import aiohttp
from rel_helpers import assert_openai_error
from server_harness import start_server

KEY = "sk-reliability-7f3a9c1e5b2d4f60"
WRONG = "sk-reliability-0000000000000000"
PROTECTED = [
    ("GET", "/v1/models"),
    ("GET", "/version"),
    ("GET", "/openapi.json"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/no/such/path"),  # 401, not 404: an unauthenticated client learns nothing about routes
]
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


async def _call(s: aiohttp.ClientSession, base: str, method: str, path: str, headers: dict | None):
    async with s.request(method, base + path, json=BODIES.get(path), headers=headers) as r:
        text = await r.text()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


async def _check(srv, open_paths: set[str], protected: list[tuple[str, str]]) -> None:
    bad_headers = [
        None,
        {"Authorization": f"Bearer {WRONG}"},
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},  # a prefix of the key
        {"X-API-Key": KEY},
    ]
    async with aiohttp.ClientSession() as s:
        for method, path in protected:
            for headers in bad_headers:
                status, body = await _call(s, srv.base_url, method, path, headers)
                assert status == 401, (path, headers, status)
                assert_openai_error(body, "authentication_error")
                assert KEY not in str(body) and WRONG not in str(body)
            status, body = await _call(s, srv.base_url, method, path, {"Authorization": f"Bearer {KEY}"})
            assert status == (404 if path == "/no/such/path" else 200), (path, status, body)
        for path in open_paths:
            async with s.get(srv.base_url + path) as r:
                assert r.status == 200, path
                assert KEY not in await r.text()
    log = srv.log()
    assert KEY not in log and WRONG not in log and KEY[3:] not in log


async def test_api_key_default_open_paths(tiny_llama_dir, server_logs):
    srv = start_server(tiny_llama_dir, server_logs, "--api-key", KEY)
    try:
        await _check(srv, {"/health", "/metrics"}, PROTECTED)
    finally:
        assert srv.stop() == 0
    assert KEY not in srv.log()


async def test_api_key_from_env_with_configured_open_paths(tiny_llama_dir, server_logs):
    srv = start_server(
        tiny_llama_dir,
        server_logs,
        "--unauthenticated-paths",
        "/health,/version",
        env={"SPECSERVE_API_KEY": KEY},
    )
    try:
        await _check(srv, {"/health", "/version"}, [("GET", "/metrics"), *PROTECTED[:1], *PROTECTED[3:]])
    finally:
        assert srv.stop() == 0
    assert KEY not in srv.log()
