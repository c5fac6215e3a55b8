"""How many CPU threads torch should use when --num-threads is not given.

torch sizes its thread pool from the machine's cores. In a container with a CPU quota (Kubernetes
`limits.cpu`, `docker --cpus`) or a narrowed affinity mask that oversubscribes the quota: the kernel
throttles the extra threads and a decode step waits on the slowest of them, many times slower than
with the right count. So the default is the smallest of torch's count, the affinity mask and the quota.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """CPUs granted by the cgroup quota, rounded up; None when unlimited or not readable."""
    try:  # cgroup v2: "<quota> <period>" or "max <period>"
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:  # cgroup v1: quota -1 means unlimited
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else max(1, math.ceil(quota_us / period_us))
    except (OSError, ValueError):
        return None


def default_num_threads(torch_threads: int, root: Path = Path("/sys/fs/cgroup")) -> int:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        affinity = torch_threads
    limits = [torch_threads, affinity]
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        limits.append(quota)
    return max(1, min(limits))
