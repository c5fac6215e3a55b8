"""Start-up: resolve and load the target, build the proposer, size and allocate the KV cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import QUANTIZED_ENCODINGS, EngineConfig, ModelSpec
from .decode_stack import default_decode_stack_kernel, use_decode_stack
from .hybrid_proposer import HybridProposer
from .memory import (
    check_weights_fit,
    device_memory,
    estimate_activation_bytes,
    module_bytes,
    plan_num_blocks,
)
from .models import ArchConfig, CausalDecoder, KVCache
from .models.factory import load_decoder
from .models.loader import resolve_cache_dir, resolve_model
from .proposer import Proposer, ProposerContext
from .proposer_registry import load_proposer
from .quantization import round_draft_activations
from .quantized_loading import plan_quantized_load, quantize_loaded_model
from .row_routed_linear import route_rows
from .runner import SequenceInput, forward_sequences, padded_num_slots
from .tokenizer import Tokenizer
from .weight_size import estimate_weight_bytes

logger = logging.getLogger("specserve.engine")


@dataclass
class LoadedModel:
    model: CausalDecoder
    arch: ArchConfig
    directory: Path
    notice: str | None


def load_model(
    spec: ModelSpec,
    cache_dir: str | None,
    batch_invariant: bool = False,
    *,
    memory_utilization: float | None = None,
    resident_bytes: int = 0,
    what: str = "its weights",
    draft: bool = False,
) -> LoadedModel:
    """Resolve and load one model. With `memory_utilization`, first refuse (InsufficientMemoryError,
    one line) a model whose weights, on top of `resident_bytes` already on its device, cannot fit in
    that share of the device memory: sized from the config before any weight is read, so a model too
    large for the container's limit is refused rather than OOM-killed while loading. (A GGUF source
    is converted first; the conversion streams one tensor chunk at a time.)

    `draft` (a quantized draft: its numbers decide only what it proposes, never the output): its
    tiled int4 layers round their inputs to int8 (`round_draft_activations`), and it keeps the float
    linear weights for forwards of many rows where those are faster (engine/row_routed_linear.py)."""
    cache_root = resolve_cache_dir(cache_dir or None)
    resolved = resolve_model(spec.model_path, spec.weight_path, dtype=spec.dtype, cache_dir=cache_root)
    quantized = spec.quantization_encoding in QUANTIZED_ENCODINGS
    plan = None
    if quantized:
        plan = plan_quantized_load(
            resolved.directory,
            resolved.gguf_path,
            spec.quantization_encoding,
            spec.int4_group_size,
            cache_root,
        )
    if memory_utilization is not None:
        weights = estimate_weight_bytes(
            ArchConfig.from_directory(resolved.directory),
            spec.dtype,
            plan.encoding if plan else None,
            spec.int4_group_size,
            float_linears=plan is None or plan.needs_float_linears,
            from_gguf=plan is not None and plan.gguf_path is not None,
            keep_float_linears=plan is not None and draft,
        )
        memory = device_memory(spec.device)
        check_weights_fit(weights, memory_utilization, memory, resident_bytes, what)
    if resolved.notice:
        # The float copy still serves embeddings and norms; say where the linear layers come from.
        suffix = (
            f"; {spec.quantization_encoding} linear layers built from the GGUF itself"
            if quantized and resolved.gguf_path is not None
            else ""
        )
        logger.warning(resolved.notice + suffix)
    if plan is None:
        model = load_decoder(resolved.directory, spec.dtype, spec.device, batch_invariant=batch_invariant)
        _stack_layers(model, spec)
        return LoadedModel(model, model.config, resolved.directory, resolved.notice)
    model = load_decoder(
        resolved.directory,
        spec.dtype,
        spec.device,
        load_linear_weights=plan.needs_float_linears or draft,
        batch_invariant=batch_invariant,
    )
    float_weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    if draft:
        float_weights = {
            name: (m.weight.detach(), None if m.bias is None else m.bias.detach())
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear)
        }
    quantize_loaded_model(model, plan)
    if draft:
        round_draft_activations(model)
    if float_weights:
        route_rows(model, float_weights)
    _stack_layers(model, spec)
    return LoadedModel(model, model.config, resolved.directory, resolved.notice)


def _stack_layers(model: CausalDecoder, spec: ModelSpec) -> None:
    """A bf16 CPU model's layers as one C call for steps of decodes and windows, where every layer runs
    our kernels (engine/decode_stack.py); last, once its linear layers are final."""
    if spec.dtype == torch.bfloat16 and torch.device(spec.device).type == "cpu":
        kernel = default_decode_stack_kernel()
        if kernel is not None:
            use_decode_stack(model, kernel)


@dataclass
class KVPlan:
    num_blocks: int
    bytes_per_block: int
    activation_bytes: int


def plan_kv_cache(
    config: EngineConfig,
    target: CausalDecoder,
    proposer: Proposer | None,
    max_length: int,
    max_num_batched_tokens: int,
) -> KVPlan:
    spec = config.model
    dtype_bytes = torch.finfo(spec.dtype).bits // 8
    proposer_bytes = proposer.kv_bytes_per_token() if proposer else 0
    bytes_per_block = config.block_size * (target.config.kv_bytes_per_token(dtype_bytes) + proposer_bytes)
    # Lookahead never passes max_length (k is capped by the tokens left), so this is a full sequence.
    blocks_per_seq = -(-max_length // config.block_size)
    # More blocks than every slot of a full batch can use only serve the prefix cache.
    useful_blocks = config.max_batch_size * blocks_per_seq * (2 if config.enable_prefix_caching else 1)
    cap_blocks = None
    if config.max_kv_cache_tokens is not None:  # a cap on the pool; memory still has to hold it
        cap_blocks = -(-config.max_kv_cache_tokens // config.block_size)
        if cap_blocks < blocks_per_seq:
            raise ValueError(
                f"--max-kv-cache-tokens {config.max_kv_cache_tokens} cannot hold one sequence of"
                f" --max-length {max_length} (needs {blocks_per_seq * config.block_size} tokens)"
            )
    if spec.device.type == "cuda":
        activation = _profile_activation_bytes(
            target, max_num_batched_tokens, max_length, config.block_size, spec.device
        )
    else:
        # Verification windows: every running request samples k + 1 rows in one step.
        k = config.num_speculative_tokens
        assert k is not None  # resolved in EngineConfig.__post_init__
        sample_rows = min(max_num_batched_tokens, config.max_batch_size * (k + 1))
        activation = estimate_activation_bytes(
            target.config, max_num_batched_tokens, max_length, sample_rows, dtype_bytes
        )
    weights = module_bytes(target) + (proposer.weight_bytes() if proposer else 0)
    memory = device_memory(spec.device)
    num_blocks = plan_num_blocks(
        memory.bytes,
        config.device_memory_utilization,
        weights,
        activation,
        bytes_per_block,
        blocks_per_seq,
        memory.name,
    )
    if cap_blocks is None:
        num_blocks = min(num_blocks, useful_blocks)
    elif cap_blocks > num_blocks:
        logger.warning(
            "--max-kv-cache-tokens %d does not fit under %.2f x %.2f GiB %s; the KV cache holds %d tokens",
            config.max_kv_cache_tokens,
            config.device_memory_utilization,
            memory.bytes / (1 << 30),
            memory.name,
            num_blocks * config.block_size,
        )
    else:
        num_blocks = cap_blocks
    logger.info(
        "KV cache: %d blocks (%d tokens, %.2f GiB) sized under %.2f GiB %s",
        num_blocks,
        num_blocks * config.block_size,
        num_blocks * bytes_per_block / (1 << 30),
        memory.bytes / (1 << 30),
        memory.name,
    )
    return KVPlan(num_blocks, bytes_per_block, activation)


def _profile_activation_bytes(
    model: CausalDecoder, num_tokens: int, max_length: int, block_size: int, device: torch.device
) -> int:
    """Run one forward at the full token budget on CUDA and measure the allocator's peak.

    The budget is split into sequences no longer than max_length (positions must stay in range).
    """
    per_seq = min(num_tokens, max_length)
    blocks_per_seq = -(-per_seq // block_size)
    num_seqs = -(-num_tokens // per_seq)
    cache: KVCache = model.allocate_kv_cache(
        padded_num_slots(num_seqs * blocks_per_seq * block_size), next(model.parameters()).dtype, device
    )
    seqs = [
        SequenceInput(
            [0] * min(per_seq, num_tokens - i * per_seq),
            0,
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            1,
        )
        for i in range(num_seqs)
    ]
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward_sequences(model, cache, seqs, block_size, device)
    return torch.cuda.max_memory_allocated(device) - before


def build_proposer(config: EngineConfig, target: CausalDecoder, tokenizer: Tokenizer) -> Proposer | None:
    methods = config.resolved_methods()
    if methods == ["none"] or config.num_speculative_tokens == 0:
        return None
    ctx = ProposerContext(
        config=config,
        target=target,
        vocab_size=target.config.vocab_size,
        device=config.model.device,
        dtype=config.model.dtype,
        block_size=config.block_size,
        cache_dir=Path(config.cache_dir) if config.cache_dir else None,
        extra={"tokenizer": tokenizer},
    )
    proposers = [load_proposer(m, ctx) for m in methods]
    return proposers[0] if len(proposers) == 1 else HybridProposer(ctx, proposers)
