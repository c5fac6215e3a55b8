"""Loading a model with int8/int4 weights: from GGUF blocks where they map, and through a cache of
the packed layers so that only the first load pays for quantizing and packing.

The cache lives under `<cache_dir>/quantized/<key>/` (manifest.json + linear.safetensors) and holds
every nn.Linear of the model in its final form: the kernel-packed int4/int8 buffers, or the float
weight of a layer no kernel fits. Embeddings and norms still load from the float checkpoint. The
packed int4 layout is our kernel's tiles where that kernel runs, else whatever this torch build's CPU
packer produces, so the key includes the layout, the torch version and CPU capability along with the
source checkpoint, encoding and group size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .int4_kernel import default_int4_kernel
from .models.decoder import CausalDecoder
from .models.gguf_linear import GGUF_GROUP, AffineInt4, GgufLinearWeights
from .quantization import (
    Int4Linear,
    Int4TiledLinear,
    Int8Linear,
    LinearReplacer,
    check_encoding,
    int4_from_affine,
    int4_layer_class,
    quantize_int4,
    quantize_model,
    quantize_weight,
)

logger = logging.getLogger("specserve.engine")

PACKED_CACHE_VERSION = 2  # bump when the manifest or the meaning of a cached layer changes
_MANIFEST = "manifest.json"
_TENSORS = "linear.safetensors"


@dataclass(frozen=True)
class QuantizedLoadPlan:
    encoding: str
    group_size: int
    gguf_path: Path | None  # read linear weights from here instead of the float checkpoint
    cache_path: Path | None  # None: caching off

    @property
    def cached(self) -> bool:
        return self.cache_path is not None and (self.cache_path / _MANIFEST).is_file()

    @property
    def needs_float_linears(self) -> bool:
        """Whether the float checkpoint's linear weights must be loaded at all."""
        return not self.cached and self.gguf_path is None


def plan_quantized_load(
    source_dir: Path, gguf_path: Path | None, encoding: str, group_size: int, cache_root: Path | None
) -> QuantizedLoadPlan:
    check_encoding(encoding, group_size)
    cache_path = None
    if cache_root is not None:
        cache_path = cache_root / "quantized" / _cache_key(source_dir, gguf_path, encoding, group_size)
    return QuantizedLoadPlan(encoding, group_size, gguf_path, cache_path)


def _cache_key(source_dir: Path, gguf_path: Path | None, encoding: str, group_size: int) -> str:
    digest = hashlib.sha256()
    parts = [
        f"v{PACKED_CACHE_VERSION}",
        encoding,
        str(group_size),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        f"int4_layout={_int4_layout()}",
        str(source_dir.resolve()),
        f"gguf={gguf_path.resolve() if gguf_path else None}",
    ]
    # A checkpoint rewritten in place must miss: its files' sizes and mtimes are part of the key.
    for f in sorted(source_dir.glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    digest.update("\0".join(parts).encode())
    suffix = f"g{group_size}" if encoding == "int4" else ""
    return f"{source_dir.name}-{encoding}{suffix}-{digest.hexdigest()[:16]}"


@torch.no_grad()
def quantize_loaded_model(model: CausalDecoder, plan: QuantizedLoadPlan) -> None:
    """Give `model` (loaded with or without its float linear weights, per the plan) its quantized
    layers: from the packed cache, else from the GGUF's blocks or the model's own float weights."""
    if plan.cached:
        assert plan.cache_path is not None
        _load_packed(model, plan.cache_path)
        logger.info("loaded packed %s weights from %s", plan.encoding, plan.cache_path)
        return
    replace = None
    if plan.gguf_path is not None:
        replace = gguf_replacer(
            GgufLinearWeights(plan.gguf_path, model.config), plan.encoding, plan.group_size
        )
    quantize_model(model, plan.encoding, plan.group_size, replace)
    if plan.cache_path is not None:
        _save_packed(model, plan.cache_path)


# ---------------------------------------------------------------------------------------------------
# GGUF: int4 codes straight from Q4 blocks, exact float32 for the rest
# ---------------------------------------------------------------------------------------------------


def gguf_replacer(weights: GgufLinearWeights, encoding: str, group_size: int) -> LinearReplacer:
    def build(name: str, linear: nn.Linear) -> nn.Module:
        bias = linear.bias
        if encoding == "int4" and any(weights.direct_int4_parts(name)):
            return _int4_from_parts(weights.int4_parts(name), bias)
        weight = weights.float_weight(name)  # [N, K] float32
        layer = quantize_weight(weight, bias, encoding, group_size)
        if layer is None:  # no kernel fits: keep it float, filled from the GGUF values
            linear.weight.copy_(weight)
            return linear
        return layer

    return build


def _int4_from_parts(parts: list[AffineInt4 | torch.Tensor], bias: torch.Tensor | None) -> Int4Linear:
    """Stack a fused layer's parts at group size 32: Q4 parts keep their codes, any other part
    (e.g. a Q6_K v_proj beside Q4_K q/k) is quantized from float32 at the same group size."""
    codes, scales_and_zeros = [], []
    for part in parts:
        if isinstance(part, AffineInt4):
            codes.append(part.codes)
            scales_and_zeros.append(int4_from_affine(part.scales, part.mins))
        else:
            q, sz = quantize_int4(part, GGUF_GROUP)
            codes.append(q.to(torch.uint8))
            scales_and_zeros.append(sz)
    layer_class = int4_layer_class()
    return layer_class.from_codes(torch.cat(codes), torch.cat(scales_and_zeros, dim=1), GGUF_GROUP, bias)


# ---------------------------------------------------------------------------------------------------
# The packed cache
# ---------------------------------------------------------------------------------------------------


def _int4_layout() -> str:
    """Which int4 layout this process packs: our kernel's tiles, or PyTorch's packer's."""
    return int4_layer_class().LAYOUT


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear | Int4Linear | Int8Linear]:
    return {
        name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, Int4Linear, Int8Linear))
    }


