"""AsyncEngine.build: the engine is loaded on the worker thread its steps run on (one OpenMP team)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specserve.engine import async_engine
from specserve.engine.config import EngineConfig, ModelSpec
from specserve.engine.sampling_params import SamplingParams


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(model_path=str(model_dir), quantization_encoding="float32"),
        max_kv_cache_tokens=4096,
        speculative_method="none",
    )


def test_build_loads_the_core_on_the_thread_its_steps_run_on(tiny_llama_dir, monkeypatch):
    threads: dict[str, set[str]] = {"init": set(), "step": set()}

    class RecordingCore(async_engine.EngineCore):
        def __init__(self, config):
            threads["init"].add(threading.current_thread().name)
            super().__init__(config)

        def step(self):
            threads["step"].add(threading.current_thread().name)
            return super().step()

    monkeypatch.setattr(async_engine, "EngineCore", RecordingCore)
    engine = async_engine.AsyncEngine.build(_config(tiny_llama_dir))

    async def generate() -> int:
        engine.start()
        try:
            queue = engine.submit([1, 2, 3], SamplingParams(max_tokens=5, temperature=0), "r1")
            return sum([len(out.new_token_ids) async for out in engine.stream(queue, "r1")])
        finally:
            await engine.stop()

    assert asyncio.run(generate()) == 5
    assert threads["init"] == threads["step"]
    assert len(threads["init"]) == 1 and threads["init"] != {threading.main_thread().name}


def test_a_build_that_fails_raises_and_ends_its_thread(tmp_path):
    with pytest.raises(Exception, match="missing"):
        async_engine.AsyncEngine.build(_config(tmp_path / "missing"))
    deadline = time.monotonic() + 10
    while any(t.name.startswith("specserve-engine") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the engine thread outlived its failed build"
        time.sleep(0.05)
