"""Start a real `specserve serve` process on 127.0.0.1 (random free port) for API tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.benchmarks.serve import launch_server


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
    flags = [
        "--model-path", str(model_dir),
        "--quantization-encoding", "float32",
        "--max-kv-cache-tokens", "8192",
        "--log-stats-interval", "0",
        *extra,
    ]  # fmt: skip
    launched = launch_server(flags, log_path, startup_timeout, env={**os.environ, **(env or {})})
    return RunningServer(launched.process, launched.base_url, log_path)
