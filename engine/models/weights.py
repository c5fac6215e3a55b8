"""Load HF-named safetensors weights into a decoder, following its family's `WeightLayout` (which
checkpoint projections are stacked into which fused layer)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open

from .decoder import CausalDecoder
from .layout import WeightLayout


class WeightLoadError(ValueError):
    pass


def load_safetensors_weights(
    model: CausalDecoder, directory: Path, layout: WeightLayout, skip: Collection[str] = frozenset()
) -> None:
    """Copy every tensor of `directory/*.safetensors` into `model`; raise if any parameter stays
    unset, except those named in `skip` (our parameter names), which are left unread."""
    params = dict(model.named_parameters())
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {directory}")
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    target, shard = layout.target(name)
                    if target is None or target in skip:
                        continue
                    if target not in params:
                        if target == "lm_head.weight" and tied:
                            continue
                        raise WeightLoadError(f"unexpected tensor {name!r} in {file.name}")
                    tensor = f.get_tensor(name)
                    dest: torch.Tensor = params[target]
                    key = target
                    if shard is not None:  # rows of a fused layer
                        fused = layout.fused_of(target)
                        assert fused is not None  # layout.target only returns shards of fused layers
                        offsets = fused.offsets(model.config)
                        dest, key = dest[offsets[shard] : offsets[shard + 1]], f"{target}#{shard}"
                    if tuple(tensor.shape) != tuple(dest.shape):
                        raise WeightLoadError(
                            f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
                        )
                    dest.copy_(tensor)
                    loaded.add(key)
    _check_complete({k: v for k, v in params.items() if k not in skip}, loaded, layout, tied)


def _check_complete(
    params: dict[str, torch.nn.Parameter], loaded: set[str], layout: WeightLayout, tied: bool
) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and tied:
            continue
        fused = layout.fused_of(name)
        need = [name] if fused is None else [f"{name}#{i}" for i in range(len(fused.parts))]
        missing += [n for n in need if n not in loaded]
    if missing:
        raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
