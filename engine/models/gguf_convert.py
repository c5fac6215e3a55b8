"""Streaming GGUF -> Hugging Face directory conversion, cached under `<cache_dir>/converted/<key>/`.

Tensors are dequantized one at a time (large ones in row chunks) and their bytes streamed straight
into safetensors shards whose headers are planned up front, so peak memory is about one tensor chunk
rather than the whole model (transformers' own GGUF load holds everything: ~5.6 GB for a 1.5B model).
The result is written to a temp dir and renamed into place, so an interrupted conversion leaves no
half cache, and the cache key hashes the file's content so a second load is instant.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from .errors import ModelLoadError
from .gguf_metadata import (
    PERMUTED_QK_ARCHITECTURES,
    ROPE_FREQS,
    architecture_of,
    build_configs,
    field,
    hf_tensor_name,
    unpermute_qk,
)

# Bump when the output layout changes so stale caches are not reused.
CONVERTER_VERSION = 1
SHARD_BYTES = 1 << 30  # ~1 GB shards, like save_pretrained's default granularity
CHUNK_BYTES = 32 << 20  # float32 working set per dequantized chunk
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class _Planned:
    source: ReaderTensor
    name: str  # HF name
    shape: tuple[int, ...]  # HF (row-major) shape
    nbytes: int  # in the target dtype


def find_gguf_in_dir(directory: Path) -> Path | None:
    """The single .gguf file in `directory`, None if there is none; several is an error."""
    found = sorted(directory.glob("*.gguf"))
    if len(found) > 1:
        listed = ", ".join(p.name for p in found)
        raise ModelLoadError(f"{directory} holds several GGUF files ({listed}); pass one with --weight-path")
    return found[0] if found else None


def cache_key(path: Path, dtype: torch.dtype) -> str:
    """Content identity (size + header + tail) plus dtype: survives copies, catches re-downloads."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}:{dtype}".encode())
    with path.open("rb") as f:
        digest.update(f.read(16 << 20))  # metadata (tokenizer included) sits at the front
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return f"{path.stem}-{str(dtype).removeprefix('torch.')}-{digest.hexdigest()[:16]}"


def convert_gguf(gguf_path: Path, cache_dir: Path, dtype: torch.dtype, *, progress: bool = True) -> Path:
    """Return a HF-layout directory for `gguf_path`, converting it on first use."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    root = cache_dir / "converted"
    target = root / cache_key(gguf_path, dtype)
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        template = _write_model(gguf_path, dtype, tmp, progress)
        # GGUFReader's parsed metadata (~0.5 GB for Qwen's 151k-token vocabulary) is gone by now, so
        # transformers' tokenizer build does not stack on top of it.
        gc.collect()
        _write_tokenizer(gguf_path, template, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; its result is as good as ours.
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_model(gguf_path: Path, dtype: torch.dtype, out: Path, progress: bool) -> str | None:
    """Config, generation config and weights into `out`; returns the chat template, if any."""
    reader = _open_reader(gguf_path)
    arch = architecture_of(reader)
    _check_complete(reader, gguf_path)
    config, generation = build_configs(reader, arch, dtype, _rope_freqs(reader))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    _write_weights(reader, gguf_path, arch, config, dtype, out, progress)
    return field(reader, "tokenizer.chat_template")


def _open_reader(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises bare ValueError/IndexError on bad files
        detail = " ".join(str(e).split())[:200]
        raise ModelLoadError(f"{path} is not a valid GGUF file (corrupted or truncated?): {detail}") from e


def _check_complete(reader: GGUFReader, path: Path) -> None:
    if reader.byte_order != "I":
        raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path} is truncated: tensor data needs {end} bytes, file has {size}")


def _rope_freqs(reader: GGUFReader) -> np.ndarray | None:
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    return None if t is None else np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(gguf_path: Path, template: str | None, out: Path) -> None:
    """transformers builds the fast tokenizer (vocab, merges, special tokens) from GGUF metadata."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from {gguf_path.name}: {e}") from e
    if template and not tok.chat_template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    # Also keep the template inline: readers of tokenizer_config.json alone then still find it.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if tok.chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = tok.chat_template
        _write_json(cfg_path, cfg)


def _plan(reader: GGUFReader, dtype: torch.dtype) -> list[_Planned]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    planned = []
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        planned.append(_Planned(t, hf_tensor_name(t.name), shape, int(np.prod(shape)) * itemsize))
    return planned


def _shards(planned: list[_Planned]) -> list[list[_Planned]]:
    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in planned:
        if shards[-1] and size + p.nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _write_weights(
    reader: GGUFReader, path: Path, arch: str, config: dict, dtype: torch.dtype, out: Path, progress: bool
) -> None:
    planned = _plan(reader, dtype)
    shards = _shards(planned)
    total = sum(p.nbytes for p in planned)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    permuted = arch in PERMUTED_QK_ARCHITECTURES
    with (
        path.open("rb") as src,
        tqdm(
            total=total, unit="B", unit_scale=True, desc=f"Converting {path.name}", disable=not progress
        ) as bar,
    ):
        for shard, name in zip(shards, names, strict=True):
            with (out / name).open("wb") as dst:
                dst.write(_safetensors_header(shard, dtype))
                for p in shard:
                    proj = p.name.rsplit(".", 2)[-2]
                    n_heads = heads.get(proj) if permuted else None
                    for chunk in _dequantized_chunks(src, p, dtype, n_heads):
                        dst.write(chunk.reshape(-1).view(torch.uint8).numpy().data)
                        bar.update(chunk.numel() * chunk.element_size())
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {p.name: name for shard, name in zip(shards, names, strict=True) for p in shard},
        }
        _write_json(out / "model.safetensors.index.json", index)


def _safetensors_header(shard: list[_Planned], dtype: torch.dtype) -> bytes:
    """Header for tensors laid out back to back in `shard` order (the format's 8-byte length prefix
    + JSON, padded with spaces to 8-byte alignment)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in shard:
        header[p.name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _dequantized_chunks(
    src: io.BufferedIOBase, p: _Planned, dtype: torch.dtype, n_heads: int | None
) -> Iterator[torch.Tensor]:
    """Row chunks of the tensor in `dtype`, read with plain file reads (not the memmap) so the
    quantized bytes do not accumulate in our resident set."""
    t = p.source
    raw_shape = tuple(t.data.shape)  # rows x (bytes or elements) per row, as the gguf package lays it out
    row_bytes = t.n_bytes // raw_shape[0]
    row_floats = int(np.prod(p.shape[1:])) * 4 if len(p.shape) > 1 else int(np.prod(p.shape)) * 4
    # q/k rows are un-permuted per head, so those (small) tensors are processed whole.
    rows_per_chunk = raw_shape[0] if n_heads or len(p.shape) == 1 else max(1, CHUNK_BYTES // row_floats)
    src.seek(t.data_offset)
    for start in range(0, raw_shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, raw_shape[0] - start)
        buf = bytearray(rows * row_bytes)  # writable, so numpy/torch views need no copy
        if src.readinto(buf) != len(buf):
            raise ModelLoadError(f"GGUF tensor {t.name} is truncated")
        raw = np.frombuffer(buf, dtype=t.data.dtype).reshape(rows, *raw_shape[1:])
        values = torch.from_numpy(np.ascontiguousarray(dequantize(raw, t.tensor_type), dtype=np.float32))
        values = values.reshape(-1, *p.shape[1:]) if len(p.shape) > 1 else values.reshape(p.shape)
        if n_heads:
            values = unpermute_qk(values, n_heads)
        yield values.to(dtype).contiguous()
