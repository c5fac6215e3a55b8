"""How many CPU threads torch should use when --num-threads is not given.

torch sizes its thread pool from the machine's cores. In a container with a CPU quota (Kubernetes
`limits.cpu`, `docker --cpus`) or a narrowed affinity mask that oversubscribes the quota: the kernel
throttles the extra threads and a decode step waits on the slowest of them, many times slower than
with the right count. So the default is the smallest of torch's count, the affinity mask and the quota.
"""

from __future__ import annotations

import os
from pathlib import Path

# The cgroup reading lives in the engine, which also sizes the KV cache under the memory limit.
from specserve.engine.cgroup_limits import cgroup_cpu_quota

__all__ = ["cgroup_cpu_quota", "default_num_threads"]


def default_num_threads(torch_threads: int, root: Path | None = None) -> int:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        affinity = torch_threads
    limits = [torch_threads, affinity]
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        limits.append(quota)
    return max(1, min(limits))
