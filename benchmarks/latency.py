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

With --response-format json_object / json_schema every prompt also asks for JSON (response_format.py
hands out the schemas) and the specserve methods decode under that grammar; transformers and llama.cpp
cannot be constrained and are refused. The report then says per method how many outputs validate, how
many hit the length limit, how many tokens the grammar forced (free drafts) and what share of the
generation time the grammar matcher took.

Runs are interleaved (for each repeat, for each prompt, every method in a rotated order) after a warm-up,
so every speedup is a median of ratios between neighbouring measurements of the same prompt.
The run is: methods -> arms (`build_setup`) -> the harness's rounds (`measure`) -> rows and summary ->
latency.json / latency.md / plots (latency_report).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from specserve.engine.stats import per_position_acceptance

from . import harness, latency_report, llama_cpp_peer
from . import response_format as rf
from . import stats as st
from .common import progress
from .harness import Arm, add_output_args, envelope, keyed, output_dir, print_report, rounds, write_report
from .prompt_sets import CATEGORIES, Prompt, load_prompts, parse_categories
from .runners import (
    HF_ASSISTED,
    HF_LOOKUP,
    HF_PLAIN,
    LC_PLAIN,
    SS_DRAFT,
    SS_NGRAM,
    SS_PLAIN,
    RunResult,
    SpecserveRunner,
    TransformersRunner,
)

# /2: --response-format (config.response_format, per-run JSON validity and grammar time, summary "structured").
SCHEMA = "specserve.bench.latency/2"
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
# Speedups are taken against these arms, under these names (speedup_vs_<name>).
BASELINES = (("specserve_plain", SS_PLAIN), ("transformers_plain", HF_PLAIN))
logger = logging.getLogger("specserve.bench")


