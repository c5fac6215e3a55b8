"""Start a real `specserve serve` process on 127.0.0.1 (random free port) for API tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)


def start_server(
    model_dir: Path,
    log_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    startup_timeout: float = 120,
) -> RunningServer:
    """Launch the server with a tiny float32 model and a fixed KV cache; wait for the ready line."""
    log_path = log_dir / f"server-{time.monotonic_ns()}.log"
    args = [
        sys.executable,
        "-m",
        "specserve.api.cli",
        "serve",
        "--model-path",
        str(model_dir),
        "--quantization-encoding",
        "float32",
        "--max-kv-cache-tokens",
        "8192",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-stats-interval",
        "0",
        *extra,
    ]
    log = open(log_path, "w")  # noqa: SIM115 - owned by the process for its lifetime
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        m = re.search(r"Server ready on (http://[\d.]+:\d+)", text)
        if m:
            return RunningServer(proc, m.group(1), log_path)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server not ready within {startup_timeout} s:\n{log_path.read_text()[-3000:]}")
