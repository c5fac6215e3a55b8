"""The EAGLE(-1/2) draft head: one decoder layer that predicts the target's next feature.

What it computes (Li et al., EAGLE, 2024). The target's feature f_i is its final-normed hidden state at
position i (`CausalDecoder.forward`'s output, what it computes logits from). The head reads pairs
(f_i, x_{i+1}) -- a feature and the token the target emitted after it -- as

    h_i = fc([embed(x_{i+1}); f_i])          fc: Linear(2 x hidden -> hidden), embeddings first
    f^_{i+1} = layer(h_{<=i})                one pre-norm decoder layer, causal over the pairs
    draft token x_{i+2} ~ lm_head(f^_{i+1})  the target's own LM head (or its draft-vocabulary rows)

and drafts autoregressively in feature space: the next pair is (f^_{i+1}, the drafted token). The
layer is the target family's decoder layer (same heads, head size, rope, attention bias); in the
published EAGLE-1 checkpoints it has no input norm (the pair is already normalised), which
`input_norm=False` reproduces.

Checkpoint layout (the published EAGLE repositories, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): a directory
with config.json (a Llama-style config with num_hidden_layers 1) and pytorch_model.bin or
model.safetensors holding `fc.weight` [hidden, 2 hidden], optional `fc.bias`, and
`layers.0.self_attn.{q,k,v,o}_proj.*`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight` (and `layers.0.input_layernorm.weight` when the layer has
one). `embed_tokens.weight` is the target's and is not used; EAGLE-3 checkpoints (`midlayer.*`, `d2t`)
are refused. `specserve train-draft --method eagle` writes this layout as model.safetensors, plus
`draft_vocab.safetensors` (FR-Spec: `token_ids` [N], the target ids of a truncated vocabulary; the
same file the Medusa proposer reads).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.engine.attention import AttentionMetadata
from specserve.engine.models.arch import ArchConfig
from specserve.engine.models.decoder import KVCache, zeroed_kv_storage
from specserve.engine.models.layers import DecoderLayer, make_rope
from specserve.engine.proposer import ProposerError
from specserve.plugins.medusa import DRAFT_VOCAB_FILE, _load_draft_vocab

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"  # the published EAGLE checkpoints' format
# Checkpoint projections -> our fused nn.Linear layers (stacking order along the output dimension).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
IGNORED = ("embed_tokens.weight", "lm_head.weight")  # the target's own: the head borrows them


class EagleHead(nn.Module):
    def __init__(self, arch: ArchConfig, fc_bias: bool = True, input_norm: bool = False):
        super().__init__()
        self.arch = arch  # one-layer config: the target's layer shape
        hidden = arch.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layer = DecoderLayer(arch, make_rope(arch))
        self.input_norm = input_norm
        if not input_norm:
            self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[..., hidden] token embeddings and target features -> [..., hidden] layer input."""
        return self.fc(torch.cat([embeds, features], dim=-1))

    def forward_paged(
        self,
        embeds: torch.Tensor,  # [T, hidden]: embeddings of x_{i+1}
        features: torch.Tensor,  # [T, hidden]: f_i (target's) or f^_i (the head's own)
        positions: torch.Tensor,  # [T]: i
        cache: tuple[torch.Tensor, torch.Tensor],  # the head's one-layer KV, slots like the target's
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: f^_{i+1}
        return self.layer(self.fuse(embeds, features), positions, cache, meta)

    def forward_dense(
        self,
        embeds: torch.Tensor,  # [B, T, hidden]
        features: torch.Tensor,  # [B, T, hidden]
        positions: torch.Tensor,  # [T]: the pairs' positions (the same for every row of the batch)
        key_padding: torch.Tensor | None = None,  # [B, T] bool, True = a real pair (training batches)
    ) -> torch.Tensor:  # [B, T, hidden]
        """The same computation over whole sequences with causal attention (training: autograd, no
        KV cache). Agrees with `forward_paged` up to float rounding (tested)."""
        length = embeds.shape[1]
        x = self.fuse(embeds, features)  # [B, T, hidden]
        q, k, v = self.dense_qkv(x, positions)
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()  # [T, T]
        if key_padding is not None:
            mask = mask & key_padding[:, None, None, :]  # [B, 1, T, T]
            mask = mask | torch.eye(length, dtype=torch.bool, device=x.device)  # no empty rows
        return self.dense_finish(x, q, k, v, mask)

    def dense_qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, hidden] layer input -> q [B, H, T, D], k and v [B, KVH, T, D] (roped, normed)."""
        batch, length, _ = x.shape
        attn = self.layer.self_attn
        qkv = attn.qkv_proj(self.layer.input_layernorm(x))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(batch * length, attn.num_heads, attn.head_dim)
        k = k.reshape(batch * length, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rope(positions.repeat(batch), q, k)
        q = q.view(batch, length, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = k.view(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.reshape(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        return q, k, v

    def dense_finish(
        self,
        x: torch.Tensor,  # [B, T, hidden]: the layer input the queries came from
        q: torch.Tensor,  # [B, H, T, D]
        k: torch.Tensor,  # [B, KVH, S, D]: S keys (more than T when a chain attends to earlier depths)
        v: torch.Tensor,  # [B, KVH, S, D]
        mask: torch.Tensor,  # [T, S] or [B, 1, T, S] bool, True = may attend
    ) -> torch.Tensor:  # [B, T, hidden]: the layer's output
        batch, length, _ = x.shape
        attn = self.layer.self_attn
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=attn.scale, enable_gqa=attn.num_kv_heads != attn.num_heads
        )  # [B, H, T, D]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, attn.q_size))
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def allocate_kv_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (num_slots, self.arch.num_kv_heads, self.arch.head_dim)
        return [(zeroed_kv_storage(shape, dtype, device), zeroed_kv_storage(shape, dtype, device))]


def head_arch(target: ArchConfig, intermediate_size: int | None = None) -> ArchConfig:
    """The head's layer shape: the target's, one layer (a checkpoint may use another MLP width)."""
    return dataclasses.replace(
        target, num_layers=1, intermediate_size=intermediate_size or target.intermediate_size
    )


def hf_config(arch: ArchConfig, fc_bias: bool, input_norm: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """config.json of a head: the Llama-style config the published checkpoints carry, one layer."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": arch.hidden_act,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.vocab_size,
        "attention_bias": arch.attention_bias,
        "eagle_fc_bias": fc_bias,
        "eagle_input_norm": input_norm,
    }
    if arch.rope_scaling:
        cfg["rope_scaling"] = arch.rope_scaling
    return {**cfg, **extra}


