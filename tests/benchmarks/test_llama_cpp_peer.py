"""The llama.cpp benchmark peer: its load-time switch, and (where llama-cpp-python is installed) a
real generation on a tiny GGUF."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.benchmarks import llama_cpp_peer

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_gguf_convert import tiny_model, write_gguf  # noqa: E402


def test_extra_buffer_types_are_off_only_during_the_load() -> None:
    params = SimpleNamespace(use_extra_bufts=True)
    low_level = SimpleNamespace(llama_model_default_params=lambda: SimpleNamespace(**vars(params)))
    fake = SimpleNamespace(llama_cpp=low_level)
    original = low_level.llama_model_default_params

    with llama_cpp_peer._without_extra_buffer_types(fake):
        assert low_level.llama_model_default_params().use_extra_bufts is False
    assert low_level.llama_model_default_params is original
    assert low_level.llama_model_default_params().use_extra_bufts is True

    with pytest.raises(RuntimeError), llama_cpp_peer._without_extra_buffer_types(fake):
        raise RuntimeError("a failed load still restores the defaults")
    assert low_level.llama_model_default_params is original


def test_target_gguf_is_found_for_gguf_sources_only(tmp_path: Path, tiny_llama_dir: Path) -> None:
    gguf_file = write_gguf(tiny_model("llama", tied=True), tmp_path / "tiny.gguf")
    assert llama_cpp_peer.target_gguf(str(gguf_file), str(tmp_path / "c")) == gguf_file
    assert llama_cpp_peer.target_gguf(str(tiny_llama_dir), str(tmp_path / "c")) is None


def test_llama_cpp_generates_greedily_from_token_ids(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional benchmark peer")
    gguf_file = write_gguf(tiny_model("llama", tied=True), tmp_path / "tiny.gguf")
    runner = llama_cpp_peer.LlamaCppRunner(llama_cpp_peer.load(gguf_file, n_threads=1, n_ctx=128))

    first = runner.run([5, 9, 200, 7, 42], 6, ignore_eos=True)
    again = runner.run([5, 9, 200, 7, 42], 6, ignore_eos=True)

    assert len(first.token_ids) == 6 and first.first_token_s is not None
    assert first.elapsed_s >= first.first_token_s > 0
    assert again.token_ids == first.token_ids  # greedy, and no state carried between runs
