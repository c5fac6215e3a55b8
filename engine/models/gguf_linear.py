"""Linear-layer weights read straight from a GGUF file, for quantized loading.

Q4_0, Q4_1 and Q4_K store 4-bit codes with one (scale, min) per 32 weights along a row, which is
exactly the shape of the int4 kernel's groups (group size 32): such tensors become int4 layers
without passing through floats, so the model keeps llama.cpp's own codes (only the scales are
rounded to bf16). Everything else (Q5_0, Q6_K, Q8_0, F16, ...) is dequantized to float32 here, not
to the converted bf16 copy, so a later int8/int4 quantization rounds once, not twice.

Q8_0 has one scale per 32 weights while the int8 kernel has one per output channel, so it cannot be
mapped code for code; it is requantized per channel from its exact float32 values.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from .arch import ArchConfig
from .errors import ModelLoadError
from .gguf_metadata import PERMUTED_QK_ARCHITECTURES, ROPE_FREQS, hf_tensor_name, unpermute_qk
from .registry import family_of

GGUF_GROUP = 32  # weights per (scale, min) in Q4_0 / Q4_1 / Q4_K
DIRECT_INT4_TYPES = frozenset(
    {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K}
)
_ROWS_PER_CHUNK = 4096  # bounds the float32 temporaries of dequantizing a 152k-row lm_head


@dataclass
class AffineInt4:
    """4-bit codes with w = codes * scales + mins per group of 32 along K."""

    codes: torch.Tensor  # [N, K] uint8 in [0, 15]
    scales: torch.Tensor  # [N, K/32] float32
    mins: torch.Tensor  # [N, K/32] float32


# ---------------------------------------------------------------------------------------------------
# Block decoding (pure numpy; each returns codes [B, block], scales and mins [B, block/32])
# ---------------------------------------------------------------------------------------------------


def _f16(column: np.ndarray) -> np.ndarray:  # [B, 2] uint8 -> [B, 1] float32
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # 18 bytes: d (f16), 16 bytes of nibbles; weight i is the low nibble of byte i, weight i+16 the
    # high nibble; w = d * (q - 8).
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1), d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # 20 bytes: d (f16), m (f16), nibbles as Q4_0; w = d * q + m.
    d, m, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1), d, m


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # 144 bytes per 256 weights: d, dmin (f16), 12 bytes holding eight 6-bit scales and eight 6-bit
    # mins, 128 bytes of nibbles. Each 64-weight chunk j uses 32 bytes: low nibbles are sub-block 2j,
    # high nibbles sub-block 2j+1. w = d * sc[s] * q - dmin * m[s].
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    lo, hi, mixed = packed[:, 0], packed[:, 1], packed[:, 2]  # [B, 4] each
    # Sub-blocks 0-3 keep 6 bits in bytes 0-3 (scales) and 4-7 (mins); 4-7 take 4 low bits from
    # bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-3 / 4-7.
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 6) << 4)], axis=1)  # [B, 8]
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 6) << 4)], axis=1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 256)
    return codes, d * sc.astype(np.float32), -dmin * mn.astype(np.float32)


_DECODERS = {
    GGMLQuantizationType.Q4_0: (18, 32, _q4_0),
    GGMLQuantizationType.Q4_1: (20, 32, _q4_1),
    GGMLQuantizationType.Q4_K: (144, 256, _q4_k),
}


def decode_int4_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, k: int) -> AffineInt4:
    """raw [rows, bytes per row] uint8 of a Q4_0/Q4_1/Q4_K tensor with rows of k weights."""
    block_bytes, block_weights, decode = _DECODERS[qtype]
    rows = raw.shape[0]
    if k % block_weights or raw.shape[1] != k // block_weights * block_bytes:
        raise ModelLoadError(f"{qtype.name} row of {raw.shape[1]} bytes does not hold {k} weights")
    codes, scales, mins = decode(np.ascontiguousarray(raw).reshape(-1, block_bytes))
    return AffineInt4(
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8).reshape(rows, k)),
        torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, k // GGUF_GROUP)),
        torch.from_numpy(np.ascontiguousarray(mins).reshape(rows, k // GGUF_GROUP)),
    )


# ---------------------------------------------------------------------------------------------------
# The file's tensor index, without its metadata
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    name: str  # GGUF name
    tensor_type: GGMLQuantizationType
    k: int  # weights per row (GGUF's first, innermost dimension)
    rows: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def row_bytes(self) -> int:
        block_weights, block_bytes = GGML_QUANT_SIZES[self.tensor_type]
        return self.k // block_weights * block_bytes


# GGUF metadata value types -> fixed byte sizes (8 = string, 9 = array are variable).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_tensor_index(path: Path) -> tuple[str, list[TensorInfo]]:
    """(general.architecture, every tensor's type/shape/offset) of a little-endian GGUF v2/v3 file.

    gguf.GGUFReader parses every metadata value into numpy views first, ~10 s for SmolLM2's 49k-token
    vocabulary and more for Qwen's 152k; this walks past the metadata and reads only the index."""
    with path.open("rb") as f:
        # The index is small; 64 MB covers a 152k-token vocabulary several times over. Grow if not.
        size = 64 << 20
        while True:
            f.seek(0)
            buf = f.read(size)
            try:
                return _parse_index(path, memoryview(buf))
            except (struct.error, IndexError):
                if len(buf) < size:  # the whole file was read and it still does not parse
                    raise ModelLoadError(f"{path} is not a valid GGUF file (truncated index)") from None
                size *= 4


def _parse_index(path: Path, buf: memoryview) -> tuple[str, list[TensorInfo]]:
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ModelLoadError(f"{path} is not a GGUF v2/v3 file")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

    def skip(vtype: int, count: int = 1) -> None:
        nonlocal pos
        if vtype in _SCALAR_BYTES:
            pos += _SCALAR_BYTES[vtype] * count
        elif vtype == 8:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, pos)
                pos += 8 + n
        elif vtype == 9:
            for _ in range(count):
                elem, n = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                skip(elem, n)
        else:
            raise ModelLoadError(f"{path}: unknown GGUF metadata type {vtype}")

    arch, alignment = "", 32
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture" and vtype == 8:
            arch = string()
        elif key == "general.alignment" and vtype == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
            pos += 4
        else:
            skip(vtype)
    raw = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw.append((name, qtype, dims, offset))
    data_start = pos + (-pos % alignment)
    infos = [
        TensorInfo(
            name, GGMLQuantizationType(qtype), int(dims[0]), int(np.prod(dims[1:])), data_start + offset
        )
        for name, qtype, dims, offset in raw
    ]
    return arch, infos