@dataclass
class Setup:
    """The arms to measure, plus what encodes prompts and what runs the throughput batch."""

    arms: dict[str, Arm[Any]] = field(default_factory=dict)
    tokenizer_llm: Any = None
    hf_tokenizer: Any = None
    plain_runner_for_throughput: SpecserveRunner | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why it did not run

    def add(self, name: str, runner: Any, note: str | None = None) -> None:
        self.arms[name] = Arm(name, runner, note)


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
        "--response-format",
        choices=rf.RESPONSE_FORMATS,
        default="text",
        help="json_object / json_schema: each prompt asks for JSON (a schema from prompts/json_schemas.json, "
        "cycled by prompt index) and specserve decodes under that grammar; specserve methods only",
    )
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
        dest="num_speculative_tokens",
        type=int,
        default=5,
        help="draft tokens per verification (specserve) and prompt_lookup_num_tokens (transformers)",
    )
    r.add_argument(
        "--speculative-policy",
        choices=("adaptive", "static"),
        default="adaptive",
        help="specserve's speculation policy (default adaptive, the engine default: the controller may "
        "draft nothing where drafting does not pay; static drafts --num-speculative-tokens every step)",
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
    add_output_args(p, "latency")
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
        out = list(ALL_METHODS)
    if not args.draft_model_path:
        dropped = [m for m in out if m in (SS_DRAFT, HF_ASSISTED)]
        if dropped and args.methods:
            raise SystemExit(f"specserve bench latency: {', '.join(dropped)} need --draft-model-path")
        out = [m for m in out if m not in (SS_DRAFT, HF_ASSISTED)]
    if LC_PLAIN in out and not llama_cpp_peer.available():
        if args.methods:
            raise SystemExit("specserve bench latency: llama.cpp:plain needs llama-cpp-python")
        out.remove(LC_PLAIN)
    if args.response_format != "text":
        unconstrained = [m for m in out if not m.startswith("specserve:")]
        if unconstrained and args.methods:
            _usage_error(
                f"{', '.join(unconstrained)} cannot constrain output: "
                f"--response-format {args.response_format} needs specserve methods only"
            )
        out = [m for m in out if m.startswith("specserve:")]
    return list(dict.fromkeys(out))


def _usage_error(message: str) -> NoReturn:
    harness.fail("specserve bench latency", message)


# --- arms ----------------------------------------------------------------------------------------------
def build_setup(args: argparse.Namespace, methods: list[str]) -> Setup:
    setup = Setup()
    _add_specserve_arms(setup, args, methods)
    if any(m.startswith("transformers:") for m in methods):
        _add_transformers_arms(setup, args, methods)
    if LC_PLAIN in methods:
        _add_llama_cpp_arm(setup, args)
    return setup


def _add_specserve_arms(setup: Setup, args: argparse.Namespace, methods: list[str]) -> None:
    from specserve.engine import LLM

    # KV cache: one sequence of --max-length, or B of them for the throughput batch.
    batch = max(1, args.throughput_batch)
    kv_tokens = args.max_kv_cache_tokens or batch * args.max_length
    common = dict(
        # At most B requests run at once here, so the controller's start-up cost profile need not go
        # to the default 32 x (K + 1) rows (SmolLM2-135M bf16 on 2 CPU cores: 67 s; a 1.5B target ~10x).
        max_batch_size=batch,
        quantization_encoding=args.quantization_encoding,
        max_kv_cache_tokens=kv_tokens,
        max_length=args.max_length,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_policy=args.speculative_policy,
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
        setup.add(SS_DRAFT, SpecserveRunner(engines["draft_model"], True))
    if SS_NGRAM in methods:
        engines["ngram"] = LLM(args.model_path, speculative_method="ngram", **common)
        setup.add(SS_NGRAM, SpecserveRunner(engines["ngram"], True))
    if SS_PLAIN in methods or args.throughput_batch > 0:
        if engines and args.plain_engine == "shared":
            name, llm = next(iter(engines.items()))
            note = f"same engine as specserve:{name}, speculation off per request"
        else:
            llm = engines["none"] = LLM(args.model_path, speculative_method="none", **common)
            note = "own engine, --speculative-method none"
        setup.plain_runner_for_throughput = SpecserveRunner(llm, False)
        if SS_PLAIN in methods:
            setup.add(SS_PLAIN, setup.plain_runner_for_throughput, note)
    setup.tokenizer_llm = next(iter(engines.values()), None)


def _hf_model(model_path: str | None, args: argparse.Namespace) -> tuple[Any, Path]:
    from transformers import AutoModelForCausalLM

    from specserve.engine.config import DTYPES
    from specserve.engine.models.loader import resolve_model

    dtype = DTYPES[args.quantization_encoding]
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    directory = resolve_model(model_path, dtype=dtype, cache_dir=cache_dir).directory
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval(), directory


def _add_transformers_arms(setup: Setup, args: argparse.Namespace, methods: list[str]) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    model, target_dir = _hf_model(args.model_path, args)
    if setup.tokenizer_llm is None:
        setup.hf_tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    if HF_PLAIN in methods:
        setup.add(HF_PLAIN, TransformersRunner(model, {}))
    if HF_LOOKUP in methods:
        lookup = TransformersRunner(model, {"prompt_lookup_num_tokens": args.num_speculative_tokens})
        setup.add(HF_LOOKUP, lookup, f"prompt_lookup_num_tokens={args.num_speculative_tokens}")
    if HF_ASSISTED in methods:
        assistant, _ = _hf_model(args.draft_model_path, args)
        g = assistant.generation_config
        if args.hf_num_assistant_tokens is not None:
            g.num_assistant_tokens = args.hf_num_assistant_tokens
        if args.hf_assistant_schedule is not None:
            g.num_assistant_tokens_schedule = args.hf_assistant_schedule
        nat = getattr(g, "num_assistant_tokens", None)
        sched = getattr(g, "num_assistant_tokens_schedule", None)
        note = (
            f"num_assistant_tokens={nat}, schedule={sched}"
            if nat is not None or sched is not None
            else "transformers' defaults for num_assistant_tokens and its schedule"
        )
        setup.add(HF_ASSISTED, TransformersRunner(model, {"assistant_model": assistant}), note)


def _add_llama_cpp_arm(setup: Setup, args: argparse.Namespace) -> None:
    import torch

    gguf = llama_cpp_peer.target_gguf(args.model_path, args.cache_dir)
    if gguf is None:
        setup.unavailable[LC_PLAIN] = "the target is not loaded from a GGUF file"
        return
    threads = args.threads or torch.get_num_threads()
    runner = llama_cpp_peer.LlamaCppRunner(llama_cpp_peer.load(gguf, threads, args.max_length))
    setup.add(LC_PLAIN, runner, f"{gguf.name} (its own quantized weights), {threads} threads")


# --- prompts ---------------------------------------------------------------------------------------------
def _max_length(setup: Setup) -> int:
    if setup.tokenizer_llm is not None:
        return setup.tokenizer_llm.engine.max_length
    for arm in setup.arms.values():
        if isinstance(arm.runner, TransformersRunner):
            return int(getattr(arm.runner.model.config, "max_position_embeddings", 1 << 30))
    return 1 << 30


def encode(setup: Setup, prompt: Prompt) -> list[int]:
    if setup.tokenizer_llm is not None:
        return setup.tokenizer_llm.encode_prompt(prompt.messages)
    ids = setup.hf_tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _encode_prompts(
    setup: Setup, prompts: list[Prompt], max_new_tokens: int
) -> tuple[list[tuple[Prompt, list[int]]], list[str]]:
    """(prompt, token ids) of every prompt that fits the model with its new tokens, and the ids skipped."""
    limit = _max_length(setup)
    encoded = [(p, encode(setup, p)) for p in prompts]
    skipped = [p.id for p, ids in encoded if len(ids) + max_new_tokens > limit]
    if skipped:
        logger.warning(
            "skipping prompts longer than the model's max length %d: %s", limit, ", ".join(skipped)
        )
    kept = [(p, ids) for p, ids in encoded if p.id not in skipped]
    if not kept:
        raise SystemExit("specserve bench latency: every prompt is longer than the model's max length")
    return kept, skipped


# --- measuring -------------------------------------------------------------------------------------------
@dataclass
class Measured:
    results: dict[tuple[str, str, int], RunResult]  # (method, prompt id, repeat) -> run, in run order
    throughput_runs: list[dict[str, Any]]
    bench_s: float


def _constrained(constraints: dict[str, rf.Constraint], prompt: Prompt) -> dict[str, Any]:
    """The runner's keyword for a prompt's constraint; none at all for text (only specserve's runner
    takes one, and the other runners only ever run text)."""
    c = constraints.get(prompt.id)
    return {"structured_output": c.structured_output()} if c else {}


def measure(
    args: argparse.Namespace,
    setup: Setup,
    methods: list[str],
    work: list[tuple[Prompt, list[int]]],
    constraints: dict[str, rf.Constraint],
) -> Measured:
    """Warm every arm up, then the harness's rounds: each repeat, each prompt, every method (rotated);
    the throughput batch closes each repeat. The warm-up is constrained like the timed runs, so the
    grammar tokenizer (built once per engine, 0.7-3.5 s) is ready before the first timed run."""
    ignore_eos = not args.respect_eos
    total = len(methods) * args.warmup + args.repeats * len(work) * len(methods)
    total += args.repeats if args.throughput_batch > 0 else 0
    bar = progress(total, "bench latency", disable=args.no_progress)
    arms = [setup.arms[m] for m in methods]
    warm_tokens = min(args.max_new_tokens, 16)
    for arm in arms:
        for _ in range(args.warmup):
            arm.runner.run(work[0][1], warm_tokens, ignore_eos, **_constrained(constraints, work[0][0]))
            bar.update(1)

    results: dict[tuple[str, str, int], RunResult] = {}
    throughput_runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for rnd in rounds(arms, work, args.repeats):
        prompt, ids = rnd.item
        for arm in rnd.arms:
            bar.set_postfix_str(f"{arm.name} {prompt.id}")
            results[(arm.name, prompt.id, rnd.repeat)] = arm.runner.run(
                ids, args.max_new_tokens, ignore_eos, **_constrained(constraints, prompt)
            )
            bar.update(1)
        if rnd.last_of_group and args.throughput_batch > 0:
            bar.set_postfix_str(f"specserve:plain batch {args.throughput_batch}")
            throughput_runs.append(_throughput_run(args, setup, work, constraints, rnd.repeat))
            bar.update(1)
    bar.close()
    return Measured(results, throughput_runs, time.perf_counter() - t0)


def _throughput_run(
    args: argparse.Namespace,
    setup: Setup,
    work: list[tuple[Prompt, list[int]]],
    constraints: dict[str, rf.Constraint],
    repeat: int,
) -> dict[str, Any]:
    assert setup.plain_runner_for_throughput is not None
    items = [work[i % len(work)] for i in range(args.throughput_batch)]
    batch = [ids for _, ids in items]
    so = [_constrained(constraints, p).get("structured_output") for p, _ in items] if constraints else None
    n, dt = setup.plain_runner_for_throughput.run_batch(batch, args.max_new_tokens, not args.respect_eos, so)
    return {
        "repeat": repeat,
        "batch": args.throughput_batch,
        "generated_tokens": n,
        "elapsed_s": round(dt, 4),
        "tokens_per_s": round(n / dt, 4),
    }


def run_rows(
    results: dict[tuple[str, str, int], RunResult],
    work: list[tuple[Prompt, list[int]]],
    constraints: dict[str, rf.Constraint] | None = None,
) -> list[dict[str, Any]]:
    """One JSON row per run, with greedy identity against the plain run of its own engine family (same
    prompt, same repeat) and of the other family; with a constraint, whether the output honours it."""
    constraints = constraints or {}
    prompts = {p.id: (p, len(ids)) for p, ids in work}
    rows = []
    for (m, pid, rep), res in results.items():
        own = SS_PLAIN if m.startswith("specserve:") else HF_PLAIN
        other = HF_PLAIN if m.startswith("specserve:") else SS_PLAIN
        # llama.cpp runs other (quantized) weights: it has no plain of its own, only a cross check.
        ref = None if m == LC_PLAIN else results.get((own, pid, rep))
        cross = results.get((other, pid, rep))
        prompt, prompt_tokens = prompts[pid]
        rows.append(
            {
                "method": m,
                "prompt_id": pid,
                "category": prompt.category,
                "repeat": rep,
                "prompt_tokens": prompt_tokens,
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
                "finish_reason": res.finish_reason,
                **_structured_fields(res, constraints.get(pid)),
            }
        )
    return rows


def _structured_fields(res: RunResult, constraint: rf.Constraint | None) -> dict[str, Any]:
    if constraint is None:
        return {}
    return {
        "schema_name": constraint.schema_name,
        "grammar_s": st.round_or_none(res.grammar_s, 5),
        "num_forced_tokens": res.spec["num_forced_tokens"] if res.spec else 0,
        "text": res.text,
        **rf.check(res.text or "", constraint, res.finish_reason),
    }


# --- summary -----------------------------------------------------------------------------------------------
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
    rate, length = st.acceptance(drafts, dtok, acc)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": dtok,
        "num_accepted_tokens": acc,
        "acceptance_rate": round(rate or 0.0, 4),
        "mean_acceptance_length": round(length or 1.0, 4),
        "per_position_acceptance": [round(a, 4) for a in per_position_acceptance(per_pos, drafts)],
    }


def _fraction(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def _group_stats(
    rows: list[dict[str, Any]], base: dict[str, list[dict[str, Any]]], key: str
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "n": len(rows),
        "median_tokens_per_s": st.round_or_none(st.median(r["tokens_per_s"] for r in rows)),
        "median_decode_tokens_per_s": st.round_or_none(st.median(r["decode_tokens_per_s"] for r in rows)),
        "median_first_token_s": st.round_or_none(st.median(r["first_token_s"] for r in rows), 5),
    }
    for name, ref_rows in base.items():
        pairs = st.compare(
            keyed(rows, key, "prompt_id", "repeat"), keyed(ref_rows, key, "prompt_id", "repeat")
        )
        out[f"speedup_vs_{name}"] = st.round_or_none(pairs.median)
    ident = [r["identical_to_plain"] for r in rows if r["identical_to_plain"] is not None]
    out["greedy_identical_to_plain"] = all(ident) if ident else None
    out["identical_fraction"] = _fraction(ident)
    cross = [
        r["identical_to_other_engine_plain"] for r in rows if r["identical_to_other_engine_plain"] is not None
    ]
    out["identical_to_other_engine_plain_fraction"] = _fraction(cross)
    steps = [r["generated_tokens"] / r["target_steps"] for r in rows if r.get("target_steps")]
    out["tokens_per_target_step"] = st.round_or_none(st.mean(steps))
    out["spec"] = _spec_totals(rows)
    draft = [r["draft_s"] for r in rows if r["draft_s"] is not None]
    verify = [r["verify_s"] for r in rows if r["verify_s"] is not None]
    out["draft_s"] = round(sum(draft), 4) if draft else None
    out["verify_s"] = round(sum(verify), 4) if verify else None
    total = sum(r["elapsed_s"] for r in rows)
    out["draft_fraction"] = round(sum(draft) / total, 4) if draft and total else None
    out["verify_fraction"] = round(sum(verify) / total, 4) if verify and total else None
    out["structured"] = _structured_stats(rows)
    return out


def _structured_stats(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Constrained runs only: how many outputs validate, hit the length limit, how many tokens the
    grammar forced per output, and the grammar matcher's share of the generation time."""
    rows = [r for r in rows if "json_valid" in r]
    if not rows:
        return None
    grammar = [r["grammar_s"] for r in rows if r["grammar_s"] is not None]
    total = sum(r["elapsed_s"] for r in rows)
    # Decode time (after the first token): a long prefill would otherwise dilute the matcher's share.
    decode = sum(r["elapsed_s"] - r["first_token_s"] for r in rows if r["first_token_s"] is not None)
    return {
        "n": len(rows),
        "valid_fraction": _fraction([r["json_valid"] for r in rows]),
        "parses_fraction": _fraction([r["json_parses"] for r in rows]),
        "num_hit_length": sum(r["hit_length"] for r in rows),
        "forced_tokens_per_output": st.round_or_none(st.mean(r["num_forced_tokens"] for r in rows)),
        "mean_generated_tokens": st.round_or_none(st.mean(r["generated_tokens"] for r in rows)),
        "grammar_s": round(sum(grammar), 4) if grammar else None,
        # The matcher's time over the whole requests' time (prefill included), and over decode time.
        "grammar_fraction": round(sum(grammar) / total, 4) if grammar and total else None,
        "grammar_decode_fraction": round(sum(grammar) / decode, 4) if grammar and decode > 0 else None,
    }


def summarize(
    runs: list[dict[str, Any]], methods: list[str], categories: list[str], metric: str
) -> dict[str, Any]:
    key = "tokens_per_s" if metric == "e2e" else "decode_tokens_per_s"
    base = {name: [r for r in runs if r["method"] == bm] for name, bm in BASELINES if bm in methods}
    summary: dict[str, Any] = {}
    for m in methods:
        rows = [r for r in runs if r["method"] == m]
        by_cat = {}
        for c in categories:
            crow = [r for r in rows if r["category"] == c]
            if crow:
                by_cat[c] = _group_stats(
                    crow, {k: [r for r in v if r["category"] == c] for k, v in base.items()}, key
                )
        summary[m] = {"overall": _group_stats(rows, base, key), "by_category": by_cat}
    return summary


def throughput_summary(
    args: argparse.Namespace,
    throughput_runs: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
) -> dict[str, Any] | None:
    """Batch-B tokens/s over the median batch-1 specserve:plain tokens/s of the same repeat."""
    if not throughput_runs:
        return None
    batch1 = {
        r["repeat"]: st.median(
            x["tokens_per_s"] for x in runs if x["method"] == SS_PLAIN and x["repeat"] == r["repeat"]
        )
        for r in throughput_runs
    }
    ratios = [r["tokens_per_s"] / batch1[r["repeat"]] for r in throughput_runs if batch1[r["repeat"]]]
    return {
        "batch": args.throughput_batch,
        "runs": throughput_runs,
        "median_batch_tokens_per_s": st.round_or_none(st.median(r["tokens_per_s"] for r in throughput_runs)),
        "median_batch1_tokens_per_s": summary[SS_PLAIN]["overall"]["median_tokens_per_s"]
        if SS_PLAIN in summary
        else None,
        "ratio_vs_batch1": st.round_or_none(st.median(ratios)),
        "note": "total tokens/s of B prompts submitted together, over the median batch-1 specserve:plain "
        "tokens/s of the same repeat",
    }


# --- the command ---------------------------------------------------------------------------------------------
def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.prompts_per_category = args.prompts_per_category or 1
        args.max_new_tokens = 32 if args.max_new_tokens == 128 else args.max_new_tokens
        args.repeats = min(args.repeats, 2)


def _config(
    args: argparse.Namespace, categories: list[str], setup_s: float, bench_s: float
) -> dict[str, Any]:
    return {
        "model_path": args.model_path,
        "draft_model_path": args.draft_model_path,
        "quantization_encoding": args.quantization_encoding,
        "draft_quantization_encoding": args.draft_quantization_encoding,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": not args.respect_eos,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_policy": args.speculative_policy,
        "ngram_min": args.ngram_min,
        "ngram_max": args.ngram_max,
        "categories": categories,
        "prompts_per_category": args.prompts_per_category,
        "response_format": args.response_format,
        "metric": args.metric,
        "plain_engine": args.plain_engine,
        "quick": args.quick,
        "setup_s": round(setup_s, 2),
        "bench_s": round(bench_s, 2),
    }


def run_benchmark(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    _apply_quick(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    methods = _select_methods(args)
    if not methods:
        raise SystemExit("specserve bench latency: no methods selected")
    if args.response_format != "text" and importlib.util.find_spec("jsonschema") is None:
        _usage_error(f"--response-format {args.response_format} needs jsonschema (pip install jsonschema)")
    categories = parse_categories(args.categories)
    prompts = load_prompts(categories, args.prompts_per_category)
    constraints = rf.assign(prompts, args.response_format)
    prompts = [rf.with_instruction(p, constraints.get(p.id)) for p in prompts]
    out_dir = output_dir(args, "latency")

    t_setup = time.perf_counter()
    setup = build_setup(args, methods)
    methods = [m for m in methods if m not in setup.unavailable]
    if not llama_cpp_peer.available():
        setup.unavailable[LC_PLAIN] = "llama_cpp not importable"
    if args.response_format != "text":
        why = f"cannot constrain output (--response-format {args.response_format})"
        for m in (HF_PLAIN, HF_LOOKUP, *([HF_ASSISTED] if args.draft_model_path else []), LC_PLAIN):
            setup.unavailable.setdefault(m, why)
    setup_s = time.perf_counter() - t_setup
    work, skipped = _encode_prompts(setup, prompts, args.max_new_tokens)
    categories = [c for c in categories if any(p.category == c for p, _ in work)]

    measured = measure(args, setup, methods, work, constraints)
    runs = run_rows(measured.results, work, constraints)
    summary = summarize(runs, methods, categories, args.metric)
    report = {
        **envelope(SCHEMA, "latency", argv),
        "config": _config(args, categories, setup_s, measured.bench_s),
        "methods": [{"name": m, "note": setup.arms[m].note} for m in methods],
        "unavailable": setup.unavailable,
        "skipped_prompts": skipped,
        "prompts": [
            {
                "id": p.id,
                "category": p.category,
                "prompt_tokens": len(ids),
                **({"schema_name": constraints[p.id].schema_name} if p.id in constraints else {}),
            }
            for p, ids in work
        ],
        "summary": summary,
        "throughput": throughput_summary(args, measured.throughput_runs, runs, summary),
        "runs": runs,
        "files": {},
    }
    write_report(report, out_dir, "latency", latency_report.markdown, latency_report.plot, not args.no_plots)
    return report


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run_benchmark(args, argv)
    print_report(report, latency_report.markdown)
    return 0
