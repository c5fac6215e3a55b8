"""Decode speed of quantized targets and drafts, side by side in one run.

    python -m specserve.benchmarks.bench_quantization [--repeats 2] [--max-tokens 128]

Runs, interleaved per repeat (the order rotates so slow drift in a shared machine spreads evenly):
  bf16 target plain | bf16 target + 0.5B draft in bf16 / int8 / int4 (draft_model speculation) |
  int8 / int4 target plain | int4 target + int4 draft | llama.cpp on the target's GGUF (only when
  `llama_cpp` is importable and the GGUF is found).
`--mode steps` (part of the default `both`) times single model forwards instead, interleaved and
many times over, taking the median: target at M=1 (plain decode) and M=k+1 (a verification window),
draft at M=1 (one draft step), for each encoding, and estimates speculative tok/s from them as
mean_accepted_len / (k * draft_step + verify) with the acceptance measured end to end. On a shared
machine these per-forward figures are far less noisy than whole runs.
Greedy, one code prompt with the chat template. Decode tokens/s = (tokens - 1) / (elapsed - first
token). Only one engine is alive at a time (the 1.5B target is 3 GB in bf16), so each run pays its
own load and quantization, which is not timed. Prints JSON, then a Markdown table with ratios to the
bf16 plain decode.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import llama_cpp_peer
from . import stats as st
from .common import write_json
from .harness import rounds

TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
DRAFT = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
CODE_PROMPT = (
    "Write a Python function `top_k_frequent(words: list[str], k: int) -> list[str]` that returns the k"
    " most frequent words, ties broken alphabetically. Include type hints, a docstring and a few"
    " doctest examples, then explain its time complexity."
)


@dataclass(frozen=True)
class RunConfig:
    name: str
    target_encoding: str
    draft_encoding: str | None = None  # None: no speculation
    llama_cpp: bool = False


CONFIGS = [
    RunConfig("bf16 plain", "bfloat16"),
    RunConfig("bf16 + bf16 draft", "bfloat16", "bfloat16"),
    RunConfig("bf16 + int8 draft", "bfloat16", "int8"),
    RunConfig("bf16 + int4 draft", "bfloat16", "int4"),
    RunConfig("int8 plain", "int8"),
    RunConfig("int4 plain", "int4"),
    RunConfig("int4 + int4 draft", "int4", "int4"),
]
LLAMA_CPP = RunConfig("llama.cpp plain", "gguf", llama_cpp=True)


@dataclass
class RunResult:
    config: str
    repeat: int
    num_tokens: int
    decode_tok_s: float
    ttft_s: float
    load_s: float
    acceptance_rate: float | None
    mean_accepted_len: float | None
    token_ids: list[int]
    k: int | None = None  # draft tokens per verification, for speculative configs


def _decode_tok_s(num_tokens: int, elapsed_s: float, first_token_s: float | None) -> float:
    """Tokens after the first over the time after the first: the prompt's prefill is not decode."""
    return (num_tokens - 1) / max(elapsed_s - (first_token_s or 0.0), 1e-9)


