"""Faults under load: disconnects, a raising proposer, KV exhaustion, over-long prompts, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import aiohttp
from rel_helpers import (
    assert_clean_log,
    assert_openai_error,
    greedy_texts,
    http_request,
    labelled_metric,
    metrics,
    post_json,
    raw_http,
    wait_for_running,
    wait_idle,
)
from server_harness import start_server

from specserve.benchmarks.soak import check_stream, one_request, run_load, summarize

PROMPTS = [f"Request {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog" for i in range(16)]

FLAKY_PLUGIN = '''
from specserve.engine.proposer import Proposals, Proposer


class FlakyProposer(Proposer):
    """Prompt lookup that raises on every third call (a buggy third-party proposer)."""

    name = "flaky"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.calls = 0

    def propose(self, batch):
        self.calls += 1
        if self.calls % 3 == 0:
            raise RuntimeError("flaky proposer: simulated failure")
        drafts = []
        for b in batch:
            ids = b.request.all_token_ids
            found = [ids[i + 1 : i + 1 + b.num_speculative_tokens] for i in range(len(ids) - 2, -1, -1) if ids[i] == ids[-1]]
            drafts.append((found[0] if found else []) or [ids[-1]] * b.num_speculative_tokens)
        return Proposals(drafts, [None] * len(batch))
'''


def _port(srv) -> int:
    return int(srv.base_url.rsplit(":", 1)[1])


async def test_random_client_disconnects(roomy_server):
    """Clients hang up before the first byte, mid-body, mid-stream and after [DONE]; others unaffected."""
    srv = roomy_server
    aborted_before = await labelled_metric(
        srv.base_url, "specserve:request_success_total", finished_reason="abort"
    )
    rng = random.Random(7)
    modes = ["before_first_byte", "half_body", "mid_stream", "after_done"]
    outcome: dict[str, int] = dict.fromkeys(modes, 0)

    async def disconnecting_client(i: int) -> None:
        await asyncio.sleep(rng.random() * 5)
        mode = modes[i % 4]
        chat = i % 2 == 0
        payload = {"max_tokens": 48, "ignore_eos": True, "stream": True, "temperature": 0}
        if chat:
            payload["messages"] = [{"role": "user", "content": PROMPTS[i % 16]}]
        else:
            payload["prompt"] = PROMPTS[i % 16]
        body = json.dumps(payload).encode()
        req = http_request("/v1/chat/completions" if chat else "/v1/completions", body)
        if mode == "half_body":
            await raw_http(_port(srv), req[: len(req) - len(body) // 2], close_after_write=True)
        elif mode == "before_first_byte":
            await raw_http(_port(srv), req, close_after_write=True)
        elif mode == "mid_stream":
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv))
            writer.write(req)
            await writer.drain()
            want, seen = rng.randint(1, 6), 0
            while seen < want:
                line = await asyncio.wait_for(reader.readline(), 30)
                assert line, "server closed the stream early"
                seen += line.startswith(b"data: ")
            writer.close()  # hang up with the stream in full flow
        else:
            raw = await raw_http(_port(srv), req)
            assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw, raw[-300:]
        outcome[mode] += 1

    load, *_ = await asyncio.gather(
        run_load(srv.base_url, concurrency=12, duration_s=7, seed=3),
        *(disconnecting_client(i) for i in range(48)),
    )
    s = summarize(load)
    assert s["failed"] == 0 and s["ok"] > 0, s["errors"]
    assert outcome == dict.fromkeys(modes, 12)
    await wait_idle(srv.base_url)
    aborted = await labelled_metric(srv.base_url, "specserve:request_success_total", finished_reason="abort")
    assert aborted - aborted_before >= 12  # at least the mid-stream hang-ups were aborted, blocks freed
    async with aiohttp.ClientSession() as sess, sess.get(srv.base_url + "/health") as r:
        assert r.status == 200
    assert_clean_log(srv.log())


async def test_overlong_prompt_rejected_others_unaffected(roomy_server):
    srv = roomy_server
    long_text = "the quick brown fox " * 400  # far beyond the tiny model's 1024 positions

    async def bad_requests() -> None:
        async with aiohttp.ClientSession() as s:
            for i in range(12):
                await asyncio.sleep(0.3)
                if i % 3 == 0:
                    url, payload = "/completions", {"prompt": long_text, "max_tokens": 4}
                elif i % 3 == 1:
                    url, payload = "/chat/completions", {"messages": [{"role": "user", "content": long_text}]}
                else:
                    url, payload = "/completions", {"prompt": [5] * 3000, "stream": True}
                status, body = await post_json(s, srv.api_url + url, payload)
                assert status == 400, (status, body)
                assert_openai_error(body, "invalid_request_error")
                assert body["error"]["param"] == "prompt"

    load, _ = await asyncio.gather(
        run_load(srv.base_url, concurrency=16, duration_s=5, seed=5), bad_requests()
    )
    s = summarize(load)
    assert s["failed"] == 0 and s["ok"] > 0, s["errors"]
    await wait_idle(srv.base_url)


async def test_raising_proposer_falls_back_losslessly(tiny_llama_dir, server_logs, roomy_server, tmp_path):
    (tmp_path / "flaky_proposer.py").write_text(FLAKY_PLUGIN)
    srv = start_server(
        tiny_llama_dir,
        server_logs,
        "--speculative-method",
        "flaky_proposer:FlakyProposer",
        "--max-num-steps",
        "4",
        # Every decode step asks the proposer (the adaptive controller may choose not to: whether it
        # drafts, and so whether the third call that fails ever comes, would depend on timing).
        "--speculative-policy",
        "static",
        env={"PYTHONPATH": str(tmp_path)},
    )
    try:
        got, got_stream = await asyncio.gather(
            greedy_texts(srv.api_url, PROMPTS[:8], 40, speculative=True),
            greedy_texts(srv.api_url, PROMPTS[8:], 40, speculative=True, stream=True),
        )
        errors = await labelled_metric(srv.base_url, "specserve:spec_decode_proposer_errors_total")
        drafts = (await metrics(srv.base_url)).get("specserve:spec_decode_num_drafts_total", 0)
        await wait_idle(srv.base_url)
    finally:
        assert srv.stop() == 0
    want = await greedy_texts(roomy_server.api_url, PROMPTS, 40, speculative=False)
    assert got + got_stream == want  # lossless: identical to plain greedy decoding
    assert errors > 0, "the proposer never failed?"
    assert drafts > 0, "the proposer never proposed?"
    log = srv.log()
    assert "proposer flaky failed" in log and "simulated failure" in log


async def test_kv_exhaustion_preempts_without_changing_outputs(tiny_llama_dir, server_logs, roomy_server):
    # 256 tokens = 16 blocks of 16; 16 requests x ~80 tokens need ~90 blocks at once.
    srv = start_server(tiny_llama_dir, server_logs, "--max-kv-cache-tokens", "256", "--max-length", "128")
    try:
        got_on, got_off = await asyncio.wait_for(
            asyncio.gather(
                greedy_texts(srv.api_url, PROMPTS[::2], 64, speculative=True, stream=True),
                greedy_texts(srv.api_url, PROMPTS[1::2], 64, speculative=False),
            ),
            timeout=150,  # a deadlock fails here instead of hanging the suite
        )
        preemptions = (await metrics(srv.base_url)).get("specserve:num_preemptions_total", 0)
        await wait_idle(srv.base_url)
    finally:
        assert srv.stop() == 0
    want = await greedy_texts(roomy_server.api_url, PROMPTS, 64, speculative=False)
    assert preemptions > 0, "the KV cache never ran out: make it smaller"
    assert got_on == want[::2] and got_off == want[1::2]


def _stream_body(i: int, max_tokens: int) -> tuple[str, dict]:
    return "/completions", {
        "prompt": PROMPTS[i % 16],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0 if i % 2 else 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": {"enabled": i % 3 != 0},
    }


async def test_sigterm_drains_in_flight_requests(tiny_llama_dir, server_logs):
    srv = start_server(tiny_llama_dir, server_logs, "--shutdown-timeout", "60")
    async with aiohttp.ClientSession() as s:
        tasks = [
            asyncio.create_task(one_request(s, srv.api_url, *_stream_body(i, 96 + 8 * i), timeout_s=90))
            for i in range(24)
        ]
        await wait_for_running(srv.base_url, 20)
        srv.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        try:  # while draining: refused politely (or already no longer listening)
            status, body = await post_json(
                s, srv.api_url + "/completions", {"prompt": "late", "max_tokens": 2}
            )
            assert status == 503, (status, body)
            assert body["error"]["code"] == "server_shutting_down"
        except aiohttp.ClientConnectionError:
            pass
        outcomes = await asyncio.gather(*tasks)
    assert [o.error for o in outcomes if o.kind != "ok"] == []
    assert await asyncio.to_thread(srv.process.wait, 60) == 0
    assert_clean_log(srv.log())


async def test_sigterm_timeout_ends_streams_with_a_clear_error(tiny_llama_dir, server_logs):
    srv = start_server(tiny_llama_dir, server_logs, "--shutdown-timeout", "1")

    async def stream(s: aiohttp.ClientSession, i: int) -> str:
        path, body = _stream_body(i, 900)
        async with s.post(srv.api_url + path, json=body) as r:
            if r.status != 200:
                assert r.status == 503, r.status
                assert_openai_error(await r.json())
                return "refused"
            events = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    payload = line[6:].strip()
                    events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        if errors:
            assert events[-1] == "[DONE]" and errors[0]["code"] == "server_shutting_down", events[-2:]
            return "error"
        assert check_stream(events, body)[1] is None, events[-2:]  # otherwise complete, never cut
        return "complete"

    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(stream(s, i)) for i in range(16)]
        await wait_for_running(srv.base_url, 12)
        srv.process.send_signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert "error" in results, results
    assert await asyncio.to_thread(srv.process.wait, 30) == 0
    assert "shutdown timeout" in srv.log()