def head_state_dict(head: EagleHead) -> dict[str, torch.Tensor]:
    """Our parameters under the published checkpoint names (fused projections split back)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("layer.self_attn.rope"):
            continue
        ours = name.replace("layer.", "layers.0.", 1)
        module, _, kind = ours.rpartition(".")
        fused = next((f for f in FUSED if module.endswith(f)), None)
        if fused is None:
            out[ours] = tensor.detach().contiguous()
            continue
        prefix = module.removesuffix(fused)
        for part, chunk in zip(FUSED[fused], tensor.split(_part_rows(head.arch, fused), dim=0), strict=True):
            out[f"{prefix}{part}.{kind}"] = chunk.detach().contiguous()
    return out


def _part_rows(arch: ArchConfig, fused: str) -> list[int]:
    if fused == "self_attn.qkv_proj":
        kv = arch.num_kv_heads * arch.head_dim
        return [arch.num_heads * arch.head_dim, kv, kv]
    return [arch.intermediate_size, arch.intermediate_size]


def save_eagle_head(
    path: Path, head: EagleHead, draft_ids: torch.Tensor | None, extra: dict[str, Any]
) -> None:
    """Write `head` in the published layout (model.safetensors) plus its draft vocabulary."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(head_state_dict(head), str(path / SAFETENSORS_FILE))
    vocab_file = path / DRAFT_VOCAB_FILE
    if draft_ids is not None:
        save_file({"token_ids": draft_ids.to(torch.int64).contiguous()}, str(vocab_file))
        extra = {**extra, "draft_vocab_size": len(draft_ids)}  # informative; the file is what counts
    elif vocab_file.exists():
        vocab_file.unlink()  # a stale map from an earlier run would silently relabel the rows
    cfg = hf_config(head.arch, head.fc.bias is not None, head.input_norm, extra)
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def is_eagle_checkpoint(path: Path) -> bool:
    return (path / CONFIG_FILE).exists() and any((path / f).exists() for f in (SAFETENSORS_FILE, TORCH_FILE))


