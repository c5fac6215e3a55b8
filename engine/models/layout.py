"""How a family's checkpoint tensor names map onto its decoder's parameters.

Checkpoints name parameters `model.layers.3.self_attn.q_proj.weight`; our decoders drop the `model.`
prefix and may stack several checkpoint projections into one fused nn.Linear (`qkv_proj`,
`gate_up_proj`) along the output dimension. A family states both in a `WeightLayout`; weights.py and
the GGUF loader follow it, so neither knows any family by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .arch import ArchConfig


@dataclass(frozen=True)
class FusedLinear:
    """One of our nn.Linear layers holding several checkpoint projections stacked along dim 0."""

    parts: tuple[str, ...]  # checkpoint module suffixes in stacking order, e.g. "self_attn.q_proj"
    rows: Callable[[ArchConfig], tuple[int, ...]]  # output rows of each part

    def offsets(self, cfg: ArchConfig) -> list[int]:  # [len(parts) + 1] row boundaries
        bounds = [0]
        for n in self.rows(cfg):
            bounds.append(bounds[-1] + n)
        return bounds


@dataclass(frozen=True)
class WeightLayout:
    # Our module suffix (e.g. "self_attn.qkv_proj") -> the checkpoint projections it stacks.
    fused: Mapping[str, FusedLinear] = field(default_factory=lambda: MappingProxyType({}))
    prefix: str = "model."  # stripped from checkpoint names (lm_head.* has none)

    def target(self, name: str) -> tuple[str | None, int | None]:
        """Checkpoint tensor name -> (our parameter name, shard index within a fused layer or None).
        (None, None) for what is not a parameter (e.g. rotary `inv_freq` buffers some files carry)."""
        if not name.endswith((".weight", ".bias")):
            return None, None
        ours = name.removeprefix(self.prefix)
        module, _, kind = ours.rpartition(".")
        for fused_name, fused in self.fused.items():
            for shard, part in enumerate(fused.parts):
                if module == part or module.endswith("." + part):
                    return f"{module.removesuffix(part)}{fused_name}.{kind}", shard
        return ours, None

    def fused_of(self, param_name: str) -> FusedLinear | None:
        """The fused layer a parameter of ours (`layers.0.self_attn.qkv_proj.weight`) belongs to."""
        module = param_name.rpartition(".")[0]
        for fused_name, fused in self.fused.items():
            if module == fused_name or module.endswith("." + fused_name):
                return fused
        return None


def _qkv_rows(cfg: ArchConfig) -> tuple[int, ...]:
    kv = cfg.num_kv_heads * cfg.head_dim
    return (cfg.num_heads * cfg.head_dim, kv, kv)


def _gate_up_rows(cfg: ArchConfig) -> tuple[int, ...]:
    return (cfg.intermediate_size, cfg.intermediate_size)


# Separate q/k/v and gate/up projections in the checkpoint, fused in the decoder (Llama, Qwen, Gemma).
STANDARD_LAYOUT = WeightLayout(
    fused=MappingProxyType(
        {
            "self_attn.qkv_proj": FusedLinear(
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), _qkv_rows
            ),
            "mlp.gate_up_proj": FusedLinear(("mlp.gate_proj", "mlp.up_proj"), _gate_up_rows),
        }
    )
)