def _save_packed(model: nn.Module, path: Path) -> None:
    """Write the model's linear layers; a failure (read-only or full disk) only costs the next load time."""
    layers: list[dict[str, Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in _linear_layers(model).items():
        entry: dict[str, object] = {"name": name, "bias": layer.bias is not None}
        if isinstance(layer, Int4Linear):
            entry.update(kind="int4", group_size=layer.group_size, out_features=layer.out_features)
            entry.update(layout=layer.LAYOUT)
            tensors[f"{name}.qweight"] = layer.qweight
            tensors[f"{name}.scales_and_zeros"] = layer.scales_and_zeros
        elif isinstance(layer, Int8Linear):
            entry.update(kind="int8")
            tensors[f"{name}.qweight"] = layer.qweight
            tensors[f"{name}.scales"] = layer.scales
        else:
            entry.update(kind="float")
            tensors[f"{name}.weight"] = layer.weight
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias
        layers.append(entry)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
        # A tied lm_head's float weight is the embedding: clone so safetensors sees no shared storage.
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp / _TENSORS))
        (tmp / _MANIFEST).write_text(
            json.dumps({"version": PACKED_CACHE_VERSION, "layers": layers}, indent=1)
        )
        tmp.chmod(0o755)
        os.rename(tmp, path)  # atomic: a reader sees the whole cache entry or none
    except Exception as e:  # a failure to cache must not fail the load itself
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not (path / _MANIFEST).is_file():  # another process may have won the rename
            logger.warning("could not cache packed weights at %s: %s", path, e)


def _load_packed(model: nn.Module, path: Path) -> None:
    manifest = json.loads((path / _MANIFEST).read_text())
    tensors = load_file(str(path / _TENSORS))
    device = next(model.parameters()).device
    for entry in manifest["layers"]:
        name = entry["name"]
        bias = tensors.get(f"{name}.bias") if entry["bias"] else None
        if entry["kind"] == "int4":
            int4_args = (
                tensors[f"{name}.qweight"],
                tensors[f"{name}.scales_and_zeros"],
                entry["group_size"],
                entry["out_features"],
                bias,
            )
            if entry["layout"] == Int4TiledLinear.LAYOUT:
                kernel = default_int4_kernel()
                if kernel is None:  # the key names the layout: not expected
                    raise RuntimeError(
                        f"{path} holds the tiled int4 layout, but the int4 kernel is unavailable"
                    )
                layer: nn.Module = Int4TiledLinear(*int4_args, kernel)
            else:
                layer = Int4Linear(*int4_args)
        elif entry["kind"] == "int8":
            layer = Int8Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], bias)
        else:
            layer = model.get_submodule(name)
            assert isinstance(layer, torch.nn.Linear)
            layer.weight.copy_(tensors[f"{name}.weight"])
            if bias is not None:
                layer.bias.copy_(bias)
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer.to(device))
