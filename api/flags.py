"""Every command-line flag, defined once. The `--draft-` twins of the model flags are generated here,
and the same definitions build both the argparse parser and the pydantic-settings class, so each flag
also reads from SPECSERVE_<NAME> in the environment."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from specserve.engine.config import ENCODINGS, INT4_GROUP_SIZES
from specserve.engine.sampling_params import SPECULATIVE_POLICIES


@dataclass(frozen=True)
class Flag:
    name: str  # python/settings name; the flag is --name-with-dashes
    type: Any
    default: Any
    help: str
    group: str
    choices: tuple[Any, ...] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


MODEL_FLAGS = [
    Flag(
        "model_path",
        str,
        None,
        "hub id, HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)",
        "model",
    ),
    Flag("weight_path", str, None, "explicit weights file (e.g. a .gguf) for the model", "model"),
    Flag(
        "quantization_encoding",
        str,
        "bfloat16",
        "weights/compute type; int8/int4 are weight-only and LOSSY for a target (fine for a draft)",
        "model",
        choices=ENCODINGS,
        aliases=("--dtype",),
    ),
    Flag("devices", str, "cpu", "cpu, gpu or gpu:N", "model"),
    Flag(
        "int4_group_size",
        int,
        64,
        "int4 only: weights per scale/zero (GGUF Q4_0/Q4_1/Q4_K layers keep their own 32)",
        "model",
        choices=INT4_GROUP_SIZES,
    ),
]

# Each model flag has a --draft- twin configuring the draft model independently (default: the target's).
DRAFT_FLAGS = [
    replace(
        f,
        name="draft_" + f.name,
        default=None,
        help=f"draft model: {f.help}"
        if f.name == "model_path"
        else f"draft model's {f.name.replace('_', ' ')}",
        group="speculative decoding",
        aliases=tuple("--draft-" + a[2:] for a in f.aliases),
    )
    for f in MODEL_FLAGS
]
DRAFT_FLAGS[0] = replace(
    DRAFT_FLAGS[0], help="draft model (hub id, dir or .gguf); turns on the draft_model proposer"
)

SPEC_FLAGS = [
    Flag(
        "speculative_method",
        str,
        "auto",
        "auto|none|ngram|draft_model|medusa|eagle|<plugin>|pkg.module:Class, or a comma list such as"
        " ngram,draft_model (per request per step the proposer expected to do best; auto: ngram,draft_model"
        " if a draft is given, the head's method with --speculative-head-path, else ngram)",
        "speculative decoding",
    ),
    Flag(
        "speculative_policy",
        str,
        "adaptive",
        "adaptive: a controller picks k per request per step from measured acceptance and step cost"
        " (0 when drafting does not pay); static: always draft --max-num-steps",
        "speculative decoding",
        choices=SPECULATIVE_POLICIES,
    ),
    Flag(
        "max_num_steps",
        int,
        None,
        "most draft tokens proposed per verification (adaptive policy: a cap, default 8, 7 for an"
        " int8/int4 target; static: default 5, 3 for int8/int4, whose kernels verify 4 rows for ~2)",
        "speculative decoding",
        aliases=("--num-speculative-tokens",),
    ),
    Flag("ngram_min", int, 1, "shortest n-gram matched by prompt lookup", "speculative decoding"),
    Flag("ngram_max", int, 4, "longest n-gram matched by prompt lookup", "speculative decoding"),
    Flag(
        "speculative_head_path",
        str,
        None,
        "directory with a draft head the target's features drive: EAGLE-1/2 (config.json + model.safetensors"
        " or pytorch_model.bin) or Medusa-1 (medusa_lm_head.safetensors), e.g. from specserve train-draft",
        "speculative decoding",
    ),
    Flag(
        "medusa_heads_path",
        str,
        None,
        "directory with a Medusa-1 head checkpoint (--speculative-head-path for Medusa heads)",
        "speculative decoding",
    ),
    Flag(
        "speculative_disable_batch_size",
        int,
        None,
        "stop drafting while this many requests run (big batches are compute-bound)",
        "speculative decoding",
    ),
]

ENGINE_FLAGS = [
    Flag(
        "device_memory_utilization",
        float,
        0.9,
        "fraction of device memory (CPU: RAM) for weights + KV cache",
        "engine",
    ),
    Flag(
        "max_kv_cache_tokens",
        int,
        None,
        "fixed KV cache size in tokens (instead of sizing it from --device-memory-utilization)",
        "engine",
    ),
    Flag("kv_cache_page_size", int, 16, "tokens per KV cache block", "engine"),
    Flag("enable_prefix_caching", bool, False, "reuse KV blocks of repeated prompt prefixes", "engine"),
    Flag(
        "batch_invariant",
        bool,
        False,
        "target numerics independent of the batch (CPU): greedy speculation equals plain decoding"
        " and output does not change with load, in bf16/int8/int4 too (slower: 0.4-0.8x)",
        "engine",
    ),
    Flag(
        "enable_chunked_prefill",
        bool,
        True,
        "split long prompts into chunks that share steps with decodes",
        "engine",
    ),
    Flag(
        "max_length", int, None, "max tokens per sequence, prompt + output (default: the model's)", "engine"
    ),
    Flag("max_batch_size", int, 32, "most requests running at once", "engine"),
    Flag("max_num_batched_tokens", int, None, "token budget per step (default 2048)", "engine"),
    Flag("seed", int, 0, "engine seed for requests without their own", "engine"),
    Flag(
        "num_threads",
        int,
        None,
        "CPU threads for torch (default: torch's, capped by the CPU quota and affinity of the"
        " container; 1 is faster on a busy machine)",
        "engine",
    ),
    Flag(
        "cache_dir",
        str,
        None,
        "converted-model cache (default: $SPECSERVE_CACHE_DIR or ~/.cache/specserve)",
        "engine",
    ),
]

SERVE_FLAGS = [
    Flag(
        "host",
        str,
        "0.0.0.0",
        "bind address (0.0.0.0 exposes the API to the network; 127.0.0.1 keeps it local)",
        "server",
    ),
    Flag("port", int, 8000, "TCP port", "server"),
    Flag("served_model_name", str, None, "model name in the API (default: the model path)", "server"),
    Flag("api_key", str, None, "require 'Authorization: Bearer KEY' (except /health and /metrics)", "server"),
    Flag(
        "unauthenticated_paths",
        str,
        "/health,/metrics",
        "comma-separated paths that need no API key",
        "server",
    ),
    Flag(
        "tool_call_parser",
        str,
        "auto",
        "how the model writes tool calls: hermes (Qwen2.5, Hermes), llama3_json, mistral, or auto"
        " (detected from the chat template)",
        "server",
        choices=("auto", "hermes", "llama3_json", "mistral"),
    ),
    Flag("max_request_bytes", int, 1 << 20, "largest accepted request body (413 beyond)", "server"),
    Flag("max_waiting_requests", int, 256, "queued requests beyond which new ones get 503", "server"),
    Flag(
        "request_read_timeout",
        float,
        30.0,
        "seconds to receive a request's headers or whole body (also the idle keep-alive limit)",
        "server",
    ),
    Flag("shutdown_timeout", float, 30.0, "seconds in-flight requests get to finish on SIGTERM", "server"),
    Flag("log_stats_interval", float, 10.0, "seconds between stats log lines (0: off)", "server"),
]

GENERATE_FLAGS = [
    Flag("prompt", str, None, "the prompt text", "generation"),
    Flag("prompt_file", str, None, "read the prompt from this file", "generation"),
    Flag("max_new_tokens", int, 128, "most tokens to generate", "generation"),
    Flag("temperature", float, 0.0, "sampling temperature (0: greedy)", "generation"),
    Flag("top_p", float, 1.0, "nucleus sampling mass", "generation"),
    Flag("top_k", int, 0, "sample from the k most likely tokens (0: off)", "generation"),
    Flag("min_p", float, 0.0, "drop tokens below min_p x the top probability", "generation"),
    Flag("repetition_penalty", float, 1.0, "penalise tokens already seen (>1 discourages)", "generation"),
    Flag("stop", str, None, "stop string", "generation"),
    Flag("ignore_eos", bool, False, "keep generating past end-of-sequence tokens", "generation"),
    Flag(
        "no_chat_template",
        bool,
        False,
        "send the prompt as raw text, without the chat template",
        "generation",
    ),
    Flag("output", str, "text", "text or json", "generation", choices=("text", "json")),
]

# Logging, for serve and generate (--no-access-log only matters to serve). Values from SPECSERVE_LOG_*
# are checked again in api/logs.py, since the environment skips argparse's choices.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")
LOG_FLAGS = [
    Flag("log_level", str, "info", "debug, info, warning, error or critical", "logging", choices=LOG_LEVELS),
    Flag(
        "log_format",
        str,
        "text",
        "text, or json: one JSON object per line (request id, route, status, latency, tokens; no prompt text)",
        "logging",
        choices=LOG_FORMATS,
    ),
    Flag("no_access_log", bool, False, "no log line per HTTP request (serve)", "logging"),
    Flag(
        "step_log",
        str,
        None,
        "append every engine step to this file as a JSON line (what it held, its times, the speculation"
        " controller's expectation; read it with `specserve bench steps`)",
        "logging",
    ),
]

MODEL_AND_ENGINE = MODEL_FLAGS + DRAFT_FLAGS + SPEC_FLAGS + ENGINE_FLAGS
