"""Size the KV block pool from device memory: F x total - weights - peak activations.

Peak activations are measured on CUDA (one forward at the full token budget, allocator peak) and
bounded from the shapes on CPU (`estimate_activation_bytes`). On CPU "device memory" is the smaller of
the machine's RAM and the container's cgroup memory limit: sizing from the node's RAM under a Kubernetes
`limits.memory` lets the pool grow (it is committed lazily, as slots are written) until the pod is
OOMKilled under load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import INVARIANT_QUERY_TILE, SCORE_TILE_ELEMENTS, SMALL_QUERY_ROWS
from .cgroup_limits import cgroup_memory_limit
from .models.arch import ArchConfig


class InsufficientMemoryError(RuntimeError):
    pass


@dataclass(frozen=True)
class DeviceMemory:
    bytes: int
    name: str  # what the bytes are, for messages: "system memory", "container memory limit (<file>)"


def device_memory(
    device: torch.device, cgroup_root: Path | None = None, self_cgroup: Path | None = None
) -> DeviceMemory:
    if device.type == "cuda":
        return DeviceMemory(torch.cuda.mem_get_info(device)[1], f"{device} memory")
    system = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit(cgroup_root, self_cgroup)
    if limit is not None and limit.bytes < system:
        return DeviceMemory(limit.bytes, f"container memory limit ({limit.source})")
    return DeviceMemory(system, "system memory")


def total_device_memory(device: torch.device) -> int:
    return device_memory(device).bytes


def module_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue  # tied weights count once
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def plan_num_blocks(
    total_bytes: int,
    utilization: float,
    weight_bytes: int,
    activation_bytes: int,
    bytes_per_block: int,
    min_blocks: int,
    memory_name: str = "device memory",
) -> int:
    """Blocks that fit in `utilization` x `total_bytes` after weights and activations; a one-line
    InsufficientMemoryError when not even one sequence of the max length (`min_blocks`) fits."""
    budget = int(total_bytes * utilization)
    available = budget - weight_bytes - activation_bytes
    num_blocks = available // bytes_per_block if available > 0 else 0
    if num_blocks < min_blocks:
        gib = 1 << 30
        sizes = (
            f"{utilization:.2f} x {total_bytes / gib:.2f} GiB {memory_name}"
            f" - {weight_bytes / gib:.2f} GiB weights - {activation_bytes / gib:.2f} GiB peak activations"
        )
        if weight_bytes + activation_bytes >= budget:
            raise InsufficientMemoryError(
                f"the model does not fit: {sizes} leaves nothing for the KV cache; raise the memory"
                " (limit) or --device-memory-utilization, quantize (--quantization-encoding int4), or"
                " lower --max-num-batched-tokens"
            )
        raise InsufficientMemoryError(
            f"KV cache too small: {sizes} leaves room for {num_blocks} blocks of {bytes_per_block} bytes,"
            f" but one sequence of the max length needs {min_blocks}; raise --device-memory-utilization"
            " or the memory (limit), or lower --max-length"
        )
    return num_blocks


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):.1f} MiB"


def check_weights_fit(
    weight_bytes: int,
    utilization: float,
    memory: DeviceMemory,
    resident_bytes: int = 0,
    what: str = "its weights",
) -> None:
    """Before loading: a one-line InsufficientMemoryError when the weights (estimated from the config,
    engine/weight_size.py) plus what is already resident exceed `utilization` x the memory, the same
    budget the KV cache is later planned in (which then also takes out activations and the KV cache)."""
    budget = int(memory.bytes * utilization)
    if resident_bytes + weight_bytes <= budget:
        return
    need = f"{what} need {_size(weight_bytes)}"
    if resident_bytes:
        need += f" on top of {_size(resident_bytes)} already loaded"
    raise InsufficientMemoryError(
        f"the model does not fit: {need}, over {utilization:.2f} x {_size(memory.bytes)} {memory.name};"
        " refusing before loading them; raise the memory (limit) or --device-memory-utilization, or"
        " quantize (--quantization-encoding int4)"
    )


def estimate_activation_bytes(
    cfg: ArchConfig, num_tokens: int, max_length: int, sample_rows: int, dtype_bytes: int
) -> int:
    """Upper bound on one forward's transient memory at the full token budget, from shapes alone.

    Used on CPU, where measuring means running that forward (30-60 s for a 1.5B model before the
    first request) and the process's peak RSS is a lifetime high that loading may already have set.
    Layers run one after another, so one decoder layer's intermediates are the peak; they are summed
    as if none were freed early. The worst attention case is a prefill chunk of `per_seq` queries at
    the end of a `max_length` context. CPU SDPA with a boolean mask takes its blocked (flash) path, so
    the [Q, C] scores never exist whole (measured: +47 MiB peak for Q=2048, C=8192, 9 heads, where
    float32 scores would take 576 MiB); the mask does, as bool and as the additive float it becomes.
    """
    per_seq = min(num_tokens, max_length)  # [Q] queries per sequence
    num_seqs = -(-num_tokens // per_seq)  # [S]
    tokens = num_seqs * per_seq  # [T] padded
    h, inter, b = cfg.hidden_size, cfg.intermediate_size, dtype_bytes
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    residual = tokens * h * (4 * b + 2 * 4)  # x, normed, attention and MLP outputs; float32 norm temps
    qkv = tokens * ((q_size + 2 * kv_size) + (q_size + kv_size)) * b  # projection + rotated q, k
    gathered = 2 * num_seqs * max_length * kv_size * b  # the context's K and V, [S, C, KVH, D]
    attn_out = 3 * tokens * q_size * b  # padded queries, SDPA output, flattened copy
    mask = num_seqs * per_seq * max_length * (1 + 4)  # [S, 1, Q, C] bool, and as float32
    # Batch-invariant attention materialises one tile of query rows: bf16 scores, their float32 copy
    # (exp in place), its cumsum and the bf16 weights, [S, H, tile, C] each.
    tile = min(per_seq, INVARIANT_QUERY_TILE)
    scores = num_seqs * cfg.num_heads * tile * max_length * (2 + 4 + 4 + 2)
    # The CPU backend's matmul path for decodes and windows: `num_tokens` query rows at most, scored a
    # tile at a time (one sequence's rows where those alone exceed the tile), as many bytes each.
    small_tile = max(SCORE_TILE_ELEMENTS, cfg.num_heads * SMALL_QUERY_ROWS * max_length)
    scores = max(scores, min(num_tokens * cfg.num_heads * max_length, small_tile) * (2 + 4 + 4 + 2))
    mlp = tokens * 4 * inter * b  # gate_up [T, 2I], silu(gate) and the product [T, I] each
    logits = sample_rows * cfg.vocab_size * 4 * 3  # float32 logits, processed copy, probabilities
    total = residual + qkv + gathered + attn_out + mask + scores + mlp + logits
    return int(total * 1.25) + (64 << 20)  # allocator slack and fragmentation
