"""Architecture description: the few numbers the decoder needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, find_architecture

__all__ = ["SUPPORTED_ARCHITECTURES", "ArchConfig", "UnsupportedArchitectureError"]


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    hidden_act: str = "silu"  # the gated MLP's activation (layers.ACTIVATIONS)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        """Parse config.json for the registered family named in its `architectures`: the fields every
        family shares here, then the family's own reading (`CausalDecoder.config_fields`), then what the
        architecture fixes (`ModelFamily.fixed`)."""
        archs = cfg.get("architectures") or []
        arch = find_architecture(archs)
        if arch is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = ARCHITECTURES[arch]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        # transformers 5 folds rope_theta into `rope_parameters`.
        rope_params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=False,
            rope_scaling=rope_scaling
            if rope_scaling and rope_scaling.get("rope_type") != "default"
            else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            hidden_act=str(cfg.get("hidden_act") or "silu"),
        )
        fields.update(family.decoder_class().config_fields(cfg))
        fields.update(family.fixed)
        return cls(**fields)

    @classmethod
    def from_directory(cls, directory: Path) -> ArchConfig:
        return cls.from_hf_dict(json.loads((Path(directory) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
