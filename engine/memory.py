"""Size the KV block pool from device memory: F x total - weights - peak activations.

Peak activations are measured on CUDA (one forward at the full token budget, allocator peak) and
bounded from the shapes on CPU (`estimate_activation_bytes`).
"""

from __future__ import annotations

import os

import torch

from .attention import INVARIANT_QUERY_TILE
from .models.arch import ArchConfig


class InsufficientMemoryError(RuntimeError):
    pass


def total_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
) -> int:
    available = int(total_bytes * utilization) - weight_bytes - activation_bytes
    num_blocks = available // bytes_per_block if available > 0 else 0
    if num_blocks < min_blocks:
        gib = 1 << 30
        raise InsufficientMemoryError(
            f"KV cache too small: {utilization:.2f} x {total_bytes / gib:.1f} GiB device memory"
            f" - {weight_bytes / gib:.2f} GiB weights - {activation_bytes / gib:.2f} GiB peak activations"
            f" leaves room for {max(num_blocks, 0)} blocks of {bytes_per_block} bytes, but one sequence of"
            f" the max length needs {min_blocks}; raise --device-memory-utilization or lower --max-length"
        )
    return num_blocks


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
    mlp = tokens * 4 * inter * b  # gate_up [T, 2I], silu(gate) and the product [T, I] each
    logits = sample_rows * cfg.vocab_size * 4 * 3  # float32 logits, processed copy, probabilities
    total = residual + qkv + gathered + attn_out + mask + scores + mlp + logits
    return int(total * 1.25) + (64 << 20)  # allocator slack and fragmentation
