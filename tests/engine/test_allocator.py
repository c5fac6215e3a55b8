"""KV pool sizing from device memory."""

from __future__ import annotations

import pytest
from tiny_models import make_llm

from specserve.engine.memory import InsufficientMemoryError, plan_num_blocks


def test_plan_subtracts_weights_and_activations():
    assert plan_num_blocks(1000, 0.5, 100, 100, 10, 1) == 30
    with pytest.raises(InsufficientMemoryError, match="needs 31"):
        plan_num_blocks(1000, 0.5, 100, 100, 10, 31)


def test_utilization_sizes_the_pool(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_kv_cache_tokens=None, device_memory_utilization=0.05, max_length=256)
    engine = llm.engine
    # The pool is capped at what a full batch can use; with 5% of RAM a tiny model reaches that cap.
    assert engine.num_blocks == engine.config.max_batch_size * (256 // 16)


def test_too_little_memory_is_a_clear_startup_error(tiny_llama_dir):
    with pytest.raises(InsufficientMemoryError) as err:
        make_llm(tiny_llama_dir, max_kv_cache_tokens=None, device_memory_utilization=1e-9)
    message = str(err.value)
    assert "GiB" in message and "--device-memory-utilization" in message


# Measures one forward's peak RSS in a fresh interpreter: freed memory is returned to the OS first
# (malloc_trim) and the kernel's high-water mark is reset (clear_refs 5), so VmHWM - VmRSS is what the
# forward itself added. Prints "<measured peak delta> <estimate>" in bytes.
_MEASURE_FORWARD = """
import ctypes, sys, torch

def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

from specserve.engine.memory import estimate_activation_bytes
from specserve.engine.models.arch import ArchConfig
from specserve.engine.models.registry import build_decoder
from specserve.engine.runner import SequenceInput, forward_sequences

budget, max_length, rows = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
torch.set_default_dtype(torch.bfloat16)  # no float32 copy of the weights to leave freed pages behind
cfg = ArchConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=512, intermediate_size=2048,
    num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
    max_position_embeddings=max_length, tie_word_embeddings=False, attention_bias=False, qk_norm=False)
model = build_decoder(cfg).eval()
block = 16
cache = model.allocate_kv_cache(max_length, torch.bfloat16, "cpu")
# The worst case for attention: the budget's chunk at the very end of a max_length context.
seq = SequenceInput([5] * budget, max_length - budget, list(range(max_length // block)), budget)
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status_kib("VmRSS") * 1024
with torch.inference_mode():
    hidden = forward_sequences(model, cache, [seq], block)  # [budget, hidden]
    logits = model.compute_logits(hidden[:rows])  # [rows, vocab]
    probs = torch.softmax(logits.clone(), dim=-1)
peak = status_kib("VmHWM") * 1024
print(peak - before, estimate_activation_bytes(cfg, budget, max_length, rows, 2))
"""


@pytest.mark.parametrize("budget,max_length", [(2048, 2048), (1024, 4096)])
def test_cpu_activation_estimate_bounds_a_real_forward(budget, max_length):
    """The CPU KV plan uses a shape-based bound instead of a profiling forward: it must not undershoot."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _MEASURE_FORWARD, str(budget), str(max_length), "192"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured, estimate = map(int, run.stdout.split())
    assert measured > 32 << 20  # the forward really allocated: the comparison means something
    assert measured <= estimate <= 4 * measured + (64 << 20), (measured, estimate)


def test_cpu_kv_pool_is_zeroed_and_committed_only_where_written():
    """A pool sized for the whole memory budget must not be resident (or zero-filled) up front."""
    import os

    import torch

    from specserve.benchmarks.soak import rss_bytes
    from specserve.engine.models.arch import ArchConfig
    from specserve.engine.models.registry import build_decoder

    def rss() -> int:
        return rss_bytes(os.getpid()) or 0

    cfg = ArchConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
    )  # fmt: skip
    model = build_decoder(cfg)
    before = rss()
    cache = model.allocate_kv_cache(1 << 22, torch.bfloat16, "cpu")  # 4 layers x K, V x 256 MiB = 2 GiB
    assert len(cache) == 4 and cache[0][0].shape == (1 << 22, 2, 16)
    assert rss() - before < 64 << 20
    k, v = cache[3]
    assert not k[:4096].any() and not v[-4096:].any()  # zeros, also where never written
    slots = torch.tensor([0, 12345, (1 << 22) - 1])
    k.index_copy_(0, slots, torch.ones(3, 2, 16, dtype=torch.bfloat16))
    assert k.index_select(0, slots).eq(1).all()
    assert not k[1:12345].any() and not k[12346:20000].any() and not v.index_select(0, slots).any()
    # Touching a few slots commits a few pages (reading all of it would map the whole pool).
    assert rss() - before < 64 << 20
