"""`specserve bench latency`: offline, in-process, batch-1 greedy decoding side by side.

Methods (all on the same prompt token ids, same dtype, same max new tokens):
  specserve:plain            speculation off
  specserve:ngram            prompt-lookup proposer
  specserve:draft_model      draft-model proposer (needs --draft-model-path)
  transformers:plain         generate(do_sample=False)
  transformers:assisted      generate(assistant_model=draft) (needs --draft-model-path)
  transformers:prompt_lookup generate(prompt_lookup_num_tokens=K)
  llama.cpp:plain            llama-cpp-python on the target's GGUF (when importable and the target
                             comes from a GGUF); its weights are the GGUF's quantized ones

Runs are interleaved (for each repeat, for each prompt, every method in a rotated order) after a warm-up,
so every speedup is a median of ratios between neighbouring measurements of the same prompt.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import llama_cpp_peer
from . import stats as st
from .common import (
    command_line,
    default_output_dir,
    fmt,
    machine_info,
    md_table,
    now_iso,
    progress,
    use_agg,
    write_json,
)
from .prompt_sets import CATEGORIES, Prompt, load_prompts, parse_categories

SCHEMA = "specserve.bench.latency/1"
SS_PLAIN, SS_NGRAM, SS_DRAFT = "specserve:plain", "specserve:ngram", "specserve:draft_model"
HF_PLAIN, HF_ASSISTED, HF_LOOKUP = "transformers:plain", "transformers:assisted", "transformers:prompt_lookup"
LC_PLAIN = llama_cpp_peer.LLAMA_CPP_PLAIN
ALL_METHODS = (SS_PLAIN, SS_NGRAM, SS_DRAFT, HF_PLAIN, HF_ASSISTED, HF_LOOKUP, LC_PLAIN)
SHORT = {
    "plain": SS_PLAIN,
    "ngram": SS_NGRAM,
    "draft_model": SS_DRAFT,
    "draft": SS_DRAFT,
    "hf_plain": HF_PLAIN,
    "hf_assisted": HF_ASSISTED,
    "hf_prompt_lookup": HF_LOOKUP,
    "hf_lookup": HF_LOOKUP,
    "llama_cpp": LC_PLAIN,
    "llama.cpp": LC_PLAIN,
}
logger = logging.getLogger("specserve.bench")


# --- one measured generation --------------------------------------------------------------------------
@dataclass
class RunResult:
    token_ids: list[int]
    elapsed_s: float
    first_token_s: float | None
    num_steps: int | None = None  # target forwards that emitted tokens (transformers: streamer puts)
    spec: dict[str, Any] | None = None
    draft_s: float | None = None
    verify_s: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 and self.token_ids else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        n = len(self.token_ids) - 1
        if self.first_token_s is None or n <= 0:
            return None
        dt = self.elapsed_s - self.first_token_s
        return n / dt if dt > 0 else None


class SpecserveRunner:
    """One specserve engine; `speculate=False` runs the same engine with speculation off per request."""

    def __init__(self, llm: Any, speculate: bool):
        self.llm = llm
        self.speculate = speculate

    def run(self, ids: list[int], max_new_tokens: int, ignore_eos: bool) -> RunResult:
        from specserve.engine import SamplingParams

        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=0.0,
            ignore_eos=ignore_eos,
            speculative_enabled=self.speculate,
        )
        eng = self.llm.engine.stats.spec
        d0, v0 = eng.draft_seconds, eng.verify_seconds
        out = self.llm.generate([ids], params)[0]
        if out.error:
            raise RuntimeError(f"specserve request failed: {out.error}")
        spec = None
        if self.speculate:
            s = out.spec
            spec = {
                "num_drafts": s.num_drafts,
                "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens,
                "accepted_per_position": list(s.accepted_per_position),
            }
        return RunResult(
            list(out.token_ids),
            out.elapsed_s,
            out.first_token_s,
            None,
            spec,
            eng.draft_seconds - d0 if self.speculate else None,
            eng.verify_seconds - v0 if self.speculate else None,
        )

    def run_batch(self, batch: list[list[int]], max_new_tokens: int, ignore_eos: bool) -> tuple[int, float]:
        from specserve.engine import SamplingParams

        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=0.0,
            ignore_eos=ignore_eos,
            speculative_enabled=self.speculate,
        )
        t0 = time.perf_counter()
        outs = self.llm.generate(batch, params)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


class _TimingStreamer:
    """transformers streamer that only records when each chunk of new tokens arrived."""

    def __init__(self) -> None:
        self.times: list[tuple[float, int]] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:  # generate() first puts the prompt
            self._seen_prompt = True
            return
        self.times.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


class TransformersRunner:
    def __init__(self, model: Any, extra: dict[str, Any]):
        self.model = model
        self.extra = extra

    def run(self, ids: list[int], max_new_tokens: int, ignore_eos: bool) -> RunResult:
        import copy

        import torch

        gc = copy.deepcopy(self.model.generation_config)
        gc.max_new_tokens = max_new_tokens
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = None
        if gc.pad_token_id is None:
            eos = gc.eos_token_id
            gc.pad_token_id = eos[0] if isinstance(eos, list) else eos
        if ignore_eos:
            gc.eos_token_id = None
        for k, v in self.extra.items():
            if k != "assistant_model":
                setattr(gc, k, v)
        input_ids = torch.tensor([ids], dtype=torch.long)
        streamer = _TimingStreamer()
        kwargs = {"assistant_model": self.extra["assistant_model"]} if "assistant_model" in self.extra else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gc,
                streamer=streamer,
                **kwargs,
            )
        elapsed = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        first = streamer.times[0][0] - t0 if streamer.times else None
        return RunResult(new, elapsed, first, len(streamer.times))


# --- the benchmark -------------------------------------------------------------------------------------
@dataclass
class Setup:
    runners: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    tokenizer_llm: Any = None
    hf_tokenizer: Any = None
    plain_runner_for_throughput: Any = None
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why it did not run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specserve bench latency",
        description="Batch-1 greedy decoding side by side: specserve (plain / ngram / draft model) vs "
        "transformers generate() (plain / assisted / prompt lookup); interleaved runs, median ratios.",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path", default=None, help="target model (hub id, HF dir or .gguf); default: embedded"
    )
    m.add_argument(
        "--draft-model-path",
        default=None,
        help="draft model: enables specserve:draft_model and transformers:assisted",
    )
    m.add_argument(
        "--quantization-encoding",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="dtype for every method",
    )
    m.add_argument(
        "--draft-quantization-encoding",
        default=None,
        choices=["float32", "bfloat16", "float16", "int8", "int4"],
        help="specserve's draft model encoding (default: the target's); transformers' assistant stays in the dtype",
    )
    m.add_argument("--cache-dir", default=None, help="specserve cache dir (default $SPECSERVE_CACHE_DIR)")
    m.add_argument(
        "--max-kv-cache-tokens",
        type=int,
        default=None,
        help="KV cache size per engine (default: sized to the run)",
    )
    m.add_argument(
        "--max-length",
        type=int,
        default=4096,
        help="engine max sequence length (prompt + new tokens); longer prompts are skipped",
    )
    m.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    r = p.add_argument_group("run")
    r.add_argument(
        "--methods",
        default=None,
        help=f"comma list from {', '.join(ALL_METHODS)} (short: plain, ngram, draft_model, hf_plain, "
        "hf_assisted, hf_prompt_lookup); default: all that apply",
    )
    r.add_argument("--categories", default="all", help=f"comma list from {', '.join(CATEGORIES)} or all")
    r.add_argument("--prompts-per-category", type=int, default=None, help="first N prompts of each category")
    r.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per request")
    r.add_argument(
        "--respect-eos",
        action="store_true",
        help="stop at EOS (default: ignore EOS so every method generates exactly --max-new-tokens)",
    )
    r.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats per prompt and method")
    r.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per method")
    r.add_argument(
        "--num-speculative-tokens",
        "--max-num-steps",
        dest="k",
        type=int,
        default=5,
        help="draft tokens per verification (specserve) and prompt_lookup_num_tokens (transformers)",
    )
    r.add_argument("--ngram-min", type=int, default=1)
    r.add_argument("--ngram-max", type=int, default=4)
    r.add_argument(
        "--hf-num-assistant-tokens",
        type=int,
        default=None,
        help="transformers assisted: num_assistant_tokens (default: transformers' default + heuristic schedule)",
    )
    r.add_argument(
        "--hf-assistant-schedule",
        default=None,
        choices=["heuristic", "constant"],
        help="transformers assisted: num_assistant_tokens_schedule",
    )
    r.add_argument(
        "--plain-engine",
        choices=["shared", "separate"],
        default="shared",
        help="specserve:plain on a speculative engine with speculation off per request (shared, saves "
        "memory) or on its own engine with --speculative-method none",
    )
    r.add_argument(
        "--throughput-batch",
        type=int,
        default=0,
        help="also time B prompts submitted together to specserve:plain vs its batch-1 rate",
    )
    r.add_argument(
        "--metric",
        choices=["e2e", "decode"],
        default="e2e",
        help="headline tokens/s: e2e = generated/total time; decode = excludes the first token",
    )
    r.add_argument(
        "--quick",
        action="store_true",
        help="1 prompt per category, 32 new tokens, 2 repeats (embedded model: < 5 min)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--output-dir",
        default=None,
        help="where latency.json/.md/.png go (default bench-results/latency-<time>)",
    )
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    return p


def _select_methods(args: argparse.Namespace) -> list[str]:
    if args.methods:
        out = []
        for raw in args.methods.split(","):
            name = SHORT.get(raw.strip(), raw.strip())
            if name not in ALL_METHODS:
                raise SystemExit(f"specserve bench latency: unknown method {raw!r}")
            out.append(name)
    else:
        out = [SS_PLAIN, SS_NGRAM, SS_DRAFT, HF_PLAIN, HF_ASSISTED, HF_LOOKUP, LC_PLAIN]
    if not args.draft_model_path:
        dropped = [m for m in out if m in (SS_DRAFT, HF_ASSISTED)]
        if dropped and args.methods:
            raise SystemExit(f"specserve bench latency: {', '.join(dropped)} need --draft-model-path")
        out = [m for m in out if m not in (SS_DRAFT, HF_ASSISTED)]
    if LC_PLAIN in out and not llama_cpp_peer.available():
        if args.methods:
            raise SystemExit("specserve bench latency: llama.cpp:plain needs llama-cpp-python")
        out.remove(LC_PLAIN)
    return list(dict.fromkeys(out))


def _hf_dir(model_path: str | None, dtype: Any, cache_dir: str | None) -> Path:
    from specserve.engine.models.loader import resolve_model

    return resolve_model(model_path, dtype=dtype, cache_dir=Path(cache_dir) if cache_dir else None).directory


def build_setup(args: argparse.Namespace, methods: list[str]) -> Setup:
    import torch

    from specserve.engine import LLM
    from specserve.engine.config import DTYPES

    dtype = DTYPES[args.quantization_encoding]
    setup = Setup()
    # KV cache: one sequence of --max-length, or B of them for the throughput batch.
    kv_tokens = args.max_kv_cache_tokens or max(1, args.throughput_batch) * args.max_length
    common = dict(
        quantization_encoding=args.quantization_encoding,
        max_kv_cache_tokens=kv_tokens,
        max_length=args.max_length,
        num_speculative_tokens=args.k,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        cache_dir=args.cache_dir,
    )
    engines: dict[str, Any] = {}
    if SS_DRAFT in methods:
        engines["draft_model"] = LLM(
            args.model_path,
            draft_model_path=args.draft_model_path,
            draft_quantization_encoding=args.draft_quantization_encoding,
            speculative_method="draft_model",
            **common,
        )
        setup.runners[SS_DRAFT] = SpecserveRunner(engines["draft_model"], True)
    if SS_NGRAM in methods:
        engines["ngram"] = LLM(args.model_path, speculative_method="ngram", **common)
        setup.runners[SS_NGRAM] = SpecserveRunner(engines["ngram"], True)
    needs_plain = SS_PLAIN in methods or args.throughput_batch > 0
    if needs_plain:
        if engines and args.plain_engine == "shared":
            name, llm = next(iter(engines.items()))
            setup.notes[SS_PLAIN] = f"same engine as specserve:{name}, speculation off per request"
        else:
            llm = engines["none"] = LLM(args.model_path, speculative_method="none", **common)
            setup.notes[SS_PLAIN] = "own engine, --speculative-method none"
        plain = SpecserveRunner(llm, False)
        setup.plain_runner_for_throughput = plain
        if SS_PLAIN in methods:
            setup.runners[SS_PLAIN] = plain
    setup.tokenizer_llm = next(iter(engines.values()), None)

    hf_methods = [m for m in methods if m.startswith("transformers:")]
    if hf_methods:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        target_dir = _hf_dir(args.model_path, dtype, args.cache_dir)
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
        if setup.tokenizer_llm is None:
            from transformers import AutoTokenizer

            setup.hf_tokenizer = AutoTokenizer.from_pretrained(target_dir)
        if HF_PLAIN in methods:
            setup.runners[HF_PLAIN] = TransformersRunner(model, {})
        if HF_LOOKUP in methods:
            setup.runners[HF_LOOKUP] = TransformersRunner(model, {"prompt_lookup_num_tokens": args.k})
            setup.notes[HF_LOOKUP] = f"prompt_lookup_num_tokens={args.k}"
        if HF_ASSISTED in methods:
            draft_dir = _hf_dir(args.draft_model_path, dtype, args.cache_dir)
            assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
            if args.hf_num_assistant_tokens is not None:
                assistant.generation_config.num_assistant_tokens = args.hf_num_assistant_tokens
            if args.hf_assistant_schedule is not None:
                assistant.generation_config.num_assistant_tokens_schedule = args.hf_assistant_schedule
            g = assistant.generation_config
            setup.runners[HF_ASSISTED] = TransformersRunner(model, {"assistant_model": assistant})
            nat = getattr(g, "num_assistant_tokens", None)
            sched = getattr(g, "num_assistant_tokens_schedule", None)
            setup.notes[HF_ASSISTED] = (
                f"num_assistant_tokens={nat}, schedule={sched}"
                if nat is not None or sched is not None
                else "transformers' defaults for num_assistant_tokens and its schedule"
            )
    if LC_PLAIN in methods:
        gguf = llama_cpp_peer.target_gguf(args.model_path, args.cache_dir)
        if gguf is None:
            setup.unavailable[LC_PLAIN] = "the target is not loaded from a GGUF file"
        else:
            threads = args.threads or torch.get_num_threads()
            llm = llama_cpp_peer.load(gguf, threads, args.max_length)
            setup.runners[LC_PLAIN] = llama_cpp_peer.LlamaCppRunner(llm)
            setup.notes[LC_PLAIN] = f"{gguf.name} (its own quantized weights), {threads} threads"
    del torch
    return setup


def _max_length(setup: Setup) -> int:
    if setup.tokenizer_llm is not None:
        return setup.tokenizer_llm.engine.max_length
    for r in setup.runners.values():
        if isinstance(r, TransformersRunner):
            return int(getattr(r.model.config, "max_position_embeddings", 1 << 30))
    return 1 << 30


def encode(setup: Setup, prompt: Prompt) -> list[int]:
    if setup.tokenizer_llm is not None:
        return setup.tokenizer_llm.encode_prompt(prompt.messages)
    ids = setup.hf_tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def run_benchmark(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    if args.quick:
        args.prompts_per_category = args.prompts_per_category or 1
        args.max_new_tokens = 32 if args.max_new_tokens == 128 else args.max_new_tokens
        args.repeats = min(args.repeats, 2)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    methods = _select_methods(args)
    if not methods:
        raise SystemExit("specserve bench latency: no methods selected")
    categories = parse_categories(args.categories)
    prompts = load_prompts(categories, args.prompts_per_category)
    out_dir = Path(args.output_dir) if args.output_dir else default_output_dir("latency")
    out_dir.mkdir(parents=True, exist_ok=True)

    t_setup = time.perf_counter()
    setup = build_setup(args, methods)
    methods = [m for m in methods if m not in setup.unavailable]
    if not llama_cpp_peer.available():
        setup.unavailable[LC_PLAIN] = "llama_cpp not importable"
    setup_s = time.perf_counter() - t_setup
    encoded = [encode(setup, p) for p in prompts]
    limit = _max_length(setup)
    skipped = [
        p.id for p, ids in zip(prompts, encoded, strict=True) if len(ids) + args.max_new_tokens > limit
    ]
    if skipped:
        logger.warning(
            "skipping prompts longer than the model's max length %d: %s", limit, ", ".join(skipped)
        )
        keep = [i for i, p in enumerate(prompts) if p.id not in skipped]
        prompts, encoded = [prompts[i] for i in keep], [encoded[i] for i in keep]
    if not prompts:
        raise SystemExit("specserve bench latency: every prompt is longer than the model's max length")
    categories = [c for c in categories if any(p.category == c for p in prompts)]
    ignore_eos = not args.respect_eos

    total = len(methods) * args.warmup + args.repeats * len(prompts) * len(methods)
    total += args.repeats if args.throughput_batch > 0 else 0
    bar = progress(total, "bench latency", disable=args.no_progress)
    warm_tokens = min(args.max_new_tokens, 16)
    for m in methods:
        for _ in range(args.warmup):
            setup.runners[m].run(encoded[0], warm_tokens, ignore_eos)
            bar.update(1)

    runs: list[dict[str, Any]] = []
    results: dict[tuple[str, str, int], RunResult] = {}
    throughput_runs: list[dict[str, Any]] = []
    t_bench = time.perf_counter()
    for rep in range(args.repeats):
        for pi, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
            shift = (rep + pi) % len(methods)
            for m in methods[shift:] + methods[:shift]:  # rotate so no method always runs first
                bar.set_postfix_str(f"{m} {prompt.id}")
                res = setup.runners[m].run(ids, args.max_new_tokens, ignore_eos)
                results[(m, prompt.id, rep)] = res
                bar.update(1)
        if args.throughput_batch > 0:
            batch = [encoded[i % len(encoded)] for i in range(args.throughput_batch)]
            bar.set_postfix_str(f"specserve:plain batch {args.throughput_batch}")
            n, dt = setup.plain_runner_for_throughput.run_batch(batch, args.max_new_tokens, ignore_eos)
            throughput_runs.append(
                {
                    "repeat": rep,
                    "batch": args.throughput_batch,
                    "generated_tokens": n,
                    "elapsed_s": round(dt, 4),
                    "tokens_per_s": round(n / dt, 4),
                }
            )
            bar.update(1)
    bar.close()
    bench_s = time.perf_counter() - t_bench

    # Greedy identity: each method vs the plain run of its own engine family (same prompt, same repeat).
    by_id = {p.id: p for p in prompts}
    for (m, pid, rep), res in results.items():
        # llama.cpp runs other (quantized) weights: it has no plain of its own, only a cross check.
        ref = (
            None
            if m == LC_PLAIN
            else results.get((SS_PLAIN if m.startswith("specserve:") else HF_PLAIN, pid, rep))
        )
        cross = results.get((HF_PLAIN if m.startswith("specserve:") else SS_PLAIN, pid, rep))
        runs.append(
            {
                "method": m,
                "prompt_id": pid,
                "category": by_id[pid].category,
                "repeat": rep,
                "prompt_tokens": len(encoded[prompts.index(by_id[pid])]),
                "generated_tokens": len(res.token_ids),
                "elapsed_s": round(res.elapsed_s, 5),
                "first_token_s": st.round_or_none(res.first_token_s, 5),
                "tokens_per_s": st.round_or_none(res.tokens_per_s),
                "decode_tokens_per_s": st.round_or_none(res.decode_tokens_per_s),
                "target_steps": res.num_steps,
                "identical_to_plain": None if ref is None else res.token_ids == ref.token_ids,
                "common_prefix_with_plain": None
                if ref is None
                else st.common_prefix_len(res.token_ids, ref.token_ids),
                "identical_to_other_engine_plain": None
                if cross is None
                else res.token_ids == cross.token_ids,
                "spec": res.spec,
                "draft_s": st.round_or_none(res.draft_s, 5),
                "verify_s": st.round_or_none(res.verify_s, 5),
            }
        )

    summary = summarize(runs, methods, categories, args.metric)
    throughput = None
    if throughput_runs:
        batch1 = {
            r["repeat"]: [
                x["tokens_per_s"] for x in runs if x["method"] == SS_PLAIN and x["repeat"] == r["repeat"]
            ]
            for r in throughput_runs
        }
        ratios = [
            r["tokens_per_s"] / st.median(batch1[r["repeat"]])
            for r in throughput_runs
            if batch1[r["repeat"]] and st.median(batch1[r["repeat"]])
        ]
        throughput = {
            "batch": args.throughput_batch,
            "runs": throughput_runs,
            "median_batch_tokens_per_s": st.round_or_none(
                st.median(r["tokens_per_s"] for r in throughput_runs)
            ),
            "median_batch1_tokens_per_s": summary[SS_PLAIN]["overall"]["median_tokens_per_s"]
            if SS_PLAIN in summary
            else None,
            "ratio_vs_batch1": st.round_or_none(st.median(ratios)),
            "note": "total tokens/s of B prompts submitted together, over the median batch-1 specserve:plain "
            "tokens/s of the same repeat",
        }

    report = {
        "schema": SCHEMA,
        "created": now_iso(),
        "command": command_line("latency", argv),
        "machine": machine_info(),
        "config": {
            "model_path": args.model_path,
            "draft_model_path": args.draft_model_path,
            "quantization_encoding": args.quantization_encoding,
            "draft_quantization_encoding": args.draft_quantization_encoding,
            "max_new_tokens": args.max_new_tokens,
            "ignore_eos": ignore_eos,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "num_speculative_tokens": args.k,
            "ngram_min": args.ngram_min,
            "ngram_max": args.ngram_max,
            "categories": categories,
            "prompts_per_category": args.prompts_per_category,
            "metric": args.metric,
            "plain_engine": args.plain_engine,
            "quick": args.quick,
            "setup_s": round(setup_s, 2),
            "bench_s": round(bench_s, 2),
        },
        "methods": [{"name": m, "note": setup.notes.get(m)} for m in methods],
        "unavailable": setup.unavailable,
        "skipped_prompts": skipped,
        "prompts": [
            {"id": p.id, "category": p.category, "prompt_tokens": len(ids)}
            for p, ids in zip(prompts, encoded, strict=True)
        ],
        "summary": summary,
        "throughput": throughput,
        "runs": runs,
        "files": {},
    }
    write_outputs(report, out_dir, plots=not args.no_plots)
    return report


def _spec_totals(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    specs = [r["spec"] for r in rows if r["spec"]]
    if not specs:
        return None
    drafts = sum(s["num_drafts"] for s in specs)
    dtok = sum(s["num_draft_tokens"] for s in specs)
    acc = sum(s["num_accepted_tokens"] for s in specs)
    width = max((len(s["accepted_per_position"]) for s in specs), default=0)
    per_pos = [0] * width
    for s in specs:
        for i, a in enumerate(s["accepted_per_position"]):
            per_pos[i] += a
    return {
        "num_drafts": drafts,
        "num_draft_tokens": dtok,
        "num_accepted_tokens": acc,
        "acceptance_rate": round(acc / dtok, 4) if dtok else 0.0,
        "mean_acceptance_length": round(1 + acc / drafts, 4) if drafts else 1.0,
        "per_position_acceptance": [round(a / drafts, 4) for a in per_pos] if drafts else [],
    }


def _group_stats(
    rows: list[dict[str, Any]], base: dict[str, list[dict[str, Any]]], key: str
) -> dict[str, Any]:
    def tps(rs: list[dict[str, Any]], k: str) -> dict[tuple[str, int], float | None]:
        return {(r["prompt_id"], r["repeat"]): r[k] for r in rs}

    out: dict[str, Any] = {
        "n": len(rows),
        "median_tokens_per_s": st.round_or_none(st.median(r["tokens_per_s"] for r in rows)),
        "median_decode_tokens_per_s": st.round_or_none(st.median(r["decode_tokens_per_s"] for r in rows)),
        "median_first_token_s": st.round_or_none(st.median(r["first_token_s"] for r in rows), 5),
    }
    for name, ref_rows in base.items():
        out[f"speedup_vs_{name}"] = st.round_or_none(
            st.median_paired_ratio(tps(rows, key), tps(ref_rows, key))
        )
    ident = [r["identical_to_plain"] for r in rows if r["identical_to_plain"] is not None]
    out["greedy_identical_to_plain"] = all(ident) if ident else None
    out["identical_fraction"] = round(sum(ident) / len(ident), 4) if ident else None
    cross = [
        r["identical_to_other_engine_plain"] for r in rows if r["identical_to_other_engine_plain"] is not None
    ]
    out["identical_to_other_engine_plain_fraction"] = round(sum(cross) / len(cross), 4) if cross else None
    steps = [r["generated_tokens"] / r["target_steps"] for r in rows if r.get("target_steps")]
    out["tokens_per_target_step"] = st.round_or_none(st.mean(steps))
    spec = _spec_totals(rows)
    out["spec"] = spec
    draft = [r["draft_s"] for r in rows if r["draft_s"] is not None]
    verify = [r["verify_s"] for r in rows if r["verify_s"] is not None]
    out["draft_s"] = round(sum(draft), 4) if draft else None
    out["verify_s"] = round(sum(verify), 4) if verify else None
    total = sum(r["elapsed_s"] for r in rows)
    out["draft_fraction"] = round(sum(draft) / total, 4) if draft and total else None
    out["verify_fraction"] = round(sum(verify) / total, 4) if verify and total else None
    return out


def summarize(
    runs: list[dict[str, Any]], methods: list[str], categories: list[str], metric: str
) -> dict[str, Any]:
    key = "tokens_per_s" if metric == "e2e" else "decode_tokens_per_s"
    summary: dict[str, Any] = {}
    for m in methods:
        rows = [r for r in runs if r["method"] == m]
        base = {}
        for bname, bm in (("specserve_plain", SS_PLAIN), ("transformers_plain", HF_PLAIN)):
            if bm in methods:
                base[bname] = [r for r in runs if r["method"] == bm]
        overall = _group_stats(rows, base, key)
        by_cat = {}
        for c in categories:
            crow = [r for r in rows if r["category"] == c]
            if crow:
                by_cat[c] = _group_stats(
                    crow, {k: [r for r in v if r["category"] == c] for k, v in base.items()}, key
                )
        summary[m] = {"overall": overall, "by_category": by_cat}
    return summary


# --- outputs -------------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    cfg, summ = report["config"], report["summary"]
    methods = [m["name"] for m in report["methods"]]
    mach = report["machine"]
    lines = [
        "# specserve bench latency",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {mach.get('cpu_model')}, {mach.get('cpu_count')} CPUs, torch threads {mach.get('torch_threads')}, "
        f"{mach.get('memory_gib')} GiB; torch {mach.get('torch')}, transformers {mach.get('transformers')}. "
        f"{report['created']}.",
        "",
        f"Model `{cfg['model_path'] or 'embedded default'}`"
        + (f", draft `{cfg['draft_model_path']}`" if cfg["draft_model_path"] else "")
        + f", {cfg['quantization_encoding']}, batch 1 greedy, {cfg['max_new_tokens']} new tokens"
        f" ({'EOS ignored' if cfg['ignore_eos'] else 'stop at EOS'}), K={cfg['num_speculative_tokens']},"
        f" {cfg['repeats']} interleaved repeats after {cfg['warmup']} warm-up; headline metric: {cfg['metric']} tokens/s;"
        " speedups are medians of per-(prompt, repeat) ratios.",
        "",
    ]
    has_ss = "specserve_plain" if SS_PLAIN in methods else None
    has_hf = "transformers_plain" if HF_PLAIN in methods else None
    header = ["method", "tok/s", "decode tok/s", "TTFT s"]
    if has_ss:
        header.append("vs specserve plain")
    if has_hf:
        header.append("vs transformers plain")
    header += [
        "accept rate",
        "mean accept len",
        "draft s / verify s",
        "greedy = plain",
        "= other engine's plain",
    ]
    rows = []
    for m in methods:
        o = summ[m]["overall"]
        sp = o["spec"]
        row = [
            f"`{m}`",
            fmt(o["median_tokens_per_s"]),
            fmt(o["median_decode_tokens_per_s"]),
            fmt(o["median_first_token_s"], 3),
        ]
        if has_ss:
            row.append(fmt(o.get("speedup_vs_specserve_plain"), 2, "x"))
        if has_hf:
            row.append(fmt(o.get("speedup_vs_transformers_plain"), 2, "x"))
        row.append(fmt(sp["acceptance_rate"]) if sp else "–")
        mal = sp["mean_acceptance_length"] if sp else o.get("tokens_per_target_step")
        row.append(fmt(mal) + ("" if sp or mal is None else " (tok/step)"))
        row.append(f"{fmt(o['draft_s'])} / {fmt(o['verify_s'])}" if o["draft_s"] is not None else "–")
        ident = o["greedy_identical_to_plain"]
        row.append(
            "–"
            if ident is None
            else ("yes" if ident else f"no ({fmt(o['identical_fraction'] * 100, 0)}% of runs)")
        )
        cross = o.get("identical_to_other_engine_plain_fraction")
        row.append("–" if cross is None else f"{fmt(cross * 100, 0)}% of runs")
        rows.append(row)
    lines += [md_table(header, rows), ""]
    base = "specserve_plain" if has_ss else has_hf
    if base:
        cats = [
            c for c in report["config"]["categories"] if any(c in summ[m]["by_category"] for m in methods)
        ]
        rows = []
        for m in methods:
            bc = summ[m]["by_category"]
            rows.append([f"`{m}`"] + [fmt(bc.get(c, {}).get(f"speedup_vs_{base}"), 2, "x") for c in cats])
        lines += [
            f"Speedup vs {base.replace('_', ' ')} by category ({report['config']['metric']} tok/s):",
            "",
            md_table(["method", *cats], rows),
            "",
        ]
        if has_ss and has_hf:
            rows = [
                [f"`{m}`"]
                + [
                    fmt(summ[m]["by_category"].get(c, {}).get("speedup_vs_transformers_plain"), 2, "x")
                    for c in cats
                ]
                for m in methods
            ]
            lines += ["Speedup vs transformers plain by category:", "", md_table(["method", *cats], rows), ""]
    pos_rows = [
        [f"`{m}`", ", ".join(fmt(x) for x in summ[m]["overall"]["spec"]["per_position_acceptance"])]
        for m in methods
        if summ[m]["overall"]["spec"]
    ]
    if pos_rows:
        lines += [
            "Acceptance by draft position (fraction of verifications accepting position i):",
            "",
            md_table(["method", "positions 1..K"], pos_rows),
            "",
        ]
    tp = report.get("throughput")
    if tp:
        lines += [
            f"Throughput: {tp['batch']} prompts submitted together to specserve:plain: "
            f"{fmt(tp['median_batch_tokens_per_s'])} tok/s total vs {fmt(tp['median_batch1_tokens_per_s'])} tok/s "
            f"at batch 1 = **{fmt(tp['ratio_vs_batch1'])}x** (median of per-repeat ratios).",
            "",
        ]
    notes = [f"- `{m['name']}`: {m['note']}" for m in report["methods"] if m.get("note")]
    notes += [f"- {k}: not run ({v})" for k, v in report.get("unavailable", {}).items()]
    if notes:
        lines += ["Notes:", "", *notes, ""]
    for f in report["files"].get("plots", []):
        lines.append(f"![{Path(f).stem}]({Path(f).name})")
    return "\n".join(lines).rstrip() + "\n"


def plot(report: dict[str, Any], out_dir: Path) -> list[str]:
    plt = use_agg()
    if plt is None:
        logger.warning("matplotlib not installed: no plots (pip install matplotlib)")
        return []
    summ = report["summary"]
    methods = [m["name"] for m in report["methods"]]
    cats = [c for c in report["config"]["categories"] if any(c in summ[m]["by_category"] for m in methods)]
    files = []
    base = (
        "specserve_plain" if SS_PLAIN in methods else ("transformers_plain" if HF_PLAIN in methods else None)
    )
    if base:
        bases = [b for b in ("specserve_plain", "transformers_plain") if b.replace("_", ":") in methods]
        fig, axes = plt.subplots(len(bases), 1, figsize=(8, 2.6 * len(bases) + 0.6), squeeze=False)
        for ax, b in zip(axes[:, 0], bases, strict=True):
            shown = [m for m in methods if m != b.replace("_", ":")]
            width = 0.8 / max(1, len(shown))
            for i, m in enumerate(shown):
                vals = [summ[m]["by_category"].get(c, {}).get(f"speedup_vs_{b}") or 0 for c in cats]
                ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(cats))])
            ax.set_xticklabels(cats, fontsize=8)
            ax.set_ylabel(f"speedup vs\n{b.replace('_', ' ')}", fontsize=8)
            ax.tick_params(axis="y", labelsize=8)
            ax.legend(fontsize=7, ncol=3, loc="upper left")
        cfg = report["config"]
        fig.suptitle(
            f"{cfg['model_path'] or 'default model'} {cfg['quantization_encoding']}, batch 1 greedy, "
            f"{cfg['max_new_tokens']} tokens",
            fontsize=9,
        )
        fig.tight_layout()
        path = out_dir / "latency_speedup.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(str(path))
    spec_methods = [m for m in methods if summ[m]["overall"]["spec"]]
    if spec_methods:
        fig, ax = plt.subplots(figsize=(6, 3))
        for m in spec_methods:
            pp = summ[m]["overall"]["spec"]["per_position_acceptance"]
            ax.plot(range(1, len(pp) + 1), pp, marker="o", label=m)
        ax.set_xlabel("draft position", fontsize=8)
        ax.set_ylabel("accepted fraction", fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
        ax.set_title("acceptance by position", fontsize=9)
        fig.tight_layout()
        path = out_dir / "latency_acceptance.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(str(path))
    return files


def write_outputs(report: dict[str, Any], out_dir: Path, plots: bool = True) -> None:
    report["files"] = {
        "json": str(out_dir / "latency.json"),
        "markdown": str(out_dir / "latency.md"),
        "plots": plot(report, out_dir) if plots else [],
    }
    write_json(out_dir / "latency.json", report)
    (out_dir / "latency.md").write_text(markdown(report))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run_benchmark(args, argv)
    sys.stdout.write(markdown(report))
    print(f"\nwrote {report['files']['json']}", file=sys.stderr)
    return 0
