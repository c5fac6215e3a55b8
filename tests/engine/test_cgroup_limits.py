"""The container's cgroup limits (fake v1 and v2 trees in temp dirs) and the KV pool sized under them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model, make_llm

from specserve.engine import cgroup_limits
from specserve.engine.cgroup_limits import cgroup_cpu_quota, cgroup_memory_limit
from specserve.engine.memory import InsufficientMemoryError, device_memory, module_bytes
from specserve.engine.models import factory
from specserve.engine.models.arch import ArchConfig
from specserve.engine.quantization import quantize_model
from specserve.engine.weight_size import estimate_weight_bytes

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


# --- weights alone over the limit: refused before loading -----------------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("gemma", True)])
def test_weight_estimate_is_what_loading_allocates(tmp_path, arch, tied):
    """From config.json alone, the bytes module_bytes() counts once the model is loaded, for every dtype
    and encoding (tied weights once, biases, the shared rope table, packed int8/int4 layers)."""
    build_tiny_model(tmp_path, arch, with_tokenizer=False, tie_word_embeddings=tied)
    cfg = ArchConfig.from_directory(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = factory.load_decoder(tmp_path, dtype)
        assert estimate_weight_bytes(cfg, dtype) == module_bytes(loaded), dtype
    for encoding, group in (("int8", 64), ("int4", 64), ("int4", 32)):
        model = quantize_model(factory.load_decoder(tmp_path, torch.bfloat16), encoding, group)
        packed = estimate_weight_bytes(cfg, torch.bfloat16, encoding, group, float_linears=False)
        assert packed == module_bytes(model), (encoding, group)
        # The first load of a checkpoint without a GGUF or packed cache reads the float linears first.
        assert estimate_weight_bytes(cfg, torch.bfloat16, encoding, group) == estimate_weight_bytes(
            cfg, torch.bfloat16
        )


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if the loader reads a weight."""

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the memory check")

    monkeypatch.setattr(factory, "load_safetensors_weights", refuse)


def test_weights_over_the_limit_refuse_before_loading(tiny_llama_dir, fake_cgroup, no_weight_reads):
    weights = estimate_weight_bytes(ArchConfig.from_directory(tiny_llama_dir), torch.float32)
    fake_cgroup(2 * weights - 4096)  # utilization 0.5 (in _pool): the budget is 2 KiB short
    with pytest.raises(InsufficientMemoryError) as info:
        _pool(tiny_llama_dir, max_kv_cache_tokens=4096)
    message = str(info.value)
    assert message.startswith("the model does not fit: its weights need 0.6 MiB, over 0.50 x")
    assert "container memory limit" in message and "refusing before loading them" in message
    assert "\n" not in message


def test_weights_that_fit_pass_the_check_exactly(tiny_llama_dir, fake_cgroup):
    """At the budget the pre-load check passes (it is exact, not a margin); the KV planner, which also
    counts activations, is what refuses such a limit."""
    weights = estimate_weight_bytes(ArchConfig.from_directory(tiny_llama_dir), torch.float32)
    fake_cgroup(2 * weights)
    with pytest.raises(InsufficientMemoryError, match="peak activations leaves nothing for the KV cache"):
        _pool(tiny_llama_dir, max_kv_cache_tokens=4096)


def test_draft_weights_count_on_top_of_the_loaded_target(tiny_llama_dir, tiny_draft_dir, fake_cgroup):
    cfg = ArchConfig.from_directory(tiny_llama_dir)
    target = estimate_weight_bytes(cfg, torch.float32)
    draft = estimate_weight_bytes(ArchConfig.from_directory(tiny_draft_dir), torch.float32)
    fake_cgroup(2 * target + draft)  # the target fits (budget = target + draft / 2), both do not
    with pytest.raises(InsufficientMemoryError) as info:
        _pool(
            tiny_llama_dir,
            max_kv_cache_tokens=4096,
            speculative_method="draft_model",
            draft_model_path=str(tiny_draft_dir),
            num_speculative_tokens=2,
        )
    assert "the draft model's weights need 0.6 MiB on top of 0.6 MiB already loaded" in str(info.value)


def test_model_that_cannot_fit_refuses_to_start(tiny_llama_dir, fake_cgroup):
    fake_cgroup(64 * MiB)  # below the activation estimate's own slack
    with pytest.raises(InsufficientMemoryError, match="the model does not fit.*container memory limit"):
        _pool(tiny_llama_dir, max_kv_cache_tokens=4096)


@pytest.mark.parametrize(
    "limit,says",
    [
        (64 * MiB, "leaves nothing for the KV cache"),  # weights fit, activations do not: the KV planner
        (256 << 10, "refusing before loading them"),  # the weights alone (0.6 MiB) do not: before loading
    ],
)
def test_serve_refuses_with_one_line_under_a_small_limit(tiny_llama_dir, tmp_path, limit, says):
    """The real CLI in a fresh process whose cgroup root is a fake tree with a small memory.max."""
    root = tmp_path / "cgroup"
    write(root / "memory.max", f"{limit}\n")
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
    assert says in errors[0]
