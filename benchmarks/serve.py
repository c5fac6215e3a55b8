"""`specserve bench serve`: a streaming load test against a specserve server on this machine.

A concurrency sweep (each level keeps C requests in flight over a fixed prompt set) comparing speculation
modes in the SAME run on one server started with speculation, toggled per request: off
(`"speculative": {"enabled": false}`), on (the server's own policy), static (`"policy": "static"` with
k = --static-k every step) and adaptive (`"policy": "adaptive"`: the controller picks k). The mode order
rotates from one round to the next. Reports
requests/s, output tokens/s, TTFT, ITL (gap between streamed chunks), TPOT ((e2e - TTFT) / (tokens - 1))
and E2E latency p50/p90/p99, plus the server's per-request acceptance stats.

Loopback (127.0.0.0/8, ::1, localhost) unless a remote --base-url is allowed explicitly with --allow-remote
(which also needs --api-key: a cluster's server is one you hold the key to), and bounded: at most --max-total-requests requests, and each
cell stops issuing new requests after --cell-time-limit seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import serve_report
from . import stats as st
from .common import progress
from .harness import add_output_args, envelope, keyed, output_dir, print_report, rounds, write_report

# BenchError and launch_server are also this module's API: tests start servers with serve.launch_server.
from .local_server import BenchError, bearer, launch_server, loopback_url, server_info
from .prompt_sets import CATEGORIES, load_prompts, parse_categories

MAX_NUM_SPECULATIVE_TOKENS = 32  # the server's bound (engine/sampling_params.py), not imported: no torch here

SCHEMA = "specserve.bench.serve/1"
MODES = ("off", "on", "static", "adaptive")


def speculative_options(mode: str, static_k: int) -> dict[str, Any]:
    """The request's `speculative` object for a benchmark mode."""
    if mode == "off":
        return {"enabled": False}
    if mode == "static":
        return {"policy": "static", "num_speculative_tokens": static_k}
    if mode == "adaptive":
        return {"policy": "adaptive"}
    return {"enabled": True}


def check_loopback(base_url: str, allow_remote: bool = False, api_key: str | None = None) -> str:
    """Return the URL without a trailing slash, or raise BenchError if it does not point at this machine
    (unless `allow_remote`, which needs an API key)."""
    if allow_remote and not api_key:
        raise BenchError("--allow-remote needs --api-key (or SPECSERVE_API_KEY) for the remote server")
    return loopback_url(base_url, BenchError, who="this benchmark", allow_remote=allow_remote)