def load_eagle_head(path: Path, target: ArchConfig) -> tuple[EagleHead, dict[str, Any], torch.Tensor | None]:
    """The head, its config and its draft vocabulary ([N] target ids, None = the full vocabulary).
    Every mismatch with the target is a one-line ProposerError."""
    if not is_eagle_checkpoint(path):
        raise ProposerError(
            f"{path} is not an EAGLE head checkpoint (needs {CONFIG_FILE} + {SAFETENSORS_FILE} or {TORCH_FILE})"
        )
    cfg = json.loads((path / CONFIG_FILE).read_text())
    state = _read_weights(path)
    if "d2t" in state or any(k.startswith("midlayer.") for k in state):
        raise ProposerError(
            f"{path} is an EAGLE-3 checkpoint; only EAGLE-1/2 heads (fc + layers.0) are supported"
        )
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[1] != 2 * fc.shape[0]:
        raise ProposerError(f"{path}: no fc.weight of shape [hidden, 2 x hidden]; not an EAGLE head")
    hidden = int(cfg.get("hidden_size", fc.shape[0]))
    if hidden != target.hidden_size or fc.shape[0] != target.hidden_size:
        raise ProposerError(
            f"EAGLE head is for hidden size {fc.shape[0]}, the target has {target.hidden_size}"
        )
    if int(cfg.get("vocab_size", target.vocab_size)) != target.vocab_size:
        raise ProposerError(
            f"EAGLE head is for a vocabulary of {cfg['vocab_size']} tokens, the target has {target.vocab_size}"
        )
    embed = state.get("embed_tokens.weight")
    if embed is not None and embed.shape[0] != target.vocab_size:
        raise ProposerError(
            f"EAGLE head's embeddings cover {embed.shape[0]} tokens, the target has {target.vocab_size}"
        )
    gate = state.get("layers.0.mlp.gate_proj.weight")
    arch = head_arch(target, int(gate.shape[0]) if gate is not None else None)
    head = EagleHead(
        arch,
        fc_bias="fc.bias" in state,
        input_norm="layers.0.input_layernorm.weight" in state,
    )
    ours = _to_ours(state, arch)
    try:
        missing, unexpected = head.load_state_dict(ours, strict=False)
    except RuntimeError as exc:  # a shape mismatch: torch's message spans lines, keep it to one
        detail = " ".join(str(exc).split())
        raise ProposerError(
            f"EAGLE checkpoint {path} does not fit the target's layer: {detail[:300]}"
        ) from exc
    missing = [m for m in missing if not m.startswith("layer.self_attn.rope")]
    if missing or unexpected:
        detail = f"missing {missing[:4]}" if missing else f"unexpected {unexpected[:4]}"
        raise ProposerError(f"EAGLE checkpoint {path} does not fit the target's layer: {detail}")
    return head, cfg, _load_draft_vocab(path / DRAFT_VOCAB_FILE, target.vocab_size)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / SAFETENSORS_FILE).exists():
        state = load_file(str(path / SAFETENSORS_FILE))
    else:
        try:
            state = torch.load(path / TORCH_FILE, map_location="cpu", weights_only=True)
        except Exception as exc:  # a pickle with code in it, or a damaged file
            raise ProposerError(
                f"cannot read {path / TORCH_FILE}: {' '.join(str(exc).split())[:200]}"
            ) from exc
    return {k.removeprefix("model."): v for k, v in state.items()}


def _to_ours(state: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Published names -> our parameter names, stacking the projections we fuse. A shape that does
    not fit is a ProposerError naming the tensor."""
    ours: dict[str, torch.Tensor] = {}
    used: set[str] = set(IGNORED)
    for fused, parts in FUSED.items():
        for kind in ("weight", "bias"):
            names = [f"layers.0.{p}.{kind}" for p in parts]
            present = [n in state for n in names]
            if not any(present):
                continue
            if not all(present):
                raise ProposerError(f"EAGLE checkpoint has only some of {', '.join(names)}")
            rows = _part_rows(arch, fused)
            for n, r in zip(names, rows, strict=True):
                if state[n].shape[0] != r:
                    raise ProposerError(
                        f"EAGLE checkpoint tensor {n} has {state[n].shape[0]} rows; the target's layer needs {r}"
                    )
            ours[f"layer.{fused}.{kind}"] = torch.cat([state[n] for n in names], dim=0)
            used.update(names)
    for name, tensor in state.items():
        if name in used:
            continue
        if name.startswith("layers.0."):
            ours["layer." + name.removeprefix("layers.0.")] = tensor
        elif name.startswith("fc."):
            ours[name] = tensor
        elif name.startswith("layers."):
            raise ProposerError(f"EAGLE checkpoint has more than one layer ({name}); only one is supported")
        else:
            ours[name] = tensor  # unexpected: reported by load_state_dict
    return ours
