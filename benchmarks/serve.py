"""`specserve bench serve`: a streaming load test against a specserve server on this machine.

A concurrency sweep (each level keeps C requests in flight over a fixed prompt set) with speculation on and
off in the SAME run: one server started with speculation, toggled per request with
`"speculative": {"enabled": false}`; the two modes alternate order from one level to the next. Reports
requests/s, output tokens/s, TTFT, ITL (gap between streamed chunks), TPOT ((e2e - TTFT) / (tokens - 1))
and E2E latency p50/p90/p99, plus the server's per-request acceptance stats.

Loopback only (127.0.0.0/8, ::1, localhost), and bounded: at most --max-total-requests requests, and each
cell stops issuing new requests after --cell-time-limit seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import stats as st
from .common import (
    command_line,
    default_output_dir,
    fmt,
    machine_info,
    md_table,
    now_iso,
    progress,
    use_agg,
    write_json,
)
from .prompt_sets import CATEGORIES, load_prompts, parse_categories

SCHEMA = "specserve.bench.serve/1"
MODES = ("off", "on")
logger = logging.getLogger("specserve.bench")


class BenchError(Exception):
    pass


def check_loopback(base_url: str) -> str:
    """Return the URL without a trailing slash, or raise BenchError if it does not point at this machine."""
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise BenchError(f"--base-url must look like http://127.0.0.1:PORT, got {base_url!r}")
    host = parsed.hostname
    if host != "localhost":
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise BenchError(f"--base-url host {host!r} is not a loopback address (use 127.0.0.1)") from None
        if not ip.is_loopback:
            raise BenchError(
                f"--base-url host {host!r} is not a loopback address: this benchmark only targets this machine"
            )
    return base_url.rstrip("/").removesuffix("/v1")


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


def request_body(
    messages: list[dict[str, Any]], max_tokens: int, mode: str, model: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": {"enabled": mode == "on"},
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
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
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
            await one_request(
                session,
                url,
                request_body(p.messages, args.max_tokens, mode, args.model),
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
    drafts = sum((r.spec or {}).get("num_drafts", 0) for r in ok)
    dtok = sum((r.spec or {}).get("num_draft_tokens", 0) for r in ok)
    acc = sum((r.spec or {}).get("num_accepted_tokens", 0) for r in ok)

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
        "acceptance_rate": round(acc / dtok, 4) if dtok else None,
        "mean_acceptance_length": round(1 + acc / drafts, 4) if drafts else None,
    }


# --- server launch -------------------------------------------------------------------------------------
@dataclass
class Launched:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def launch_server(
    server_args: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None
) -> Launched:
    """Start `specserve serve` on 127.0.0.1 (free port) and wait for its ready line (also used by tests)."""
    cmd = [
        sys.executable,
        "-m",
        "specserve.api.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *server_args,
    ]
    log = open(log_path, "w")  # noqa: SIM115 - owned by the server process for its lifetime
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        m = re.search(r"Server ready on (http://[\d.]+:\d+)", text)
        if m:
            return Launched(proc, m.group(1), log_path)
        if proc.poll() is not None:
            raise BenchError(f"server exited with {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    proc.wait(10)
    raise BenchError(f"server not ready within {timeout_s:.0f} s; log: {log_path}")


async def server_info(base_url: str, api_key: str | None) -> dict[str, Any]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(base_url + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r,
        ):
            return {"models": await r.json()} if r.status == 200 else {"models_status": r.status}
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"error": str(exc)}


# --- the benchmark -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve bench serve",
        description="Streaming load test against a specserve server on this machine: concurrency sweep, "
        "speculation on vs off per request in the same run. Server flags for --launch go after `--`.",
    )
    t = p.add_argument_group("target")
    t.add_argument(
        "--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (loopback only)"
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
        help="requests per (level, mode) cell (default: max(4, 2 x level))",
    )
    r.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    r.add_argument("--categories", default="all", help=f"prompt categories: {', '.join(CATEGORIES)} or all")
    r.add_argument(
        "--modes", default="off,on", help="speculation modes to compare: off,on (per-request toggle)"
    )
    r.add_argument("--repeats", type=int, default=1, help="repeats of every (level, mode) cell, interleaved")
    r.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests per mode")
    r.add_argument(
        "--cell-time-limit", type=float, default=300, help="stop issuing requests in a cell after this many s"
    )
    r.add_argument("--request-timeout", type=float, default=600, help="per-request timeout in s")
    r.add_argument("--max-total-requests", type=int, default=2000, help="refuse plans larger than this")
    r.add_argument("--quick", action="store_true", help="levels 1,2,4, 32 tokens, 4 requests per cell")
    o = p.add_argument_group("output")
    o.add_argument(
        "--output-dir", default=None, help="where serve.json/.md/.png go (default bench-results/serve-<time>)"
    )
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    return p


def _plan(args: argparse.Namespace) -> tuple[list[int], list[str], dict[int, int]]:
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not levels or any(c < 1 or c > 256 for c in levels):
        raise BenchError("--concurrency levels must be between 1 and 256")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise BenchError("--modes must be a comma list of on, off")
    per = {c: args.requests_per_level or max(4, 2 * c) for c in levels}
    total = sum(per.values()) * len(modes) * args.repeats + args.warmup * len(modes)
    if total > args.max_total_requests:
        raise BenchError(
            f"the plan has {total} requests, over --max-total-requests {args.max_total_requests}"
        )
    return levels, modes, per


async def sweep(
    base_url: str, args: argparse.Namespace, levels: list[int], modes: list[str], per: dict[int, int]
) -> list[dict[str, Any]]:
    prompts = load_prompts(parse_categories(args.categories))
    total = sum(per.values()) * len(modes) * args.repeats + args.warmup * len(modes)
    bar = progress(total, "bench serve", disable=args.no_progress)
    for mode in modes:
        for i in range(args.warmup):
            await run_cell(base_url, prompts, 1, 1, mode, _warm_args(args), i, lambda: bar.update(1))
    cells = []
    start = 0
    for li, c in enumerate(levels):
        for rep in range(args.repeats):
            order = modes if (li + rep) % 2 == 0 else modes[::-1]
            for mode in order:
                bar.set_postfix_str(f"concurrency {c} spec {mode}")
                # Both modes of a (level, repeat) see the same prompts in the same order.
                records, duration = await run_cell(
                    base_url, prompts, c, per[c], mode, args, start, lambda: bar.update(1)
                )
                cells.append(
                    {"concurrency": c, "mode": mode, "repeat": rep, **cell_summary(records, duration)}
                )
            start += per[c]
    bar.close()
    return cells


def _warm_args(args: argparse.Namespace) -> argparse.Namespace:
    warm = argparse.Namespace(**vars(args))
    warm.max_tokens = min(args.max_tokens, 8)
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
                "failed": sum(x["failed"] for x in cs),
            }
        if "on" in modes and "off" in modes:
            on = {
                x["repeat"]: x["output_tokens_per_s"]
                for x in cells
                if x["concurrency"] == c and x["mode"] == "on"
            }
            off = {
                x["repeat"]: x["output_tokens_per_s"]
                for x in cells
                if x["concurrency"] == c and x["mode"] == "off"
            }
            row["spec_speedup_output_tokens_per_s"] = st.round_or_none(st.median_paired_ratio(on, off))
        out.append(row)
    return out


def run_benchmark(args: argparse.Namespace, argv: list[str], server_args: list[str]) -> dict[str, Any]:
    if args.quick:
        if args.concurrency == "1,2,4,8,16":
            args.concurrency = "1,2,4"
        args.max_tokens = 32 if args.max_tokens == 64 else args.max_tokens
        args.requests_per_level = args.requests_per_level or 4
    if bool(args.base_url) == bool(args.launch):
        raise BenchError("give exactly one of --base-url URL or --launch [-- server flags]")
    if server_args and not args.launch:
        raise BenchError("server flags after -- only make sense with --launch")
    levels, modes, per = _plan(args)
    if args.base_url:
        check_loopback(args.base_url)  # refuse before creating anything
    out_dir = Path(args.output_dir) if args.output_dir else default_output_dir("serve")
    out_dir.mkdir(parents=True, exist_ok=True)
    launched = None
    try:
        if args.launch:
            log_dir = Path(tempfile.mkdtemp(prefix="specserve-bench-"))
            launched = launch_server(server_args, log_dir / "server.log", args.launch_timeout)
            base_url = launched.base_url
        else:
            base_url = check_loopback(args.base_url)
        t0 = time.perf_counter()
        info = asyncio.run(server_info(base_url, args.api_key))
        cells = asyncio.run(sweep(base_url, args, levels, modes, per))
        bench_s = time.perf_counter() - t0
    finally:
        if launched is not None:
            launched.stop()
    report = {
        "schema": SCHEMA,
        "created": now_iso(),
        "command": command_line("serve", argv),
        "machine": machine_info(),
        "server": {"base_url": base_url, "launched_with": server_args if args.launch else None, **info},
        "config": {
            "concurrency": levels,
            "modes": modes,
            "requests_per_level": per,
            "max_tokens": args.max_tokens,
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
    write_outputs(report, out_dir, plots=not args.no_plots)
    return report


def markdown(report: dict[str, Any]) -> str:
    cfg, mach = report["config"], report["machine"]
    lines = [
        "# specserve bench serve",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {mach.get('cpu_model')}, {mach.get('cpu_count')} CPUs, {mach.get('memory_gib')} GiB; "
        f"{report['created']}. Server: {report['server']['base_url']}"
        + (
            f" launched with `{' '.join(report['server']['launched_with'])}`"
            if report["server"].get("launched_with")
            else ""
        )
        + ".",
        "",
        f"Streaming chat completions, greedy, {cfg['max_tokens']} output tokens (EOS ignored), requests per "
        f"cell {cfg['requests_per_level']}, {cfg['repeats']} repeat(s); speculation toggled per request on one "
        "server. ITL = gap between streamed chunks (a chunk may carry several accepted tokens); "
        "TPOT = (E2E - TTFT) / (tokens - 1).",
        "",
    ]
    header = [
        "concurrency",
        "spec",
        "req/s",
        "out tok/s",
        "TTFT p50/p90/p99 s",
        "ITL p50/p90/p99 s",
        "TPOT p50 s",
        "E2E p50 s",
        "accept rate",
        "mean accept len",
        "failed",
    ]
    rows = []
    for cell in report["cells"]:

        def trio(d: dict[str, float | None]) -> str:
            return "/".join(fmt(d.get(k), 3) for k in ("p50", "p90", "p99"))

        rows.append(
            [
                str(cell["concurrency"]) + (f" (r{cell['repeat']})" if cfg["repeats"] > 1 else ""),
                cell["mode"],
                fmt(cell["requests_per_s"], 3),
                fmt(cell["output_tokens_per_s"]),
                trio(cell["ttft_s"]),
                trio(cell["itl_s"]),
                fmt(cell["tpot_s"]["p50"], 3),
                fmt(cell["e2e_s"]["p50"], 2),
                fmt(cell["acceptance_rate"]),
                fmt(cell["mean_acceptance_length"]),
                str(cell["failed"]),
            ]
        )
    lines += [md_table(header, rows), ""]
    if any("spec_speedup_output_tokens_per_s" in s for s in report["summary"]):
        rows = [
            [
                str(s["concurrency"]),
                fmt(s["off"]["output_tokens_per_s"]),
                fmt(s["on"]["output_tokens_per_s"]),
                fmt(s.get("spec_speedup_output_tokens_per_s"), 2, "x"),
            ]
            for s in report["summary"]
        ]
        lines += [
            "Speculation on vs off (output tokens/s, median of paired repeats):",
            "",
            md_table(["concurrency", "off", "on", "on / off"], rows),
            "",
        ]
        base = report["summary"][0]
        if base["concurrency"] == 1:
            rows = [
                [
                    str(s["concurrency"]),
                    *(
                        fmt((s[m]["output_tokens_per_s"] or 0) / base[m]["output_tokens_per_s"], 2, "x")
                        if base[m]["output_tokens_per_s"]
                        else "–"
                        for m in ("off", "on")
                    ),
                ]
                for s in report["summary"]
            ]
            lines += [
                "Total output tokens/s relative to concurrency 1:",
                "",
                md_table(["concurrency", "spec off", "spec on"], rows),
                "",
            ]
    for f in report["files"].get("plots", []):
        lines.append(f"![{Path(f).stem}]({Path(f).name})")
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    plt = use_agg()
    if plt is None:
        logger.warning("matplotlib not installed: no plots (pip install matplotlib)")
        return []
    summ = report["summary"]
    modes = report["config"]["modes"]
    xs = [s["concurrency"] for s in summ]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    panels = [
        ("output_tokens_per_s", "output tokens/s", 1.0),
        ("itl_p50_s", "ITL p50 (ms)", 1000.0),
        ("ttft_p50_s", "TTFT p50 (ms)", 1000.0),
    ]
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for mode in modes:
            ys = [(s[mode][key] or 0) * scale for s in summ]
            color = "tab:orange" if mode == "on" else "tab:blue"
            ax.plot(xs, ys, marker="o", color=color, label=f"spec {mode}")
            if key == "itl_p50_s":
                ax.plot(
                    xs,
                    [(s[mode]["tpot_p50_s"] or 0) * scale for s in summ],
                    marker="x",
                    color=color,
                    linestyle="--",
                    label=f"TPOT p50 spec {mode}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("concurrency", fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "serve.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [str(path)]


def write_outputs(report: dict[str, Any], out_dir: Path, plots: bool = True) -> None:
    report["files"] = {
        "json": str(out_dir / "serve.json"),
        "markdown": str(out_dir / "serve.md"),
        "plots": plot(report, out_dir) if plots else [],
    }
    write_json(out_dir / "serve.json", report)
    (out_dir / "serve.md").write_text(markdown(report))


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
    sys.stdout.write(markdown(report))
    print(f"\nwrote {report['files']['json']}", file=sys.stderr)
    return 0
