"""Size the KV block pool from device memory: F x total - weights - measured peak activations."""

from __future__ import annotations

import os
import resource

import torch


class InsufficientMemoryError(RuntimeError):
    pass


def total_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


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
