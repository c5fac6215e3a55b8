"""The decoder contract: what the engine, the loader and the proposers need from a model family.

A family is one module under engine/models (llama.py, gemma.py) whose class subclasses
`CausalDecoder`, plus one line in registry.py. Everything outside engine/models talks to a model only
through this contract: a ragged forward over the paged KV cache, logits from hidden states, and KV
allocation. The loader (factory.py) builds the class on the meta device, materialises it, calls
`bind`, then fills the parameters from the checkpoint (weights.py, driven by the family's
`WeightLayout` in the registry).
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from ..attention import AttentionBackend, AttentionMetadata
    from ..decode_stack import DecodeStack
    from .arch import ArchConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k [slots, KVH, D], v [slots, KVH, D])


class CausalDecoder(nn.Module, ABC):
    """A decoder-only language model running over a flat ragged batch with a paged KV cache.

    An nn.Module (not a Protocol) so that callers keep `parameters()`, `named_modules()`, `eval()`;
    quantization replaces its nn.Linear layers in place, so a family keeps its projections as
    nn.Linear modules and computes logits through an nn.Linear named `lm_head`.
    """

    config: ArchConfig
    # Whether `forward` is exactly embed_tokens -> the `layers` (layers.DecoderLayer) -> the final
    # `norm`, with nothing else in between: the shape engine/decode_stack.py runs as one C call for
    # steps of decodes and windows. A family with steps of its own (Gemma's embedding scale) says no.
    plain_layer_stack: ClassVar[bool] = False
    # Set by the loader where every layer runs our C kernels (engine/decode_stack.py); a family with
    # `plain_layer_stack` hands it the step first, and runs its modules where it declines (None).
    decode_stack: DecodeStack | None = None

    @classmethod
    def config_fields(cls, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """ArchConfig fields this family reads its own way from config.json (defaults that differ from
        Llama's, legacy keys). The generic parser in arch.py covers everything else."""
        return {}

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64: the new tokens of every sequence, concatenated
        positions: torch.Tensor,  # [T] int64: each token's absolute position in its sequence
        kv_cache: KVCache,  # from allocate_kv_cache; the new tokens' K/V are written into it
        meta: AttentionMetadata,  # places every token in its sequence and its cache slots
        output_index: torch.Tensor | None = None,  # [N] flat rows wanted; None: all T rows
    ) -> torch.Tensor:  # [N, hidden] final-normed hidden states
        """Hidden states after the final norm: what `compute_logits` takes and what draft heads
        (Medusa, EAGLE) read. Row i depends only on its own sequence, never on the rest of the batch."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        """Next-token logits, in float32 whatever the model dtype (the sampler compares them exactly)."""

    @abstractmethod
    def bind(self, device: torch.device | str, attention_backend: AttentionBackend) -> None:
        """Called by the loader once the module's storage lives on `device` (after `to_empty`) and
        before the weights are copied in: rebuild non-persistent buffers (rope tables), re-tie shared
        weights (`to_empty` unties them) and install the attention backend chosen for the device."""

    def allocate_kv_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        """One zeroed (k, v) pair of [num_slots, KVH, D] per layer. A family whose layers differ (sliding
        window, other head counts) overrides this, and its KV byte cost with it."""
        shape = (num_slots, self.config.num_kv_heads, self.config.head_dim)
        return [
            (zeroed_kv_storage(shape, dtype, device), zeroed_kv_storage(shape, dtype, device))
            for _ in range(self.config.num_layers)
        ]


def zeroed_kv_storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed KV storage. On CPU it is backed by an anonymous mmap: the kernel supplies zero pages on
    first touch, so allocating a pool sized for the whole memory budget costs nothing up front and RSS
    grows only with the slots actually written (torch.zeros would memset, i.e. touch, every page:
    ~3 s and 6 GiB resident for SmolLM2's default pool before the first request). Zeros, not
    torch.empty: padded attention reads unwritten slots under a mask, and 0 x NaN garbage is NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))  # anonymous, private, zero-filled
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)  # keeps `buffer` alive
