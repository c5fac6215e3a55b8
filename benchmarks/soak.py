"""`specserve soak`: keep a mixed streaming load on a specserve server for a while and check it holds up.

C clients (default 64), each with its own connection, send streaming requests back to back until the
duration is spent: chat or text completions, mixed prompt lengths and max_tokens, greedy or sampled,
speculation on or off per request (`"speculative": {"enabled": false}`). Every request must either
complete (a `[DONE]` stream whose usage chunk accounts for its tokens) or be refused at admission with
an OpenAI-shaped 429/503; anything else (5xx, a cut stream, a timeout, a 4xx for a valid request) is a
failure. The summary gives ok / refused / failed, latency and TTFT percentiles, and the server's memory
trend: VmRSS of --server-pid, or `process_resident_memory_bytes` from /metrics when the server exports it.

Loopback only (127.0.0.0/8, ::1, localhost), and bounded: --duration, --max-requests and a per-request
timeout. Exit status: 0 when nothing failed, 1 when something did (or the server cannot be reached),
2 for bad arguments. The same load generator (`run_load`) drives tests/reliability.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp

from . import stats as st
from .common import write_json
from .local_server import bearer, loopback_url

PROMPTS = (
    "Hi",
    "Write a haiku about the sea.",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\n# Explain what this function does, then write a test for it.",
    "Speculative decoding drafts several tokens and verifies them at once. " * 8,
    "1 2 3 4 5 6 7 8 9 10 11 12 " * 12,
)
MAX_TOKENS = (1, 4, 16, 32, 64, 96)
SAMPLING = (
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1},
)
MAX_DURATION_S = 24 * 3600


class SoakError(Exception):
    """A one-line usage problem (exit status 2)."""


@dataclass
class Outcome:
    kind: str  # "ok" | "refused" | "failed"
    path: str
    speculative: bool
    status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    elapsed_s: float = 0.0
    memory: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, bytes)

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)


# --- one request ---------------------------------------------------------------------------------------
def make_request(rng: random.Random, model: str | None = None) -> tuple[str, dict[str, Any]]:
    """A random valid streaming request: (path under /v1, JSON body)."""
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {
        "max_tokens": rng.choice(MAX_TOKENS),
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": rng.random() < 0.5,
        **rng.choice(SAMPLING),
    }
    if body.get("temperature", 0) > 0 and rng.random() < 0.5:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.5:
        body["speculative"] = {"enabled": False}
    elif rng.random() < 0.3:
        body["speculative"] = {"num_speculative_tokens": rng.randint(1, 4)}
    if model:
        body["model"] = model
    if rng.random() < 0.5:
        return "/chat/completions", {"messages": [{"role": "user", "content": prompt}], **body}
    return "/completions", {"prompt": prompt, **body}


def _is_openai_error(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("error"), dict)
        and {"message", "type", "param", "code"} <= set(data["error"])
    )


def check_stream(events: list[Any], body: dict[str, Any]) -> tuple[int, str | None]:
    """Validate a finished SSE stream (parsed JSON chunks, then "[DONE]"): (completion tokens, problem)."""
    if not events or events[-1] != "[DONE]":
        return 0, "stream ended without [DONE]"
    chunks = events[:-1]
    errors = [c["error"] for c in chunks if isinstance(c, dict) and "error" in c]
    if errors:
        return 0, f"error event in the stream: {str(errors[0])[:160]}"
    usage = [c["usage"] for c in chunks if isinstance(c, dict) and c.get("usage")]
    if len(usage) != 1:
        return 0, f"expected one usage chunk, got {len(usage)}"
    u = usage[0]
    prompt_tokens, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    if prompt_tokens <= 0 or u.get("total_tokens") != prompt_tokens + completion:
        return completion, f"inconsistent usage {u}"
    finish = [
        ch.get("finish_reason") for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")
    ]
    if len(finish) != 1:
        return completion, f"expected one finish_reason, got {finish}"
    max_tokens = body["max_tokens"]
    if not 1 <= completion <= max_tokens:
        return completion, f"completion_tokens {completion} outside [1, {max_tokens}]"
    if body.get("ignore_eos") and (completion != max_tokens or finish[0] != "length"):
        return completion, f"ignore_eos: {completion}/{max_tokens} tokens, finish_reason {finish[0]}"
    return completion, None


async def one_request(
    session: aiohttp.ClientSession,
    api_url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Outcome:
    spec = (body.get("speculative") or {}).get("enabled", True)
    out = Outcome("failed", path, spec)
    start = time.perf_counter()

    async def exchange() -> None:
        async with session.post(api_url + path, json=body, headers=headers) as r:
            out.status = r.status
            if r.status != 200:
                raw = await r.read()
                try:
                    data = json.loads(raw)
                except ValueError:
                    data = None
                if r.status in (429, 503) and _is_openai_error(data):
                    out.kind = "refused"
                else:
                    out.error = f"HTTP {r.status}: {raw[:160].decode(errors='replace')}"
                return
            events: list[Any] = []
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - start
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
            out.completion_tokens, out.error = check_stream(events, body)
            out.kind = "failed" if out.error else "ok"

    try:
        await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        out.kind, out.error = "failed", f"no complete response within {timeout_s:g} s"
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        out.kind, out.error = "failed", f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        out.latency_s = time.perf_counter() - start
    return out


# --- memory ----------------------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process (Linux /proc), or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str, headers=None) -> dict[str, float]:
    """Unlabelled-or-summed samples from /metrics, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(base_url + "/metrics", headers=headers) as r:
        text = await r.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


