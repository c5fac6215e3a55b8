"""The specserve server a load benchmark talks to (`bench serve`, `soak`): base URLs (loopback unless a
remote one is allowed explicitly), the bearer header, its /v1/models answer, and launching one on 127.0.0.1."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


class BenchError(Exception):
    pass


def loopback_url(
    base_url: str,
    error: type[Exception],
    *,
    schemes: tuple[str, ...] = ("http", "https"),
    who: str,
    allow_remote: bool | None = None,
) -> str:
    """The URL without a trailing slash or /v1; `error` unless it points at this machine or `allow_remote`.
    By default load tests only target this machine: a typo must not turn one into a flood against someone
    else's server; a remote target (a cluster's Service) has to be asked for explicitly (None: the caller
    offers no way to ask, False: it does but was not asked)."""
    parsed = urlparse(base_url)
    if parsed.scheme not in schemes or not parsed.hostname:
        raise error(f"--base-url must look like http://127.0.0.1:PORT, got {base_url!r}")
    host = parsed.hostname
    if host != "localhost" and not allow_remote:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise error(
                f"--base-url host {host!r} is not a loopback address (use 127.0.0.1); {who} only targets"
                " this machine" + ("" if allow_remote is None else " unless asked with --allow-remote")
            )
    try:
        parsed.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise error(f"--base-url has a bad port: {base_url!r}") from None
    return base_url.rstrip("/").removesuffix("/v1")


def bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def server_info(base_url: str, api_key: str | None) -> dict[str, Any]:
    """{"models": ...} from GET /v1/models, else {"models_status": HTTP status} or {"error": why}."""
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession() as s,
            s.get(
                base_url + "/v1/models", headers=bearer(api_key), timeout=aiohttp.ClientTimeout(total=10)
            ) as r,
        ):
            return {"models": await r.json()} if r.status == 200 else {"models_status": r.status}
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"error": str(exc)}


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