# ---------------------------------------------------------------------------------------------------
# Tensors of one GGUF file, by the linear layer of our decoder they feed
# ---------------------------------------------------------------------------------------------------


class GgufLinearWeights:
    """Look up the GGUF tensors behind each nn.Linear of the decoder built from this file (its
    family's weight layout says which HF projections a fused layer stacks)."""

    def __init__(self, path: Path, config: ArchConfig):
        self.path = path
        arch, infos = read_tensor_index(path)
        self.tensors: dict[str, TensorInfo] = {
            hf_tensor_name(t.name): t for t in infos if t.name != ROPE_FREQS
        }
        self._fused = family_of(config).weight_layout.fused
        permuted = arch in PERMUTED_QK_ARCHITECTURES
        # llama.cpp permutes llama q/k rows per head; undo it on whatever we read (codes or floats).
        self._heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads} if permuted else {}

    def _sources(self, linear_name: str) -> list[tuple[TensorInfo, int | None]]:
        """The GGUF tensor(s) of a linear layer (`layers.3.mlp.gate_up_proj`, `lm_head`), in the
        order they are stacked, each with the head count to un-permute its rows by (or None)."""
        if linear_name == "lm_head":
            hf = ["lm_head.weight" if "lm_head.weight" in self.tensors else "model.embed_tokens.weight"]
        else:
            prefix, _, module = linear_name.partition(".")  # "layers", "3.mlp.gate_up_proj"
            layer, _, module = module.partition(".")
            fused = self._fused.get(module)
            parts = fused.parts if fused is not None else (module,)
            hf = [f"model.{prefix}.{layer}.{part}.weight" for part in parts]
        missing = [name for name in hf if name not in self.tensors]
        if missing:
            raise ModelLoadError(f"{self.path.name} has no tensor for {missing[0]}")
        return [(self.tensors[n], self._heads.get(n.rsplit(".", 2)[-2])) for n in hf]

    def direct_int4_parts(self, linear_name: str) -> list[bool]:
        """Which stacked parts of the layer are Q4 blocks that map straight to int4 codes."""
        return [t.tensor_type in DIRECT_INT4_TYPES for t, _ in self._sources(linear_name)]

    def float_weight(self, linear_name: str) -> torch.Tensor:
        """The layer's weight [N, K] as exact float32 values."""
        return torch.cat([self._part_float(t, heads) for t, heads in self._sources(linear_name)])

    def int4_parts(self, linear_name: str) -> list[AffineInt4 | torch.Tensor]:
        """Each stacked part as int4 codes where its blocks allow, else as float32 [n, K]."""
        return [
            self._part_int4(t, heads) if t.tensor_type in DIRECT_INT4_TYPES else self._part_float(t, heads)
            for t, heads in self._sources(linear_name)
        ]

    def _row_chunks(self, t: TensorInfo) -> list[np.ndarray]:
        """The tensor's raw bytes [rows, bytes per row], in row chunks copied out of the file."""
        data = np.memmap(self.path, np.uint8, "r", offset=t.offset, shape=(t.rows, t.row_bytes))
        return [np.array(data[i : i + _ROWS_PER_CHUNK]) for i in range(0, t.rows, _ROWS_PER_CHUNK)]

    def _part_float(self, t: TensorInfo, heads: int | None) -> torch.Tensor:
        k = t.k
        chunks = [
            torch.from_numpy(np.asarray(dequantize(c, t.tensor_type), dtype=np.float32))
            for c in self._row_chunks(t)
        ]
        w = torch.cat(chunks).reshape(-1, k)
        return unpermute_qk(w, heads).contiguous() if heads else w

    def _part_int4(self, t: TensorInfo, heads: int | None) -> AffineInt4:
        k = t.k
        parts = [decode_int4_blocks(c, t.tensor_type, k) for c in self._row_chunks(t)]
        codes, scales, mins = (torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins"))
        if heads:  # a row permutation: codes and their per-row groups move together
            codes, scales, mins = (unpermute_qk(x, heads).contiguous() for x in (codes, scales, mins))
        return AffineInt4(codes, scales, mins)
