"""The architecture registry is the one place a model family is named, and loading goes through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model, tiny_config

import specserve.engine
from specserve.engine.models import arch, loader
from specserve.engine.models.arch import ArchConfig, UnsupportedArchitectureError
from specserve.engine.models.decoder import CausalDecoder
from specserve.engine.models.factory import load_decoder
from specserve.engine.models.registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, build_decoder

ENGINE = Path(specserve.engine.__file__).parent
SUPPORTED = "GemmaForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


def test_every_registered_family_is_a_causal_decoder() -> None:
    for name, family in ARCHITECTURES.items():
        assert issubclass(family.decoder_class(), CausalDecoder), name


def test_registry_is_read_only_data() -> None:
    with pytest.raises(TypeError):
        ARCHITECTURES["GPTNeoXForCausalLM"] = ARCHITECTURES["LlamaForCausalLM"]  # type: ignore[index]
    with pytest.raises(TypeError):
        ARCHITECTURES["Qwen2ForCausalLM"].fixed["attention_bias"] = False  # type: ignore[index]


def test_supported_lists_derive_from_the_registry() -> None:
    assert tuple(sorted(ARCHITECTURES)) == SUPPORTED_ARCHITECTURES
    assert arch.SUPPORTED_ARCHITECTURES == loader.SUPPORTED_ARCHITECTURES == SUPPORTED_ARCHITECTURES
    assert ", ".join(SUPPORTED_ARCHITECTURES) == SUPPORTED


def test_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    config = tiny_config("llama").to_dict() | {"architectures": ["GPTNeoXForCausalLM"]}
    with pytest.raises(UnsupportedArchitectureError) as err:
        ArchConfig.from_hf_dict(config)
    assert str(err.value) == f"unsupported architecture ['GPTNeoXForCausalLM']; supported: {SUPPORTED}"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM"):
        load_decoder(tmp_path, torch.float32)


@pytest.mark.parametrize(
    ("tiny_arch", "hf_arch"),
    [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("gemma", "GemmaForCausalLM")],
)
def test_loading_builds_the_registered_class(tmp_path: Path, tiny_arch: str, hf_arch: str) -> None:
    build_tiny_model(tmp_path, tiny_arch, with_tokenizer=False)
    model = load_decoder(tmp_path, torch.float32)
    family = ARCHITECTURES[hf_arch]
    assert type(model) is family.decoder_class() and isinstance(model, CausalDecoder)
    assert model.config.architecture == hf_arch
    for field, value in family.fixed.items():
        assert getattr(model.config, field) == value
    assert type(build_decoder(model.config)) is type(model)


def test_gemma_reads_its_config_its_own_way() -> None:
    hf = tiny_config("gemma").to_dict() | {"architectures": ["GemmaForCausalLM"]}
    del hf["tie_word_embeddings"]  # released Gemma configs leave it out: tied
    cfg = ArchConfig.from_hf_dict(hf | {"hidden_act": "gelu"})  # legacy value, means the tanh form
    assert (cfg.tie_word_embeddings, cfg.hidden_act, cfg.head_dim) == (True, "gelu_pytorch_tanh", 32)
    with pytest.raises(UnsupportedArchitectureError, match="bidirectional"):
        ArchConfig.from_hf_dict(hf | {"use_bidirectional_attention": True})


# Files that may name a family: the registry, the families' own modules, GGUF's map of llama.cpp
# architecture names to HF ones, and the package's transitional LlamaForCausalLM re-export.
_MAY_NAME = {"models/registry.py", "models/gguf_metadata.py"}


def test_only_the_registry_names_a_family() -> None:
    families = {f"models/{family.module}.py" for family in ARCHITECTURES.values()}
    names = set(ARCHITECTURES) | {family.class_name for family in ARCHITECTURES.values()}
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE).as_posix()
        if rel in _MAY_NAME or rel in families:
            continue
        text = path.read_text()
        offenders += [f"{rel}: {name}" for name in sorted(names) if name in text]
    assert not offenders, offenders