def run_engine(cfg: RunConfig, args: argparse.Namespace, repeat: int) -> RunResult:
    from specserve.engine import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "quantization_encoding": cfg.target_encoding,
        "max_kv_cache_tokens": 2048,  # fixed and small: the same KV pool for every config
        "max_length": 1024,
        "cache_dir": args.cache_dir,
        "speculative_method": "none",
    }
    if cfg.draft_encoding:
        kwargs.update(
            speculative_method="draft_model",
            draft_model_path=args.draft,
            draft_quantization_encoding=cfg.draft_encoding,
            # This benchmark measures the kernels at a fixed k (the static policy's default for the
            # target encoding); the adaptive controller has its own benchmark (bench_spec_policy).
            speculative_policy="static",
        )
        if args.num_speculative_tokens is not None:  # else the engine's default for the target encoding
            kwargs["num_speculative_tokens"] = args.num_speculative_tokens
    t0 = time.perf_counter()
    llm = LLM(args.target, **kwargs)
    llm.generate(CODE_PROMPT, SamplingParams(max_tokens=4, temperature=0))  # warm-up: first-call costs
    load_s = time.perf_counter() - t0
    out = llm.generate(CODE_PROMPT, SamplingParams(max_tokens=args.max_tokens, temperature=0))[0]
    k_used = llm.engine.config.num_speculative_tokens
    del llm
    gc.collect()
    n, spec = len(out.token_ids), out.spec
    rate, mal = st.acceptance(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    tok_s = _decode_tok_s(n, out.elapsed_s, out.first_token_s)
    k = k_used if cfg.draft_encoding else None
    return RunResult(
        cfg.name, repeat, n, tok_s, out.first_token_s or 0.0, load_s, rate, mal, out.token_ids, k
    )


def run_llama_cpp(args: argparse.Namespace, repeat: int, gguf: Path) -> RunResult:  # pragma: no cover
    """llama.cpp on the target's GGUF, from the same chat-templated prompt ids our engine sees."""
    import torch

    from specserve.engine.models.loader import resolve_model
    from specserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.target, cache_dir=args.cache_dir).directory)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": CODE_PROMPT}])
    t0 = time.perf_counter()
    llm = llama_cpp_peer.load(gguf, torch.get_num_threads(), n_ctx=1024)
    runner = llama_cpp_peer.LlamaCppRunner(llm)
    runner.run(ids, 4, ignore_eos=False)  # warm-up, as for the engine runs
    load_s = time.perf_counter() - t0
    out = runner.run(ids, args.max_tokens, ignore_eos=False)
    del runner, llm
    gc.collect()
    n, tok_s = len(out.token_ids), _decode_tok_s(len(out.token_ids), out.elapsed_s, out.first_token_s)
    return RunResult(
        LLAMA_CPP.name, repeat, n, tok_s, out.first_token_s or 0.0, load_s, None, None, out.token_ids
    )


@dataclass
class StepModel:
    name: str
    model: Any  # CausalDecoder
    kv: Any  # KVCache
    role: str  # "target" or "draft"


