"""The container's cgroup limits (fake v1 and v2 trees in temp dirs) and the KV pool sized under them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import make_llm

from specserve.engine import cgroup_limits
from specserve.engine.cgroup_limits import cgroup_cpu_quota, cgroup_memory_limit
from specserve.engine.memory import InsufficientMemoryError, device_memory

MiB, GiB = 1 << 20, 1 << 30
V1_UNLIMITED = "9223372036854771712"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def own(tmp_path: Path, text: str) -> Path:
    return write(tmp_path / "proc-self-cgroup", text)


@pytest.mark.parametrize("value,expected", [("max\n", None), (f"{8 * GiB}\n", 8 * GiB), ("junk", None)])
def test_v2_memory_max_in_a_cgroup_namespace(tmp_path, value, expected):
    root = tmp_path / "cgroup"
    write(root / "memory.max", value)
    limit = cgroup_memory_limit(root, own(tmp_path, "0::/\n"))
    assert (limit.bytes if limit else None) == expected
    if limit:
        assert limit.source == root / "memory.max"


def test_v2_smallest_limit_along_the_path_wins(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "kubepods" / "memory.max", "max\n")
    pod = write(root / "kubepods" / "pod1" / "memory.max", f"{6 * GiB}\n")
    write(root / "kubepods" / "pod1" / "ctr" / "memory.max", f"{10 * GiB}\n")
    write(root / "elsewhere" / "memory.max", f"{1 * GiB}\n")  # not on our path: ignored
    limit = cgroup_memory_limit(root, own(tmp_path, "0::/kubepods/pod1/ctr\n"))
    assert limit == cgroup_limits.MemoryLimit(6 * GiB, pod)


def test_v1_limit_and_unlimited(tmp_path):
    root = tmp_path / "cgroup"
    proc = own(tmp_path, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    write(root / "memory" / "memory.limit_in_bytes", V1_UNLIMITED + "\n")
    assert cgroup_memory_limit(root, proc) is None
    # A v1 container's mount is its own cgroup: /docker/abc does not exist under it, its root does.
    write(root / "memory" / "memory.limit_in_bytes", f"{2 * GiB}\n")
    assert cgroup_memory_limit(root, proc) == cgroup_limits.MemoryLimit(
        2 * GiB, root / "memory" / "memory.limit_in_bytes"
    )


def test_no_cgroup_at_all(tmp_path):
    assert cgroup_memory_limit(tmp_path / "none", tmp_path / "missing") is None
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "missing") is None


def test_cpu_quota_walks_the_path_too(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cpu.max", "max 100000\n")
    write(root / "kubepods" / "cpu.max", "300000 100000\n")
    write(root / "kubepods" / "ctr" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, own(tmp_path, "0::/kubepods/ctr\n")) == 3


def test_device_memory_is_the_smaller_of_ram_and_the_limit(tmp_path):
    root = tmp_path / "cgroup"
    proc = own(tmp_path, "0::/\n")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    write(root / "memory.max", f"{512 * MiB}\n")
    mem = device_memory(torch.device("cpu"), root, proc)
    assert mem.bytes == 512 * MiB and str(root / "memory.max") in mem.name
    write(root / "memory.max", f"{ram * 2}\n")  # a limit above the RAM changes nothing
    assert device_memory(torch.device("cpu"), root, proc).bytes == ram
    assert device_memory(torch.device("cpu"), root, proc).name == "system memory"


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    """Point the engine at a fake v2 tree; returns a setter for its memory.max. (max_batch_size 1024 in
    _pool keeps the full-batch cap on the pool out of the way.)"""
    root = tmp_path / "cgroup"
    monkeypatch.setattr(cgroup_limits, "CGROUP_ROOT", root)
    monkeypatch.setattr(cgroup_limits, "SELF_CGROUP", own(tmp_path, "0::/\n"))
    return lambda limit: write(root / "memory.max", f"{limit}\n")


def _pool(tiny_llama_dir, **kwargs):
    llm = make_llm(
        tiny_llama_dir, device_memory_utilization=0.5, max_length=256, max_batch_size=1024, **kwargs
    )
    core = llm.engine
    bytes_per_block = core.config.block_size * core.arch.kv_bytes_per_token(4)  # float32
    return core.num_blocks, bytes_per_block


def test_pool_is_sized_under_the_container_limit(tiny_llama_dir, fake_cgroup):
    fake_cgroup(256 * MiB)
    blocks, per_block = _pool(tiny_llama_dir, max_kv_cache_tokens=None)
    assert blocks >= 16 and blocks * per_block <= 128 * MiB  # half the limit holds weights, peaks and KV
    fake_cgroup(256 * MiB + 200 * per_block)  # 200 more blocks' worth of limit, half of it usable
    more, _ = _pool(tiny_llama_dir, max_kv_cache_tokens=None)
    assert more - blocks == 100


def test_kv_token_cap_still_has_to_fit_under_the_limit(tiny_llama_dir, fake_cgroup):
    fake_cgroup(256 * MiB)
    fits, _ = _pool(tiny_llama_dir, max_kv_cache_tokens=None)
    capped, _ = _pool(tiny_llama_dir, max_kv_cache_tokens=16 * (fits - 10))
    assert capped == fits - 10  # a cap below what fits is the pool
    clamped, _ = _pool(tiny_llama_dir, max_kv_cache_tokens=16 * (fits + 1000))
    assert clamped == fits  # a cap above it is cut to what the limit holds


def test_model_that_cannot_fit_refuses_to_start(tiny_llama_dir, fake_cgroup):
    fake_cgroup(64 * MiB)  # below the activation estimate's own slack
    with pytest.raises(InsufficientMemoryError, match="the model does not fit.*container memory limit"):
        _pool(tiny_llama_dir, max_kv_cache_tokens=4096)


def test_serve_refuses_with_one_line_under_a_small_limit(tiny_llama_dir, tmp_path):
    """The real CLI in a fresh process whose cgroup root is a fake tree with a 64 MiB memory.max."""
    root = tmp_path / "cgroup"
    write(root / "memory.max", f"{64 * MiB}\n")
    proc = own(tmp_path, "0::/\n")
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from specserve.engine import cgroup_limits
        cgroup_limits.CGROUP_ROOT, cgroup_limits.SELF_CGROUP = Path({str(root)!r}), Path({str(proc)!r})
        from specserve.api.cli import main
        main(["serve", "--model-path", {str(tiny_llama_dir)!r}, "--quantization-encoding", "float32",
              "--host", "127.0.0.1", "--port", "0", "--devices", "cpu"])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("specserve: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    assert "the model does not fit" in errors[0] and str(root / "memory.max") in errors[0]
