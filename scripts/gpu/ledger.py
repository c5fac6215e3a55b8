"""Issue 20 on a GPU: the adaptive controller against speculation off / static K=5, per concurrency.

No hub and no model files reach the device machine, so the models are random-weight bf16 decoders of
the Qwen2.5-Coder pair's shapes (1.5B target; 0.5B draft, independently initialised, so its drafts are
almost never accepted), with the tests' tiny BPE tokenizer. Neither proposer can win here (on the H200
the random target's greedy output seldom repeated, so n-gram lookup found few matches, and the
independent draft's tokens are rejected): what it measures is whether the adaptive policy keeps
speculation from costing on a GPU, what a step of each shape costs there, and that the CUDA path is
lossless (`smoke`: a tiny float32 target, greedy, speculation on against off, token for token).
One engine per method; every mode is a per-request setting on it (the step ledger's cells).

    python3 scripts/gpu/ledger.py            # on a CUDA machine; OUT=dir for the JSON
    TINY=1 python3 scripts/gpu/ledger.py     # a dry run with toy shapes on the CPU
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import build_tokenizer  # noqa: E402

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories  # noqa: E402
from specserve.benchmarks.step_ledger import _arms, ledger, run_cell  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
TINY = os.environ.get("TINY") == "1"  # a CPU dry run of this script with toy shapes
DEVICE = "cpu" if TINY else "gpu"
BUDGET = float(os.environ.get("BUDGET", "300"))  # seconds: no cell starts after this
START = time.perf_counter()
SHAPES = {  # Qwen2.5-Coder-1.5B / -0.5B
    "target": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "draft": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
}
if TINY:
    SHAPES = {
        "target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4),
        "draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    }
VOCAB = 2048 if TINY else 151936


def log(*a: object) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s]", *a, flush=True)


def build(directory: Path, role: str, seed: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=None,
        **SHAPES[role],
    )
    torch.manual_seed(seed)
    with torch.device("cuda" if not TINY else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    build_tokenizer(directory, vocab_size=320)
    del model


def engine_kwargs(method: str) -> dict:
    """The LLM settings every device engine here shares (bf16, 32 sequences, a 64k-token cache)."""
    return dict(
        devices=DEVICE,
        quantization_encoding="bfloat16",
        max_length=4096,
        max_kv_cache_tokens=65536,
        speculative_method=method,
        max_batch_size=32,
    )


def ngram_target_engine():
    """The random 1.5B-shaped target with n-gram speculation (steps.py, forward_shapes.py)."""
    from specserve.engine import LLM

    target = Path("/tmp/gpu-models/target")
    build(target, "target", 0)
    return LLM(str(target), **engine_kwargs("ngram"))


def smoke() -> dict:
    """The CUDA path's lossless check first: a tiny float32 target, greedy, speculation on (static K=4,
    n-gram and a noisy-copy draft) against off, token for token."""
    from tiny_models import build_tiny_model, mixed_prompts, perturb_weights

    from specserve.engine import LLM, SamplingParams

    tiny = Path("/tmp/gpu-models/tiny")
    model = build_tiny_model(tiny, "qwen2", seed=0)
    noisy = Path("/tmp/gpu-models/tiny-draft")
    perturb_weights(model, 0.04)
    model.save_pretrained(noisy)
    build_tokenizer(noisy, vocab_size=320)
    prompts = mixed_prompts(12)
    report = {}
    for method in ("ngram", "draft_model"):
        kwargs = dict(
            devices=DEVICE,
            quantization_encoding="float32",
            max_kv_cache_tokens=4096,
            speculative_method=method,
            speculative_policy="static",
            num_speculative_tokens=4,
        )
        if method == "draft_model":
            kwargs["draft_model_path"] = str(noisy)
        llm = LLM(str(tiny), **kwargs)
        base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        off = llm.generate(
            prompts,
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative_enabled=False),
            use_chat_template=False,
        )
        on = llm.generate(prompts, base, use_chat_template=False)
        same = sum(a.token_ids == b.token_ids for a, b in zip(off, on, strict=True))
        drafted = sum(o.spec.num_draft_tokens for o in on)
        accepted = sum(o.spec.num_accepted_tokens for o in on)
        report[method] = {"equal": f"{same}/{len(prompts)}", "drafted": drafted, "accepted": accepted}
        log("smoke", method, report[method])
        del llm
    return report


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    import traceback

    try:
        smoke_report = smoke()
    except Exception:
        traceback.print_exc()
        smoke_report = {"error": traceback.format_exc()}
    (OUT / "smoke.json").write_text(json.dumps(smoke_report, indent=1))
    work = Path("/tmp/gpu-models")
    target, draft = work / "target", work / "draft"
    build(target, "target", 0)
    build(draft, "draft", 1)
    log("models built")

    results: dict = {"cells": [], "curves": {}, "device": torch.cuda.get_device_name() if not TINY else "cpu"}
    methods = [m for m in os.environ.get("METHODS", "ngram,draft_model").split(",") if m]
    concurrencies = [int(c) for c in os.environ.get("CONC", "1,32,4,16").split(",")]
    for method in methods:
        try:
            run_method(method, results, target, draft, concurrencies)
        except Exception:
            traceback.print_exc()
            results.setdefault("errors", []).append(traceback.format_exc())
        (OUT / "gpu_ledger.json").write_text(json.dumps(results, indent=1, default=str))
    summary(results)


def run_method(method, results, target, draft, concurrencies) -> None:
    from specserve.engine import LLM

    kwargs = engine_kwargs(method)
    if method != "ngram":
        kwargs.update(draft_model_path=str(draft), draft_quantization_encoding="bfloat16")
    t0 = time.perf_counter()
    llm = LLM(str(target), **kwargs)
    log(method, "engine up in", round(time.perf_counter() - t0, 1), "s")
    prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories(None))]
    arms = _arms(["off", "static", "adaptive"], 5)
    for arm in arms:
        run_cell(llm, prompts[:1], arm.runner, concurrency=1, requests=1, max_tokens=8)
    cost = llm.engine.controller.cost
    results["curves"][method] = {
        "target": [[n, cost.curve(n)] for n in (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)],
        "draft_profile": repr(cost.draft_profile),
    }
    for c in concurrencies:
        for arm in arms[c % 3 :] + arms[: c % 3]:
            if time.perf_counter() - START > BUDGET:
                log("budget spent; skipping", method, c, arm.name)
                continue
            n = max(4, 2 * c)
            cell = run_cell(llm, prompts, arm.runner, c, n, 64)
            row = {
                "method": method,
                "concurrency": c,
                "mode": arm.name,
                "seconds": cell["seconds"],
                "tokens": cell["tokens"],
                "tok_s": cell["tokens"] / cell["seconds"],
                "ledger": ledger(cell["steps"]),
            }
            decode = [s for s in cell["steps"] if not s.prefill_tokens]
            row["mean_k"] = sum(s.draft_tokens for s in decode) / max(1, sum(s.num_sequences for s in decode))
            results["cells"].append(row)
            log(
                method,
                f"c={c}",
                arm.name,
                f"{row['tok_s']:.1f} tok/s",
                f"{cell['seconds']:.1f}s",
                f"mean k {row['mean_k']:.2f}",
            )
            (OUT / "gpu_ledger.json").write_text(json.dumps(results, indent=1, default=str))
    results["curves"][method]["target_after"] = [
        [n, cost.target_seconds(min(n, 32), n)] for n in (1, 2, 4, 8, 16, 32, 64, 128, 192)
    ]
    (OUT / "gpu_ledger.json").write_text(json.dumps(results, indent=1, default=str))
    del llm
    if not TINY:
        torch.cuda.empty_cache()


def summary(results) -> None:
    for r in results["cells"]:
        off = next(
            (
                o
                for o in results["cells"]
                if o["method"] == r["method"] and o["concurrency"] == r["concurrency"] and o["mode"] == "off"
            ),
            None,
        )
        if off:
            print(
                f"{r['method']:12s} c={r['concurrency']:3d} {r['mode']:9s} {r['tok_s']:8.1f} tok/s "
                f"{r['tok_s'] / off['tok_s']:.3f}x of off"
            )


if __name__ == "__main__":
    main()
