"""Frozen engine configuration (the CLI/env settings are converted into this at the boundary)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from .proposer_registry import check_method_names
from .sampling_params import MAX_NUM_SPECULATIVE_TOKENS, SPECULATIVE_POLICIES

# torch is imported inside the functions that use it, not here: the CLI imports this module to build
# its parser, and a usage error must not pay seconds for torch.
if TYPE_CHECKING:
    import torch

DTYPE_ENCODINGS = ("float32", "bfloat16", "float16")
QUANTIZED_ENCODINGS = ("int8", "int4")
ENCODINGS = (*DTYPE_ENCODINGS, *QUANTIZED_ENCODINGS)
INT4_GROUP_SIZES = (32, 64, 128)  # what the int4 kernel supports (and divides hidden sizes)
DEFAULT_NUM_SPECULATIVE_TOKENS = 5
# PyTorch's int4/int8 CPU kernels take rows in tiles of 4 and reread every weight per tile: a
# verification window of k + 1 <= 4 rows costs ~1.9x one row, 5-8 rows ~3.6x (Qwen 1.5B layer shapes,
# this 2-core Xeon). So a quantized target verifies k = 3 drafts in one tile by default.
QUANTIZED_TARGET_NUM_SPECULATIVE_TOKENS = 3
# Under the adaptive policy K is only a cap: the controller drafts fewer where it does not pay, so the
# cap is higher (8, or 7 for a quantized target: two 4-row tiles).
ADAPTIVE_NUM_SPECULATIVE_TOKENS = 8
ADAPTIVE_QUANTIZED_NUM_SPECULATIVE_TOKENS = 7
_CUDA_NAMES = ("gpu", "cuda")  # MAX spells it gpu; torch spells it cuda


@cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


if TYPE_CHECKING:
    DTYPES: dict[str, torch.dtype]  # encoding -> torch dtype, for DTYPE_ENCODINGS
else:

    def __getattr__(name: str):
        # DTYPES is built on first use (PEP 562), so importing this module does not import torch.
        if name == "DTYPES":
            return _dtypes()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _device_parts(value: str) -> tuple[str, int | None]:
    """parse_devices without torch: ("cpu", None), ("cuda", None) or ("cuda", N)."""
    name, colon, index = value.strip().lower().partition(":")
    if name == "cpu" and not colon:
        return "cpu", None
    if name in _CUDA_NAMES and not colon:
        return "cuda", None
    if name in _CUDA_NAMES and index.isdigit():
        return "cuda", int(index)
    raise ValueError(f"unknown device {value!r}; use cpu, gpu or gpu:N (one device)")


def parse_devices(value: str) -> torch.device:
    """--devices: cpu, gpu (or cuda) or gpu:N. Anything else is an error, never a silent CPU."""
    import torch

    kind, index = _device_parts(value)
    return torch.device(kind) if index is None else torch.device(kind, index)


def available_devices() -> list[str]:
    """What --devices can name on this machine (device_count() is 0 without CUDA)."""
    import torch

    return ["cpu", *(f"gpu:{i}" for i in range(torch.cuda.device_count()))]


def check_device_available(device: torch.device) -> None:
    """Refuse at start-up a device this machine does not have, naming the ones it does."""
    import torch

    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        what = "no CUDA GPU" if device.index is None else f"no CUDA GPU {device.index}"
        raise ValueError(f"{what} on this machine; available: {', '.join(available_devices())}")


def parse_method_list(value: str) -> list[str]:
    """--speculative-method as a list: "ngram", "ngram,draft_model"; auto and none stand alone."""
    names = [n.strip() for n in value.split(",")]
    if not value.strip() or any(not n for n in names):
        raise ValueError(f"--speculative-method {value!r}: an empty name in the list")
    if len(set(names)) != len(names):
        raise ValueError(f"--speculative-method {value!r}: a proposer is named twice")
    if len(names) > 1 and ({"auto", "none"} & set(names)):
        raise ValueError(f"--speculative-method {value!r}: auto and none cannot be part of a list")
    return names


@dataclass(frozen=True)
class ModelSpec:
    """Where one model comes from and how it runs (the target or the draft)."""

    model_path: str | None = None  # hub id, HF directory or .gguf; None = embedded default
    weight_path: str | None = None  # explicit weights file (GGUF) overriding model_path's
    quantization_encoding: str = "bfloat16"
    devices: str = "cpu"
    int4_group_size: int = 64  # weights per (scale, zero) of int4 layers: 32, 64 or 128

    @property
    def dtype(self) -> torch.dtype:
        import torch

        # int8/int4 keep bfloat16 activations (weight-only quantization).
        return _dtypes().get(self.quantization_encoding, torch.bfloat16)

    @property
    def device(self) -> torch.device:
        return parse_devices(self.devices)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec = ModelSpec()
    draft: ModelSpec | None = None
    # auto|none|ngram|draft_model|medusa|<plugin>|pkg.mod:Class, or a comma list (hybrid: cheapest first)
    speculative_method: str = "auto"
    # None: 8 (7 for an int8/int4 target) under the adaptive policy; 5 (3) under the static one.
    num_speculative_tokens: int | None = None
    speculative_policy: str = "adaptive"  # adaptive|static (engine/spec_controller.py)
    ngram_min: int = 1
    ngram_max: int = 4
    medusa_heads_path: str | None = None
    # A head the target's features drive (EAGLE, or Medusa: then the same as medusa_heads_path).
    speculative_head_path: str | None = None
    speculative_disable_batch_size: int | None = None
    block_size: int = 16
    device_memory_utilization: float = 0.9
    max_kv_cache_tokens: int | None = None
    enable_prefix_caching: bool = False
    max_batch_size: int = 32
    max_num_batched_tokens: int | None = None  # None: 2048 with chunked prefill, max_length without
    enable_chunked_prefill: bool = True
    max_length: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    cache_dir: str | None = None
    # The target's numerics do not depend on the batch (engine/attention.py): greedy speculation
    # equals plain decoding and output does not change with load, in bf16 and int8/int4 too.
    # CPU only. Off by default: it costs 0.78x decode speed alone and 0.44x at 8 clients on SmolLM2
    # (docs/bench/issue18-batch-invariance), far above the 5% that would make it the default.
    batch_invariant: bool = False
    step_log: str | None = None  # append every step as a JSON line here (engine/step_log.py)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens is None:
            quantized = self.model.quantization_encoding in QUANTIZED_ENCODINGS
            if self.speculative_policy == "adaptive":
                k = (
                    ADAPTIVE_QUANTIZED_NUM_SPECULATIVE_TOKENS
                    if quantized
                    else ADAPTIVE_NUM_SPECULATIVE_TOKENS
                )
            else:
                k = QUANTIZED_TARGET_NUM_SPECULATIVE_TOKENS if quantized else DEFAULT_NUM_SPECULATIVE_TOKENS
            object.__setattr__(self, "num_speculative_tokens", k)  # frozen: resolved once, here

    def resolved_methods(self) -> list[str]:
        """The proposers to build, cheapest first (more than one: a hybrid); [] or ["none"]: none.

        auto: ngram,draft_model with a draft model (lookup is free, the draft serves the rest),
        the head's method with --speculative-head-path (medusa with Medusa heads), else ngram."""
        if self.speculative_method.strip() == "auto":
            if self.draft is not None and self.draft.model_path is not None:
                return ["ngram", "draft_model"]
            if self.medusa_heads_path:
                return ["medusa"]
            if self.speculative_head_path:
                # Told apart by the weights' file name (engine code never imports the plugins).
                medusa = (Path(self.speculative_head_path) / "medusa_lm_head.safetensors").exists()
                return ["medusa" if medusa else "eagle"]
            return ["ngram"]
        return parse_method_list(self.speculative_method)

    def validate(self) -> None:
        if not 0 < self.device_memory_utilization <= 1:
            raise ValueError("--device-memory-utilization must be in (0, 1]")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("--kv-cache-page-size must be a power of two up to 128")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(
                f"--speculative-policy must be one of {', '.join(SPECULATIVE_POLICIES)}, not {self.speculative_policy!r}"
            )
        # Raises on a malformed list, or on a name no installed proposer has: before any model loads.
        check_method_names(parse_method_list(self.speculative_method))
        k = self.num_speculative_tokens
        if k is None or not 0 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"--max-num-steps must be in [0, {MAX_NUM_SPECULATIVE_TOKENS}]")
        if self.step_log is not None:
            where = Path(self.step_log)
            if where.is_dir():
                raise ValueError(f"--step-log {self.step_log}: is a directory")
            if not where.parent.is_dir():
                raise ValueError(f"--step-log {self.step_log}: no directory {where.parent}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("--ngram-min must be >= 1 and <= --ngram-max")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size must be >= 1")
        if self.speculative_disable_batch_size is not None and self.speculative_disable_batch_size < 1:
            raise ValueError("--speculative-disable-batch-size must be >= 1")
        for flag, spec in (("--devices", self.model), ("--draft-devices", self.draft)):
            if spec is not None:
                try:
                    # A CPU needs no check, and no torch: a usage error found here stays fast.
                    if _device_parts(spec.devices)[0] != "cpu":
                        check_device_available(parse_devices(spec.devices))
                except ValueError as exc:
                    raise ValueError(f"{flag} {spec.devices}: {exc}") from None
        for spec in (self.model, self.draft):
            if spec is not None and spec.quantization_encoding not in ENCODINGS:
                raise ValueError(
                    f"unknown quantization encoding {spec.quantization_encoding!r}; choose from {', '.join(ENCODINGS)}"
                )
            if spec is not None and spec.int4_group_size not in INT4_GROUP_SIZES:
                sizes = ", ".join(map(str, INT4_GROUP_SIZES))
                raise ValueError(f"--int4-group-size must be one of {sizes}, not {spec.int4_group_size}")
