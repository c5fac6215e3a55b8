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