@dataclass
class RequestRecord:
    mode: str
    concurrency: int
    prompt_id: str
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    num_chunks: int = 0
    spec: dict[str, Any] | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def one_request(
    session: Any,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    headers: dict[str, str],
    timeout_s: float,
) -> RequestRecord:
    import aiohttp

    t0 = time.perf_counter()
    last: float | None = None
    try:
        async with session.post(
            url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            buf = b""
            async for raw in resp.content:
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if msg.get("usage"):
                        rec.output_tokens = int(msg["usage"].get("completion_tokens") or 0)
                        rec.spec = msg["usage"].get("speculative")
                    for choice in msg.get("choices") or []:
                        # Every chunk with a choice carries new tokens (its text may be empty, e.g. half a
                        # UTF-8 character or a special token), so it counts for TTFT and ITL.
                        if "delta" in choice or "text" in choice:
                            now = time.perf_counter()
                            if last is None:
                                rec.ttft_s = now - t0
                            else:
                                rec.chunk_gaps_s.append(now - last)
                            last = now
                            rec.num_chunks += 1
        rec.e2e_s = time.perf_counter() - t0
        rec.ok = rec.ttft_s is not None
        if not rec.ok:
            rec.error = "no content streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    return rec


def request_max_tokens(max_tokens: int, range_ratio: float, index: int) -> int:
    """Output tokens of a cell's `index`-th request: `max_tokens`, or with a range ratio R drawn
    uniformly from [max_tokens x (1 - R), max_tokens x (1 + R)] (vLLM's benchmark `--random-range-ratio`),
    seeded by the index alone so that every mode gets the same lengths in the same order. With one length
    for all, closed-loop clients keep speculation off in lockstep (a wave of requests ends on one step and
    the next wave's prompts are prefilled together), which traffic of mixed lengths does not."""
    low, high = max_tokens_range(max_tokens, range_ratio)
    return low if low == high else random.Random(index).randint(low, high)


def max_tokens_range(max_tokens: int, range_ratio: float) -> tuple[int, int]:
    """(fewest, most) output tokens a request may be given."""
    if range_ratio <= 0:
        return max_tokens, max_tokens
    low = max(1, round(max_tokens * (1 - range_ratio)))
    return low, max(low, round(max_tokens * (1 + range_ratio)))


def request_body(
    messages: list[dict[str, Any]], max_tokens: int, mode: str, model: str | None, static_k: int = 5
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": speculative_options(mode, static_k),
    }
    if model:
        body["model"] = model
    return body


async def run_cell(
    base_url: str,
    prompts: list[Any],
    concurrency: int,
    num_requests: int,
    mode: str,
    args: argparse.Namespace,
    start_index: int,
    on_done: Any,
) -> tuple[list[RequestRecord], float]:
    """Keep `concurrency` requests in flight until `num_requests` were issued or the cell's time is up."""
    import aiohttp

    url = base_url + "/v1/chat/completions"
    headers = bearer(args.api_key)
    records: list[RequestRecord] = []
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + args.cell_time_limit

    async def worker(session: Any) -> None:
        nonlocal next_index
        while next_index < num_requests and time.perf_counter() < deadline:
            i = next_index
            next_index += 1
            p = prompts[(start_index + i) % len(prompts)]
            rec = RequestRecord(mode, concurrency, p.id)
            records.append(rec)
            max_tokens = request_max_tokens(args.max_tokens, args.max_tokens_range_ratio, start_index + i)
            await one_request(
                session,
                url,
                request_body(p.messages, max_tokens, mode, args.model, args.static_k),
                rec,
                headers,
                args.request_timeout,
            )
            on_done()

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return records, time.perf_counter() - t0


def cell_summary(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    rate, length = st.acceptance(
        *(
            sum((r.spec or {}).get(k, 0) for r in ok)
            for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        )
    )
    mean_ks = [(r.spec or {}).get("mean_k") for r in ok]

    def pct(values: list[float | None]) -> dict[str, float | None]:
        return {k: st.round_or_none(v, 5) for k, v in st.percentiles(values).items()}

    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": round(duration, 4),
        "requests_per_s": st.round_or_none(len(ok) / duration if duration > 0 else None),
        "output_tokens": tokens,
        "output_tokens_per_s": st.round_or_none(tokens / duration if duration > 0 else None),
        "ttft_s": pct([r.ttft_s for r in ok]),
        "itl_s": pct([g for r in ok for g in r.chunk_gaps_s]),
        "tpot_s": pct([r.tpot_s for r in ok]),
        "e2e_s": pct([r.e2e_s for r in ok]),
        "tokens_per_chunk": st.round_or_none(tokens / sum(r.num_chunks for r in ok))
        if ok and any(r.num_chunks for r in ok)
        else None,
        "acceptance_rate": st.round_or_none(rate),
        "mean_acceptance_length": st.round_or_none(length),
        "mean_k": st.round_or_none(st.median(k for k in mean_ks if k is not None)),
    }


# --- the benchmark -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve bench serve",
        description="Streaming load test against a specserve server (this machine unless --allow-remote): "
        "concurrency sweep, "
        "speculation on vs off per request in the same run. Server flags for --launch go after `--`.",
    )
    t = p.add_argument_group("target")
    t.add_argument(
        "--base-url",
        default=None,
        help="a running server, e.g. http://127.0.0.1:8000 (loopback unless --allow-remote)",
    )
    t.add_argument(
        "--allow-remote",
        action="store_true",
        help="let --base-url point at another machine (e.g. a cluster Service); needs --api-key",
    )
    t.add_argument(
        "--launch", action="store_true", help="start `specserve serve` on 127.0.0.1 with the flags after --"
    )
    t.add_argument(
        "--launch-timeout", type=float, default=900, help="seconds to wait for the launched server"
    )
    t.add_argument(
        "--api-key", default=os.environ.get("SPECSERVE_API_KEY"), help="bearer token if the server needs one"
    )
    t.add_argument("--model", default=None, help="model name sent in requests (default: server's)")
    r = p.add_argument_group("load")
    r.add_argument("--concurrency", default="1,2,4,8,16", help="comma list of concurrency levels")
    r.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="requests per (level, mode) cell (default: max(4, --requests-per-client x level))",
    )
    r.add_argument(
        "--requests-per-client",
        type=int,
        default=2,
        help="requests each client sends per cell when --requests-per-level is not given (default 2);"
        " a longer cell spends less of its time draining its last requests",
    )
    r.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    r.add_argument(
        "--max-tokens-range-ratio",
        type=float,
        default=0.0,
        help="R in [0, 1): each request's output tokens drawn uniformly from --max-tokens x [1 - R, 1 + R],"
        " the same lengths for every mode (default 0: all --max-tokens)",
    )
    r.add_argument("--categories", default="all", help=f"prompt categories: {', '.join(CATEGORIES)} or all")
    r.add_argument(
        "--modes",
        default="off,on",
        help="speculation modes to compare, per-request toggle: off, on (the server's policy), static"
        " (k = --static-k every step), adaptive (the controller's k)",
    )
    r.add_argument("--static-k", type=int, default=5, help="k of the static mode (default 5)")
    r.add_argument("--repeats", type=int, default=1, help="repeats of every (level, mode) cell, interleaved")
    r.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests per mode")
    r.add_argument(
        "--cell-time-limit", type=float, default=300, help="stop issuing requests in a cell after this many s"
    )
    r.add_argument("--request-timeout", type=float, default=600, help="per-request timeout in s")
    r.add_argument("--max-total-requests", type=int, default=2000, help="refuse plans larger than this")
    r.add_argument("--quick", action="store_true", help="levels 1,2,4, 32 tokens, 4 requests per cell")
    add_output_args(p, "serve")
    return p


