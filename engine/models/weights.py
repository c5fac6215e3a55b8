"""Load HF-named safetensors weights into the decoder, fusing q/k/v and gate/up on the way."""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import safe_open

from .llama import LlamaForCausalLM

# HF name suffix -> (our fused parameter suffix, shard index among the fused parts)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class WeightLoadError(ValueError):
    pass


def _fused_offsets(model: LlamaForCausalLM, fused: str) -> list[int]:
    cfg = model.config
    if "qkv_proj" in fused:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [0, q, q + kv, q + 2 * kv]
    return [0, cfg.intermediate_size, 2 * cfg.intermediate_size]


def load_safetensors_weights(
    model: LlamaForCausalLM, directory: Path, skip: Collection[str] = frozenset()
) -> None:
    """Copy every tensor of `directory/*.safetensors` into `model`; raise if any parameter stays
    unset, except those named in `skip` (our parameter names), which are left unread."""
    params = dict(model.named_parameters())
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {directory}")
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    target, shard = _map_name(name)
                    if target is None or target in skip:
                        continue
                    if target not in params:
                        if target == "lm_head.weight" and model.config.tie_word_embeddings:
                            continue
                        raise WeightLoadError(f"unexpected tensor {name!r} in {file.name}")
                    tensor = f.get_tensor(name)
                    param = params[target]
                    if shard is None:
                        if tuple(tensor.shape) != tuple(param.shape):
                            raise WeightLoadError(
                                f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}"
                            )
                        param.copy_(tensor)
                        loaded.add(target)
                    else:
                        offsets = _fused_offsets(model, target)
                        part = param[offsets[shard] : offsets[shard + 1]]
                        if tuple(tensor.shape) != tuple(part.shape):
                            raise WeightLoadError(
                                f"{name}: shape {tuple(tensor.shape)} != expected {tuple(part.shape)}"
                            )
                        part.copy_(tensor)
                        loaded.add(f"{target}#{shard}")
    _check_complete(model, {k: v for k, v in params.items() if k not in skip}, loaded)


def _map_name(name: str) -> tuple[str | None, int | None]:
    if name.startswith("model.embed_tokens."):
        return name.removeprefix("model."), None
    if name.startswith("model.norm."):
        return name.removeprefix("model."), None
    if name.startswith("lm_head."):
        return name, None
    m = _LAYER.match(name)
    if m is None:
        return None, None  # e.g. rotary inv_freq buffers some checkpoints carry
    layer, module, kind = m.groups()
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", shard
    return f"layers.{layer}.{module}.{kind}", None


def _check_complete(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], loaded: set[str]) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            need = [f"{name}#{i}" for i in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            need = [f"{name}#{i}" for i in range(2)]
        else:
            need = [name]
        missing += [n for n in need if n not in loaded]
    if missing:
        raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
