"""Building blocks the decoder families share: RMSNorm, paged attention with rope, gated MLP, and the
pre-norm decoder layer.

q/k/v and gate/up projections are fused (one nn.Linear each); the loader stacks the checkpoint's
separate projections into them (see layout.py): on CPU one larger matmul is cheaper than three
small ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata, paged_attention
from ..row_ops_kernel import RowOpsKernel, takes
from .arch import ArchConfig
from .rope import RotaryEmbedding

# HF `hidden_act` -> the function. "gelu_pytorch_tanh" is transformers' name for tanh-approximated GELU.
ACTIVATIONS: MappingProxyType[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType(
    {
        "silu": F.silu,
        "swish": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    }
)

NormFactory = Callable[[int, float], nn.Module]  # (dim, eps) -> a norm module


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, cast back, then scale by the weight in the model dtype."""

    row_ops: RowOpsKernel | None = None  # bf16 CPU rows on our kernel (`use_row_ops`)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_ops is not None and takes(x, self.weight):
            return self.row_ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 like transformers does, then cast back before the weight.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of that): the residual add and the next sublayer's norm in one pass."""
        if self.row_ops is not None and takes(x, delta, self.weight):
            return self.row_ops.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


def add_and_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)), in one pass where `norm` can (RMSNorm)."""
    if isinstance(norm, RMSNorm):
        return norm.add_and_norm(x, delta)
    x = x + delta
    return x, norm(x)


def make_embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """nn.Embedding; built on the meta device (shapes only, the loader fills it) it skips the random
    init: normal_ has no C++ meta kernel, and its Python fallback imports torch._dynamo (~2 s per
    process). Elsewhere (a model built in memory) it is initialised as usual."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))
    return nn.Embedding(num_embeddings, dim)


def make_rope(cfg: ArchConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, rope: RotaryEmbedding, norm: NormFactory = RMSNorm):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.scale = cfg.head_dim**-0.5
        self.attention_backend: AttentionBackend = paged_attention  # set per device by `bind`

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = self.attention_backend(q, k, v, cache[0], cache[1], meta, self.scale)  # [T, H * D]
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu (Llama), GeGLU with tanh-GELU (Gemma)."""

    row_ops: RowOpsKernel | None = None  # bf16 CPU rows on our kernel (`use_row_ops`)

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {cfg.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})"
            )
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fused_silu = self.act is F.silu  # silu(gate) * up is one of our row ops
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if self.row_ops is not None and self.fused_silu and takes(gate_up):
            return self.down_proj(self.row_ops.silu_mul(gate_up, self.intermediate_size))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). HF parameter names are kept
    (`input_layernorm`, `post_attention_layernorm`) so checkpoint names map one to one."""

    def __init__(self, cfg: ArchConfig, rope: RotaryEmbedding, norm: NormFactory = RMSNorm):
        super().__init__()
        self.self_attn = Attention(cfg, rope, norm)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        attended = self.self_attn(self.input_layernorm(x), positions, cache, meta)
        x, normed = add_and_norm(self.post_attention_layernorm, x, attended)
        return x + self.mlp(normed)


def use_row_ops(model: nn.Module, kernel: RowOpsKernel | None) -> int:
    """Let `model`'s RMSNorms, rotary embeddings and gated MLPs compute bf16 CPU rows on `kernel`
    (other dtypes and devices keep torch's ops; None: torch's ops for every row again, for A/B runs);
    returns how many modules it set. Call it after `bind`, which builds the rotary embedding afresh."""
    modules = [m for m in model.modules() if isinstance(m, RMSNorm | RotaryEmbedding | GatedMLP)]
    for module in modules:
        module.row_ops = kernel
    return len(modules)


def bind_attention(
    layers: Iterable[nn.Module], cfg: ArchConfig, device: torch.device | str, backend: AttentionBackend
) -> None:
    """Give every layer (a `DecoderLayer`) one rope table built on `device` (the meta-device copy has
    no values: its buffers are non-persistent, so no checkpoint fills them) and the device's
    attention backend."""
    rope = make_rope(cfg).to(device)
    for layer in layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.rope = rope
        layer.self_attn.attention_backend = backend