def _plan(args: argparse.Namespace) -> tuple[list[int], list[str], dict[int, int]]:
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or any(c < 1 or c > 256 for c in levels):
        raise BenchError("--concurrency levels must be between 1 and 256")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise BenchError(f"--modes must be a comma list of {', '.join(MODES)}")
    if not 0 <= args.max_tokens_range_ratio < 1:
        raise BenchError("--max-tokens-range-ratio must be in [0, 1)")
    if not 0 <= args.static_k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise BenchError(f"--static-k must be in [0, {MAX_NUM_SPECULATIVE_TOKENS}]")
    if args.requests_per_client < 1:
        raise BenchError("--requests-per-client must be at least 1")
    per = {c: args.requests_per_level or max(4, args.requests_per_client * c) for c in levels}
    total = sum(per.values()) * len(modes) * args.repeats + args.warmup * len(modes)
    if total > args.max_total_requests:
        raise BenchError(
            f"the plan has {total} requests, over --max-total-requests {args.max_total_requests}"
        )
    return levels, modes, per


async def sweep(
    base_url: str, args: argparse.Namespace, levels: list[int], modes: list[str], per: dict[int, int]
) -> list[dict[str, Any]]:
    """Warm-up, then the harness's rounds, level by level: each (level, repeat) runs every mode (arm) on
    the same prompts in the same order, the mode order rotating from one round to the next."""
    prompts = load_prompts(parse_categories(args.categories))
    total = sum(per.values()) * len(modes) * args.repeats + args.warmup * len(modes)
    bar = progress(total, "bench serve", disable=args.no_progress)
    for mode in modes:
        for i in range(args.warmup):
            await run_cell(base_url, prompts, 1, 1, mode, _warm_args(args), i, lambda: bar.update(1))
    cells = []
    start = 0
    for rnd in rounds(modes, levels, args.repeats, repeats_outer=False):
        c = rnd.item
        for mode in rnd.arms:
            bar.set_postfix_str(f"concurrency {c} spec {mode}")
            started = time.time()  # wall clock, as in a server's --step-log (`bench steps --serve-report`)
            records, duration = await run_cell(
                base_url, prompts, c, per[c], mode, args, start, lambda: bar.update(1)
            )
            window = {"started": round(started, 3), "ended": round(time.time(), 3)}
            cells.append(
                {
                    "concurrency": c,
                    "mode": mode,
                    "repeat": rnd.repeat,
                    **window,
                    **cell_summary(records, duration),
                }
            )
        start += per[c]
    bar.close()
    return cells


def _warm_args(args: argparse.Namespace) -> argparse.Namespace:
    warm = argparse.Namespace(**vars(args))
    warm.max_tokens = min(args.max_tokens, 8)
    warm.max_tokens_range_ratio = 0.0
    return warm


