"""Settings at the boundary: argparse for flags, pydantic-settings for SPECSERVE_* env vars and types.

Flags given on the command line win over environment variables, which win over defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, NoReturn

from pydantic import ValidationError, create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from specserve.engine.config import EngineConfig, ModelSpec
from specserve.engine.heap_retention import retain_heaps
from specserve.engine.model_source import unknown_model_path

from .cpu_threads import default_num_threads
from .flags import Flag

logger = logging.getLogger("specserve.api")


class CliError(Exception):
    """A one-line usage error: printed as `specserve: error: ...`, exit code 2."""


class OneLineArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see {self.prog} --help)")


def build_settings_class(name: str, flags: list[Flag]) -> type[BaseSettings]:
    fields: dict[str, Any] = {}
    for f in flags:
        annotation = f.type | None if f.default is None else f.type
        fields[f.name] = (annotation, f.default)
    cls = create_model(name, __base__=BaseSettings, **fields)
    cls.model_config = SettingsConfigDict(env_prefix="SPECSERVE_", extra="ignore", case_sensitive=False)
    return cls


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in flags:
        group = groups.setdefault(f.group, parser.add_argument_group(f.group))
        default_txt = "" if f.default is None else f" (default: {f.default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": f.help + default_txt}
        if f.type is bool:
            if f.name.startswith("no_") or not f.default:
                kwargs["action"] = (
                    "store_true" if f.name.startswith("no_") else argparse.BooleanOptionalAction
                )
            else:
                kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = f.type
            kwargs["metavar"] = f.name.upper().removeprefix("DRAFT_") if not f.choices else None
            if f.choices:
                kwargs["choices"] = f.choices
        group.add_argument(f.option, *f.aliases, **kwargs)


def parse_settings(settings_cls: type[BaseSettings], args: argparse.Namespace) -> BaseSettings:
    given = {k: v for k, v in vars(args).items() if v is not None and k in settings_cls.model_fields}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "?"
        raise CliError(f"--{field.replace('_', '-')}: {first['msg']}") from None


def engine_config_from(settings: BaseSettings) -> EngineConfig:
    s = settings
    if s.num_threads is not None and s.num_threads < 1:
        raise CliError("--num-threads must be >= 1")
    target = ModelSpec(
        model_path=s.model_path,
        weight_path=s.weight_path,
        quantization_encoding=s.quantization_encoding,
        devices=s.devices,
        int4_group_size=s.int4_group_size,
    )
    draft = None
    if s.draft_model_path or s.draft_weight_path:
        draft = ModelSpec(
            model_path=s.draft_model_path or s.draft_weight_path,
            weight_path=s.draft_weight_path,
            quantization_encoding=s.draft_quantization_encoding or s.quantization_encoding,
            devices=s.draft_devices or s.devices,
            int4_group_size=s.draft_int4_group_size or s.int4_group_size,
        )
    config = EngineConfig(
        model=target,
        draft=draft,
        speculative_method=s.speculative_method,
        speculative_policy=s.speculative_policy,
        num_speculative_tokens=s.max_num_steps,
        ngram_min=s.ngram_min,
        ngram_max=s.ngram_max,
        medusa_heads_path=s.medusa_heads_path,
        speculative_head_path=s.speculative_head_path,
        speculative_disable_batch_size=s.speculative_disable_batch_size,
        block_size=s.kv_cache_page_size,
        device_memory_utilization=s.device_memory_utilization,
        max_kv_cache_tokens=s.max_kv_cache_tokens,
        enable_prefix_caching=s.enable_prefix_caching,
        batch_invariant=s.batch_invariant,
        max_batch_size=s.max_batch_size,
        max_num_batched_tokens=s.max_num_batched_tokens,
        enable_chunked_prefill=s.enable_chunked_prefill,
        max_length=s.max_length,
        seed=s.seed,
        cache_dir=s.cache_dir,
        step_log=s.step_log,
    )
    try:
        config.validate()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    for spec in (target, draft):  # the loader refuses these too, but only after torch is imported
        if spec is not None and spec.model_path and not spec.weight_path:
            why = unknown_model_path(spec.model_path)
            if why:
                raise CliError(why)
    # Before any model memory is allocated: otherwise the engine thread's forwards can fall, for minutes,
    # into mapping and dropping a malloc heap for their activations (engine/heap_retention.py).
    retain_heaps()
    # torch only now: a usage error found above is reported without paying seconds for its import.
    import torch

    if s.num_threads is not None:
        torch.set_num_threads(s.num_threads)  # process-wide by nature: set once, here at the boundary
    else:
        threads = default_num_threads(torch.get_num_threads())
        if threads < torch.get_num_threads():
            logger.info("using %d CPU threads (the container's CPU quota / affinity)", threads)
            torch.set_num_threads(threads)
    return config


def fail(message: str) -> NoReturn:
    print(f"specserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)
