"""Hugging Face hub access: local HF cache first, download only when the hub is reachable.

Offline must fail fast: rather than letting huggingface_hub retry against an unreachable host, we
decide up front (HF_HUB_OFFLINE, the caller's flag, or a ~2 s TCP probe) and never call it online then.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from ..model_source import looks_like_hub_id
from .errors import ModelLoadError

__all__ = ["looks_like_hub_id"]  # re-exported: defined without torch for the CLI's early check

# What a decoder needs from a hub repo; skips .bin/.gguf/.onnx duplicates of the same weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]
PROBE_TIMEOUT_S = 2.0


def _hf_cache() -> str | None:
    # Read at call time (huggingface_hub reads its env once, at import), so tests can redirect it.
    return os.environ.get("HF_HUB_CACHE")


def has_weights(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def from_hf_cache(repo_id: str) -> Path | None:
    """The snapshot directory if the HF cache holds config + safetensors for `repo_id`."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(
            snapshot_download(
                repo_id, local_files_only=True, allow_patterns=ALLOW_PATTERNS, cache_dir=_hf_cache()
            )
        )
    except Exception:  # LocalEntryNotFoundError, validation errors, ...: simply not cached
        return None
    return path if has_weights(path) else None


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _probe(host: str, port: int, timeout: float) -> str | None:
    """None if a TCP connection opens within `timeout`, else why not.

    Runs in a daemon thread because DNS resolution ignores socket timeouts and can hang on its own.
    """
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as e:
            result.append(f"{host}:{port} unreachable ({e.__class__.__name__}: {e})")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return result[0] if result else f"{host}:{port} did not answer within {timeout:.0f} s"


def offline_reason(offline: bool | None) -> str | None:
    """Why the hub must not be contacted, or None when it may be."""
    if offline:
        return "offline mode requested"
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    if offline is False:
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlparse(proxy) if proxy and endpoint.scheme == "https" else endpoint
    port = target.port or (443 if target.scheme == "https" else 80)
    return _probe(target.hostname or "huggingface.co", port, PROBE_TIMEOUT_S)


def download(repo_id: str) -> Path:
    """Download config, tokenizer and safetensors of `repo_id` into the HF cache."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(
            snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, cache_dir=_hf_cache(), etag_timeout=10)
        )
    except Exception as e:
        detail = " ".join(str(e).split())[:200]
        raise ModelLoadError(f"hub download of {repo_id} failed: {e.__class__.__name__}: {detail}") from e
    if not has_weights(path):
        raise ModelLoadError(f"hub repo {repo_id} has no config.json + *.safetensors weights")
    return path