def _load_step_model(
    path: str, encoding: str, cache_dir: str | None, ctx: int, block: int
) -> tuple[Any, Any]:
    import torch

    from specserve.engine.builder import load_model
    from specserve.engine.config import ModelSpec
    from specserve.engine.runner import SequenceInput, forward_sequences

    model = load_model(ModelSpec(model_path=path, quantization_encoding=encoding), cache_dir).model
    kv = model.allocate_kv_cache(ctx + 64, torch.bfloat16, "cpu")
    blocks = list(range((ctx + 64) // block))
    # Fill `ctx` positions once so every timed forward attends over a realistic context.
    forward_sequences(model, kv, [SequenceInput(list(range(100, 100 + ctx)), 0, blocks, 1)], block)
    return model, kv


def measure_step_costs(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median seconds of one forward + logits, per model variant and window size M."""
    import torch
    from tqdm import tqdm

    from specserve.engine.runner import SequenceInput, forward_sequences

    ctx, block, k = 256, 16, args.num_speculative_tokens or 5
    models = []
    for enc in ("bfloat16", "int8", "int4"):
        models.append(
            StepModel(
                f"target {enc}", *_load_step_model(args.target, enc, args.cache_dir, ctx, block), "target"
            )
        )
        models.append(
            StepModel(f"draft {enc}", *_load_step_model(args.draft, enc, args.cache_dir, ctx, block), "draft")
        )
    blocks = list(range((ctx + 64) // block))
    cases = [(m, 1) for m in models] + [(m, k + 1) for m in models if m.role == "target"]
    times: dict[tuple[str, int], list[float]] = {(m.name, n): [] for m, n in cases}
    for _ in tqdm(range(args.step_reps), desc="step costs"):
        for m, n in cases:  # interleaved: contention hits every case alike
            seq = SequenceInput(list(range(500, 500 + n)), ctx, blocks, n)
            t0 = time.perf_counter()
            with torch.inference_mode():
                m.model.compute_logits(forward_sequences(m.model, m.kv, [seq], block))
            times[(m.name, n)].append(time.perf_counter() - t0)
    out: dict[str, dict[str, float]] = {}
    for (name, n), ts in times.items():
        out.setdefault(name, {})[f"M={n}"] = st.median(ts[2:])  # first reps: warm-up
    return out


def estimate_spec(
    costs: dict[str, dict[str, float]], summary: dict[str, dict[str, Any]], k: int
) -> dict[str, Any]:
    """tok/s from step costs: plain = 1 / target(M=1); speculative = E[tokens per cycle] / cycle time."""
    est: dict[str, Any] = {}
    base = 1 / costs["target bfloat16"]["M=1"]
    for enc in ("bfloat16", "int8", "int4"):
        est[f"{enc} target plain"] = {"tok_s": 1 / costs[f"target {enc}"]["M=1"]}
    pairs = [
        ("bf16 + bf16 draft", "bfloat16", "bfloat16"),
        ("bf16 + int8 draft", "bfloat16", "int8"),
        ("bf16 + int4 draft", "bfloat16", "int4"),
        ("int4 + int4 draft", "int4", "int4"),
    ]
    for name, t_enc, d_enc in pairs:
        mal = summary.get(name, {}).get("mean_accepted_len")
        if mal is None:
            continue
        cycle = k * costs[f"draft {d_enc}"]["M=1"] + costs[f"target {t_enc}"][f"M={k + 1}"]
        est[name] = {"tok_s": mal / cycle, "mean_accepted_len": mal, "cycle_s": cycle}
    for row in est.values():
        row["x_bf16_plain"] = row["tok_s"] / base
    return est


def summarize(results: list[RunResult], names: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    configs = {c.name: c for c in [*CONFIGS, LLAMA_CPP]}
    first_tokens = {}  # config name -> token ids of its first repeat
    for r in results:
        first_tokens.setdefault(r.config, r.token_ids)
    base_tokens = first_tokens.get("bf16 plain")
    for name in names:
        runs = [r for r in results if r.config == name]
        if not runs:
            continue
        tok_s = [r.decode_tok_s for r in runs]
        rates = [r.acceptance_rate for r in runs if r.acceptance_rate is not None]
        mals = [r.mean_accepted_len for r in runs if r.mean_accepted_len is not None]
        summary[name] = {
            "decode_tok_s_median": st.median(tok_s),
            "decode_tok_s": tok_s,
            "num_tokens": runs[0].num_tokens,
            "acceptance_rate": st.mean(rates),
            "mean_accepted_len": st.mean(mals),
            "load_s_median": st.median(r.load_s for r in runs),
            "k": runs[0].k,
            "same_tokens_as_bf16_plain": runs[0].token_ids == base_tokens if base_tokens else None,
            # Speculation is lossless w.r.t. its target: the plain run of the same target encoding.
            "same_tokens_as_own_plain": _same_as_own_plain(
                configs.get(name), runs[0].token_ids, first_tokens
            ),
        }
    # Ratios of medians: each run loads its own engine, so runs are minutes apart and not pairs.
    base = summary.get("bf16 plain", {}).get("decode_tok_s_median")
    peer = summary.get(LLAMA_CPP.name, {}).get("decode_tok_s_median")
    for row in summary.values():
        row["speedup_vs_bf16_plain"] = row["decode_tok_s_median"] / base if base else None
        row["speedup_vs_llama_cpp"] = row["decode_tok_s_median"] / peer if peer else None
    return summary


def _same_as_own_plain(
    cfg: RunConfig | None, token_ids: list[int], first_tokens: dict[str, list[int]]
) -> bool | None:
    if cfg is None or cfg.draft_encoding is None or cfg.llama_cpp:
        return None
    plain = next(
        (c.name for c in CONFIGS if c.target_encoding == cfg.target_encoding and not c.draft_encoding), None
    )
    return token_ids == first_tokens[plain] if plain in first_tokens else None


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        "| config | K | decode tok/s (median) | x bf16 plain | x llama.cpp | acceptance | mean accepted len"
        " | same tokens as bf16 plain | same tokens as own plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, r in summary.items():
        lines.append(
            f"| {name} | {fmt(r.get('k'), '')} | {r['decode_tok_s_median']:.2f}"
            f" | {fmt(r['speedup_vs_bf16_plain'], '.2f')}"
            f" | {fmt(r.get('speedup_vs_llama_cpp'), '.2f')}"
            f" | {fmt(r['acceptance_rate'], '.2f')} | {fmt(r['mean_accepted_len'], '.2f')}"
            f" | {fmt(r['same_tokens_as_bf16_plain'], '')} | {fmt(r.get('same_tokens_as_own_plain'), '')} |"
        )
    return "\n".join(lines)


def markdown_steps(costs: dict[str, dict[str, float]], est: dict[str, Any], k: int) -> str:
    lines = [f"| model | M=1 ms | M={k + 1} ms |", "|---|---:|---:|"]
    for name, row in costs.items():
        big = row.get(f"M={k + 1}")
        lines.append(f"| {name} | {row['M=1'] * 1e3:.1f} | {'-' if big is None else f'{big * 1e3:.1f}'} |")
    lines += [
        "",
        "| estimate from step costs | tok/s | x bf16 plain | mean accepted len |",
        "|---|---:|---:|---:|",
    ]
    for name, row in est.items():
        mal = row.get("mean_accepted_len")
        lines.append(
            f"| {name} | {row['tok_s']:.2f} | {row['x_bf16_plain']:.2f} | {'-' if mal is None else f'{mal:.2f}'} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--draft", default=DRAFT)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K for every speculative config (default: the engine's, 5 for bf16 and 3 for int4 targets;"
        " 5 in steps mode)",
    )
    parser.add_argument("--configs", default="all", help="comma-separated config names, or all")
    parser.add_argument("--cache-dir", default=os.environ.get("SPECSERVE_CACHE_DIR"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (llama.cpp uses as many)")
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: the carrier's)")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--mode", choices=["both", "e2e", "steps"], default="both")
    parser.add_argument("--step-reps", type=int, default=12, help="timed forwards per case (steps mode)")
    parser.add_argument(
        "--acceptance-from", type=Path, default=None, help="an earlier --json-out to take acceptance from"
    )
    return parser


def select_configs(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[RunConfig], Path | None]:
    """The arms --configs names, with llama.cpp only where it can run; and the GGUF it would run."""
    known = [c.name for c in [*CONFIGS, LLAMA_CPP]]
    wanted = known if args.configs == "all" else [n.strip() for n in args.configs.split(",")]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        parser.error(f"unknown config {unknown[0]!r}; choose from: {', '.join(known)}")
    configs = [c for c in CONFIGS if c.name in wanted]
    gguf = args.gguf or llama_cpp_peer.target_gguf(args.target, args.cache_dir)
    if not llama_cpp_peer.available():
        print("llama_cpp not importable: llama.cpp comparison skipped", file=sys.stderr)
    elif gguf is None:
        print(f"{args.target} is not a GGUF model: llama.cpp comparison skipped", file=sys.stderr)
    elif LLAMA_CPP.name in wanted:
        configs = [*configs, LLAMA_CPP]
    return configs, gguf


def run_e2e(args: argparse.Namespace, configs: list[RunConfig], gguf: Path | None) -> list[RunResult]:
    """The harness's rounds: each repeat runs every config once, in an order rotated by the repeat."""
    from tqdm import tqdm

    results: list[RunResult] = []
    with tqdm(total=args.repeats * len(configs), desc="runs") as bar:
        for rnd in rounds(configs, [CODE_PROMPT], args.repeats):  # one prompt: a round per repeat
            for cfg in rnd.arms:
                bar.set_postfix_str(cfg.name)
                if cfg.llama_cpp:
                    assert gguf is not None  # select_configs only adds llama.cpp with a GGUF
                    res = run_llama_cpp(args, rnd.repeat, gguf)
                else:
                    res = run_engine(cfg, args, rnd.repeat)
                results.append(res)
                tqdm.write(
                    f"  rep {rnd.repeat} {cfg.name}: {res.decode_tok_s:.2f} tok/s ({res.num_tokens} tokens)"
                )
                bar.update()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    configs, gguf = select_configs(args, parser)
    k = args.num_speculative_tokens or 5
    report: dict[str, Any] = {
        "target": args.target,
        "draft": args.draft,
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "repeats": args.repeats,
    }
    summary: dict[str, dict[str, Any]] = {}
    if args.mode in ("both", "e2e"):
        results = run_e2e(args, configs, gguf)
        summary = summarize(results, [c.name for c in configs])
        report["summary"] = summary
        report["runs"] = [{f: v for f, v in asdict(r).items() if f != "token_ids"} for r in results]
    elif args.acceptance_from:
        summary = json.loads(args.acceptance_from.read_text()).get("summary", {})
    if args.mode in ("both", "steps"):
        costs = measure_step_costs(args)
        report["step_costs_s"] = costs
        report["step_estimates"] = estimate_spec(costs, summary, k)
    print(json.dumps(report, indent=2))
    if args.json_out:
        write_json(args.json_out, report)
    if summary and "runs" in report:
        print()
        print(markdown(summary))
    if "step_costs_s" in report:
        print()
        print(markdown_steps(report["step_costs_s"], report["step_estimates"], k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