async def memory_sample(
    session: aiohttp.ClientSession, base_url: str, pid: int | None, headers=None
) -> float | None:
    if pid is not None:
        value = rss_bytes(pid)
        return float(value) if value is not None else None
    try:
        return (await scrape_metrics(session, base_url, headers)).get("process_resident_memory_bytes")
    except (aiohttp.ClientError, OSError, ValueError):
        return None


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    return 60 * sum((t - mx) * (v - my) for t, v in points) / den if den else None


# --- the load ----------------------------------------------------------------------------------------------
async def run_load(
    base_url: str,
    *,
    concurrency: int = 64,
    duration_s: float = 60.0,
    seed: int = 0,
    api_key: str | None = None,
    model: str | None = None,
    request_timeout_s: float = 120.0,
    max_requests: int = 1_000_000,
    server_pid: int | None = None,
    sample_interval_s: float = 5.0,
    report_interval_s: float = 0.0,
    make: Any = make_request,
) -> LoadResult:
    """`concurrency` clients send requests back to back for `duration_s` (then finish what is in flight)."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    api_url = base_url + "/v1"
    headers = bearer(api_key)
    result = LoadResult()
    start = time.monotonic()
    deadline = start + duration_s
    issued = 0

    async def client(i: int) -> None:
        nonlocal issued
        rng = random.Random(seed * 100_003 + i)
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            while time.monotonic() < deadline and issued < max_requests:
                issued += 1
                path, body = make(rng, model)
                out = await one_request(session, api_url, path, body, headers, request_timeout_s)
                result.outcomes.append(out)
                if out.kind == "refused":  # back off a little, as a polite client would
                    await asyncio.sleep(0.05 + 0.2 * rng.random())

    async def monitor(session: aiohttp.ClientSession) -> None:
        last_report = start
        while True:
            value = await memory_sample(session, base_url, server_pid, headers)
            now = time.monotonic()
            if value is not None:
                result.memory.append((now - start, value))
            if report_interval_s and now - last_report >= report_interval_s:
                last_report = now
                mem = f", server RSS {value / 2**20:.0f} MiB" if value is not None else ""
                print(
                    f"[soak] {now - start:6.0f} s: ok {result.count('ok')}, refused"
                    f" {result.count('refused')}, failed {result.count('failed')}{mem}",
                    file=sys.stderr,
                    flush=True,
                )
            await asyncio.sleep(sample_interval_s)

    async with aiohttp.ClientSession() as session:
        mon = asyncio.create_task(monitor(session))
        try:
            await asyncio.gather(*(client(i) for i in range(concurrency)))
        finally:
            mon.cancel()
            await asyncio.gather(mon, return_exceptions=True)
        value = await memory_sample(session, base_url, server_pid, headers)
        if value is not None:
            result.memory.append((time.monotonic() - start, value))
    result.elapsed_s = time.monotonic() - start
    return result


def summarize(result: LoadResult) -> dict[str, Any]:
    ok = [o for o in result.outcomes if o.kind == "ok"]
    failed = [o for o in result.outcomes if o.kind == "failed"]
    lat = [o.latency_s for o in ok if o.latency_s is not None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    statuses: dict[str, int] = {}
    for o in result.outcomes:
        key = str(o.status) if o.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    errors: dict[str, int] = {}
    for o in failed:
        errors[o.error or "?"] = errors.get(o.error or "?", 0) + 1
    mem = [v for _, v in result.memory]
    return {
        "elapsed_s": round(result.elapsed_s, 1),
        "requests": len(result.outcomes),
        "ok": len(ok),
        "refused": result.count("refused"),
        "failed": len(failed),
        "ok_speculative_on": sum(o.speculative for o in ok),
        "ok_speculative_off": sum(not o.speculative for o in ok),
        "statuses": statuses,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10]),
        "requests_per_s": round(len(ok) / result.elapsed_s, 2) if result.elapsed_s else None,
        "completion_tokens": sum(o.completion_tokens for o in ok),
        "latency_s": st.percentiles(lat) | {"max": max(lat, default=None)},
        "ttft_s": st.percentiles(ttft) | {"max": max(ttft, default=None)},
        "memory": {
            "samples": len(mem),
            "first_mib": mem[0] / 2**20 if mem else None,
            "last_mib": mem[-1] / 2**20 if mem else None,
            "max_mib": max(mem) / 2**20 if mem else None,
            "slope_mib_per_min": (s / 2**20 if (s := slope_per_minute(result.memory)) is not None else None),
        },
    }


def render(summary: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f} ms"

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f} MiB"

    lat, ttft, mem = summary["latency_s"], summary["ttft_s"], summary["memory"]
    lines = [
        f"soak: {summary['elapsed_s']} s, {summary['requests']} requests: ok {summary['ok']}"
        f" (speculation on {summary['ok_speculative_on']} / off {summary['ok_speculative_off']}),"
        f" refused {summary['refused']}, failed {summary['failed']}",
        f"  throughput: {summary['requests_per_s']} req/s, {summary['completion_tokens']} completion tokens",
        f"  latency: p50 {ms(lat['p50'])}, p90 {ms(lat['p90'])}, p99 {ms(lat['p99'])}, max {ms(lat['max'])}",
        f"  TTFT:    p50 {ms(ttft['p50'])}, p90 {ms(ttft['p90'])}, p99 {ms(ttft['p99'])}, max {ms(ttft['max'])}",
        f"  statuses: {summary['statuses']}",
    ]
    if mem["samples"]:
        slope = mem["slope_mib_per_min"]
        lines.append(
            f"  server memory: {mem['samples']} samples, first {mib(mem['first_mib'])}, max"
            f" {mib(mem['max_mib'])}, last {mib(mem['last_mib'])}, trend"
            f" {'-' if slope is None else f'{slope:+.2f} MiB/min'}"
        )
    else:
        lines.append(
            "  server memory: not sampled (give --server-pid, or export process_resident_memory_bytes)"
        )
    for err, n in summary["errors"].items():
        lines.append(f"  failure x{n}: {err}")
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SoakError(message)


def check_loopback(base_url: str) -> str:
    """The URL without a trailing slash or /v1; SoakError unless it points at this machine (plain http)."""
    return loopback_url(base_url, SoakError, schemes=("http",), who="soak")


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise SoakError(f"--duration: expected e.g. 180, 90s, 30m or 1h, got {text!r}")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if not 1 <= seconds <= MAX_DURATION_S:
        raise SoakError(f"--duration must be between 1 s and {MAX_DURATION_S // 3600} h")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specserve soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (loopback only)")
    p.add_argument("--duration", default="180", help="how long to keep the load on: 180, 90s, 30m, 1h")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name to send (default: none, the server's)")
    p.add_argument("--server-pid", type=int, default=None, help="server process to read VmRSS from")
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between memory samples")
    p.add_argument("--report-interval", type=float, default=30.0, help="seconds between progress lines")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop issuing after this many")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    return p


def _fail(message: str, code: int) -> NoReturn:
    print(f"specserve soak: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.base_url = check_loopback(args.base_url)
    args.duration_s = parse_duration(args.duration)
    for name, lo, hi in (
        ("concurrency", 1, 1024),
        ("max_requests", 1, 10**8),
        ("sample_interval", 0.1, 3600),
        ("report_interval", 0, 86400),
        ("request_timeout", 1, 86400),
    ):
        value = getattr(args, name)
        if not lo <= value <= hi:
            raise SoakError(f"--{name.replace('_', '-')} must be between {lo} and {hi}")
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").exists():
        raise SoakError(f"--server-pid {args.server_pid}: no such process")
    return args


async def _reachable(base_url: str, api_key: str | None) -> str | None:
    headers = bearer(api_key)
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s,
            s.get(base_url + "/v1/models", headers=headers) as r,
        ):
            if r.status != 200:
                return f"GET {base_url}/v1/models answered {r.status}"
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        return f"cannot reach {base_url}: {type(exc).__name__}: {exc}"
    return None


def main(argv: list[str]) -> None:
    try:
        args = parse_args(argv)
    except SoakError as exc:
        _fail(f"{exc} (see specserve soak --help)", 2)
    problem = asyncio.run(_reachable(args.base_url, args.api_key))
    if problem:
        _fail(problem, 1)
    print(
        f"soak: {args.concurrency} streaming clients against {args.base_url} for {args.duration_s:g} s",
        file=sys.stderr,
        flush=True,
    )
    result = asyncio.run(
        run_load(
            args.base_url,
            concurrency=args.concurrency,
            duration_s=args.duration_s,
            seed=args.seed,
            api_key=args.api_key,
            model=args.model,
            request_timeout_s=args.request_timeout,
            max_requests=args.max_requests,
            server_pid=args.server_pid,
            sample_interval_s=args.sample_interval,
            report_interval_s=args.report_interval,
        )
    )
    summary = summarize(result)
    print(render(summary), flush=True)
    if args.json:
        write_json(Path(args.json), {"args": _jsonable(vars(args)), "summary": summary})
    if summary["failed"]:
        raise SystemExit(1)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in d.items() if k != "api_key" and isinstance(v, str | int | float | bool | type(None))
    }


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
