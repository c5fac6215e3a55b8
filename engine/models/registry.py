"""The architecture registry: HF `architectures` name -> the model family that implements it.

Adding a family is one module under engine/models (a `CausalDecoder` subclass) plus one line below.
Entries name their module and class instead of importing them, as vLLM's registry does: the family
modules import arch.py, which looks up this table, so a direct import would be circular; it also
means a family's code is imported only when a checkpoint of that family is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .layout import STANDARD_LAYOUT, WeightLayout

if TYPE_CHECKING:
    from .arch import ArchConfig
    from .decoder import CausalDecoder


@dataclass(frozen=True)
class ModelFamily:
    module: str  # module under engine/models holding the decoder class, e.g. "llama"
    class_name: str  # a CausalDecoder subclass in that module
    # ArchConfig fields this architecture implies whatever config.json says (e.g. Qwen2's q/k/v bias).
    fixed: Mapping[str, Any] = field(default_factory=dict)
    weight_layout: WeightLayout = STANDARD_LAYOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", MappingProxyType(dict(self.fixed)))  # read-only

    def decoder_class(self) -> type[CausalDecoder]:
        module = importlib.import_module(f"{__package__}.{self.module}")
        return getattr(module, self.class_name)


# SmolLM and TinyLlama ship as LlamaForCausalLM.
ARCHITECTURES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        "GemmaForCausalLM": ModelFamily("gemma", "GemmaForCausalLM"),
        "LlamaForCausalLM": ModelFamily("llama", "LlamaForCausalLM"),
        "MistralForCausalLM": ModelFamily("llama", "LlamaForCausalLM"),
        "Qwen2ForCausalLM": ModelFamily("llama", "LlamaForCausalLM", fixed={"attention_bias": True}),
        "Qwen3ForCausalLM": ModelFamily("llama", "LlamaForCausalLM", fixed={"qk_norm": True}),
    }
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))


def find_architecture(architectures: list[str]) -> str | None:
    """The first of a config's `architectures` entries that a registered family implements."""
    return next((a for a in architectures if a in ARCHITECTURES), None)


def family_of(cfg: ArchConfig) -> ModelFamily:
    return ARCHITECTURES[cfg.architecture]


def build_decoder(cfg: ArchConfig) -> CausalDecoder:
    """The family's decoder for `cfg`, on the current default device (the loader uses meta)."""
    return family_of(cfg).decoder_class()(cfg)