def summarize(cells: list[dict[str, Any]], levels: list[int], modes: list[str]) -> list[dict[str, Any]]:
    out = []
    for c in levels:
        row: dict[str, Any] = {"concurrency": c}
        for mode in modes:
            cs = [x for x in cells if x["concurrency"] == c and x["mode"] == mode]
            row[mode] = {
                "requests_per_s": st.round_or_none(st.median(x["requests_per_s"] for x in cs)),
                "output_tokens_per_s": st.round_or_none(st.median(x["output_tokens_per_s"] for x in cs)),
                "ttft_p50_s": st.round_or_none(st.median(x["ttft_s"]["p50"] for x in cs), 5),
                "itl_p50_s": st.round_or_none(st.median(x["itl_s"]["p50"] for x in cs), 5),
                "tpot_p50_s": st.round_or_none(st.median(x["tpot_s"]["p50"] for x in cs), 5),
                "acceptance_rate": st.round_or_none(st.median(x["acceptance_rate"] for x in cs)),
                "mean_acceptance_length": st.round_or_none(
                    st.median(x["mean_acceptance_length"] for x in cs)
                ),
                "mean_k": st.round_or_none(st.median(x.get("mean_k") for x in cs)),
                "failed": sum(x["failed"] for x in cs),
            }
        if "off" in modes:
            level = [x for x in cells if x["concurrency"] == c]
            off = keyed((x for x in level if x["mode"] == "off"), "output_tokens_per_s", "repeat")
            for mode in modes:
                if mode == "off":
                    continue
                ys = keyed((x for x in level if x["mode"] == mode), "output_tokens_per_s", "repeat")
                key = "spec_speedup_output_tokens_per_s" if mode == "on" else f"{mode}_vs_off"
                row[key] = st.round_or_none(st.compare(ys, off).median)
        out.append(row)
    return out


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        if args.concurrency == "1,2,4,8,16":
            args.concurrency = "1,2,4"
        args.max_tokens = 32 if args.max_tokens == 64 else args.max_tokens
        args.requests_per_level = args.requests_per_level or 4


def _measure(
    args: argparse.Namespace, server_args: list[str], levels: list[int], modes: list[str], per: dict[int, int]
) -> tuple[str, dict[str, Any], list[dict[str, Any]], float]:
    """(base URL, server info, cells, seconds): the sweep against the given or a launched server."""
    launched = None
    try:
        if args.launch:
            log_dir = Path(tempfile.mkdtemp(prefix="specserve-bench-"))
            launched = launch_server(server_args, log_dir / "server.log", args.launch_timeout)
            base_url = launched.base_url
        else:
            base_url = check_loopback(args.base_url, args.allow_remote, args.api_key)
        t0 = time.perf_counter()
        info = asyncio.run(server_info(base_url, args.api_key))
        cells = asyncio.run(sweep(base_url, args, levels, modes, per))
        return base_url, info, cells, time.perf_counter() - t0
    finally:
        if launched is not None:
            launched.stop()


def run_benchmark(args: argparse.Namespace, argv: list[str], server_args: list[str]) -> dict[str, Any]:
    _apply_quick(args)
    if bool(args.base_url) == bool(args.launch):
        raise BenchError("give exactly one of --base-url URL or --launch [-- server flags]")
    if server_args and not args.launch:
        raise BenchError("server flags after -- only make sense with --launch")
    levels, modes, per = _plan(args)
    if args.allow_remote and args.launch:
        raise BenchError("--allow-remote only applies to --base-url (--launch starts a local server)")
    if args.base_url:
        check_loopback(args.base_url, args.allow_remote, args.api_key)  # refuse before creating anything
    out_dir = output_dir(args, "serve")
    base_url, info, cells, bench_s = _measure(args, server_args, levels, modes, per)
    report = {
        **envelope(SCHEMA, "serve", argv),
        "server": {"base_url": base_url, "launched_with": server_args if args.launch else None, **info},
        "config": {
            "concurrency": levels,
            "modes": modes,
            "requests_per_level": per,
            "max_tokens": args.max_tokens,
            "max_tokens_range_ratio": args.max_tokens_range_ratio,
            "max_tokens_range": list(max_tokens_range(args.max_tokens, args.max_tokens_range_ratio)),
            "categories": parse_categories(args.categories),
            "repeats": args.repeats,
            "warmup": args.warmup,
            "cell_time_limit_s": args.cell_time_limit,
            "quick": args.quick,
            "bench_s": round(bench_s, 2),
        },
        "summary": summarize(cells, levels, modes),
        "cells": cells,
        "files": {},
    }
    write_report(report, out_dir, "serve", serve_report.markdown, serve_report.plot, not args.no_plots)
    return report


def main(argv: list[str]) -> int:
    own, server_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    args = build_parser().parse_args(own)
    try:
        report = run_benchmark(args, argv, server_args)
    except BenchError as exc:
        print(f"specserve bench serve: {exc}", file=sys.stderr)
        return 2
    print_report(report, serve_report.markdown)
    return 0
