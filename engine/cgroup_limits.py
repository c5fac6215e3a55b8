"""The container's resource limits, read from its cgroup (v2 unified hierarchy or v1 controllers).

A process in a container sees the node's RAM and cores, but the kernel holds it to its cgroup's limits:
memory (v2 `memory.max`, v1 `memory.limit_in_bytes`; past it the OOM killer ends the pod) and a CPU quota
(v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; past it threads are throttled). The limit
in force is the smallest along the path from the process's own cgroup (`/proc/self/cgroup`) up to the
mount's root, so every level of that path that exists under the mount is read. Inside a cgroup
namespace (the usual container) the path is "/" and only the mount's root is read; where the path does
not exist under the mount (a v1 container whose mount is its own cgroup), the root still is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: Path  # the file the smallest limit came from


def own_cgroup_paths(self_cgroup: Path | None = None) -> dict[str, str]:
    """Controller -> this process's cgroup path; the key "" is the v2 unified hierarchy."""
    try:
        text = (self_cgroup or SELF_CGROUP).read_text()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)  # "hierarchy-id:controller,list:/path"
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def levels(mount: Path, path: str) -> list[Path]:
    """mount/path and each of its ancestors up to the mount, the ones that exist (deepest first)."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    dirs = [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _read_words(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except OSError:
        return None


def cgroup_memory_limit(root: Path | None = None, self_cgroup: Path | None = None) -> MemoryLimit | None:
    """The smallest memory limit over this process's cgroup and its ancestors; None when unlimited.
    (Defaults are read at call time, so a test can point CGROUP_ROOT at a fake tree.)"""
    root = root or CGROUP_ROOT
    own = own_cgroup_paths(self_cgroup)
    found: list[MemoryLimit] = []
    candidates = [d / "memory.max" for d in levels(root, own.get("", "/"))]  # v2: "max" or bytes
    candidates += [d / "memory.limit_in_bytes" for d in levels(root / "memory", own.get("memory", "/"))]
    for file in candidates:
        words = _read_words(file)
        if not words or not words[0].isdigit():
            continue  # absent, "max" (v2 unlimited) or unreadable
        value = int(words[0])
        if 0 < value < _V1_UNLIMITED:
            found.append(MemoryLimit(value, file))
    return min(found, key=lambda limit: limit.bytes) if found else None


def _v2_cpus(words: list[str]) -> int | None:
    quota, period = words[:2]  # "<quota> <period>" or "max <period>"
    return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))


def cgroup_cpu_quota(root: Path | None = None, self_cgroup: Path | None = None) -> int | None:
    """CPUs granted by the smallest CPU quota on this process's cgroup path, rounded up; None when
    unlimited or not readable."""
    root = root or CGROUP_ROOT
    own = own_cgroup_paths(self_cgroup)
    found: list[int] = []
    for d in levels(root, own.get("", "/")):
        words = _read_words(d / "cpu.max")
        try:
            cpus = _v2_cpus(words) if words else None
        except (ValueError, ZeroDivisionError):
            cpus = None
        if cpus is not None:
            found.append(cpus)
    for d in levels(root / "cpu", own.get("cpu", "/")):
        quota, period = _read_words(d / "cpu.cfs_quota_us"), _read_words(d / "cpu.cfs_period_us")
        try:  # a quota of -1 means unlimited
            quota_us, period_us = int(quota[0]), int(period[0])  # type: ignore[index]
        except (TypeError, IndexError, ValueError):
            continue
        if quota_us > 0 and period_us > 0:
            found.append(max(1, math.ceil(quota_us / period_us)))
    return min(found) if found else None
