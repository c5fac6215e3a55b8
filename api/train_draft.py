"""`specserve train-draft`: train a draft head on the target's hidden states, on the CPU.

--method medusa trains Medusa-1 heads (plugins/medusa_training.py) into the FasterDecoding layout that
`--speculative-method medusa --medusa-heads-path DIR` loads. --method eagle trains an EAGLE-1 head
(plugins/eagle_training.py) into the published EAGLE layout that `--speculative-method eagle
--speculative-head-path DIR` loads. Flags of the other method (--num-heads, --num-layers,
--projection-lr for medusa; --unroll, --noise, --eval-positions for eagle) are an error, not ignored.
Bad input is one error line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .settings import CliError, OneLineArgumentParser

METHODS = ("medusa", "eagle")
PRECISIONS = ("float32", "bfloat16")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="specserve train-draft",
        description=(
            "Train a draft head on the target's own hidden states (CPU). --method medusa writes Medusa-1 "
            "heads for --speculative-method medusa --medusa-heads-path DIR; --method eagle writes an "
            "EAGLE-1 head for --speculative-method eagle --speculative-head-path DIR."
        ),
    )
    p.add_argument("--method", required=True, help="medusa or eagle")
    p.add_argument(
        "--model-path", default=None, help="the target: hub id, HF directory or .gguf (default: SmolLM2-135M)"
    )
    p.add_argument(
        "--output", default=None, help="directory for the head, its checkpoint and train_report.json"
    )
    p.add_argument("--num-heads", type=int, default=None, help="medusa: draft positions (default: 4)")
    p.add_argument("--num-layers", type=int, default=None, help="medusa: ResBlocks per head (default: 1)")
    p.add_argument(
        "--unroll",
        type=int,
        default=None,
        help="eagle: draft steps trained on the head's own predictions fed back (default: 2)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=None,
        help="eagle: uniform input-feature noise, relative to the features' RMS (default: 0)",
    )
    p.add_argument(
        "--eval-positions",
        type=int,
        default=None,
        help="eagle: draft positions of the held-out chain (default: 5)",
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="project onto the N most frequent target tokens of the training data (FR-Spec; default: all)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall budget of this run, data building included (distillation takes at most half of it)",
    )
    p.add_argument(
        "--max-steps", type=int, default=None, help="optimizer steps in all (resumed runs included)"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from DIR/checkpoint (data, heads, optimizer, step)"
    )
    p.add_argument(
        "--data-from",
        default=None,
        metavar="DIR",
        help="train on the data set an earlier run (--output DIR) built for this target: no distillation",
    )
    p.add_argument(
        "--distill-prompts", type=int, default=None, help="add the target's answers to N prompts (default: 0)"
    )
    p.add_argument(
        "--distill-max-tokens", type=int, default=128, help="tokens per distilled answer (default: 128)"
    )
    p.add_argument(
        "--code-tokens", type=int, default=None, help="stdlib source tokens to train on (default: 24000)"
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per code sequence (default: 256)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="AdamW learning rate (medusa: of the ResBlocks, default 3e-3; eagle: default 1e-3)",
    )
    p.add_argument(
        "--projection-lr",
        type=float,
        default=None,
        help="medusa: learning rate of the vocabulary projections (default: --lr / 10; 0 freezes them)",
    )
    p.add_argument(
        "--eval-every", type=int, default=20, help="held-out evaluation every N steps (default: 20)"
    )
    p.add_argument(
        "--quantization-encoding",
        default="float32",
        help="the target's encoding for features and distillation: float32 (default) or bfloat16",
    )
    p.add_argument(
        "--precision",
        default="float32",
        help="head matmuls: float32 (default) or bfloat16 (autocast; pays only on CPUs with native bf16)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the CPU quota's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="model cache (default: ~/.cache/specserve)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


MEDUSA_ONLY = ("num_heads", "num_layers", "projection_lr")
EAGLE_ONLY = ("unroll", "noise", "eval_positions")


def parse_config(argv: list[str]):
    """argv -> MedusaTrainConfig or EagleTrainConfig; any bad value is a CliError (one line)."""
    args = build_parser().parse_args(argv)
    if args.method not in METHODS:
        raise CliError(f"--method must be one of {', '.join(METHODS)}, not {args.method!r}")
    other = EAGLE_ONLY if args.method == "medusa" else MEDUSA_ONLY
    given = [f"--{k.replace('_', '-')}" for k in other if getattr(args, k) is not None]
    if given:
        raise CliError(f"{', '.join(given)}: not a --method {args.method} option")
    if not args.output:
        raise CliError("--output DIR is required (see specserve train-draft --help)")
    if args.method == "eagle":
        return _eagle_config(args), args.threads
    args.num_heads = 4 if args.num_heads is None else args.num_heads
    args.num_layers = 1 if args.num_layers is None else args.num_layers
    args.lr = 3e-3 if args.lr is None else args.lr
    _check_common(args)
    checks = [
        (1 <= args.num_heads <= 16, "--num-heads must be in [1, 16]"),
        (1 <= args.num_layers <= 8, "--num-layers must be in [1, 8]"),
        (args.seq_len >= args.num_heads + 2, "--seq-len must exceed --num-heads + 1"),
        (args.projection_lr is None or args.projection_lr >= 0, "--projection-lr must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise CliError(message)
    from specserve.plugins.medusa_training import MedusaTrainConfig

    config = MedusaTrainConfig(
        output=Path(args.output),
        model_path=args.model_path,
        quantization_encoding=args.quantization_encoding,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        draft_vocab_size=args.draft_vocab_size,
        max_minutes=args.max_minutes,
        max_steps=args.max_steps,
        resume=args.resume,
        data_from=None if args.data_from is None else Path(args.data_from),
        distill_prompts=args.distill_prompts,
        distill_max_tokens=args.distill_max_tokens,
        code_tokens=args.code_tokens,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        projection_lr=args.projection_lr,
        eval_every=args.eval_every,
        precision=args.precision,
        seed=args.seed,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
    )
    return config, args.threads


def _eagle_config(args):
    args.lr = 1e-3 if args.lr is None else args.lr
    args.unroll = 2 if args.unroll is None else args.unroll
    args.noise = 0.0 if args.noise is None else args.noise
    args.eval_positions = 5 if args.eval_positions is None else args.eval_positions
    _check_common(args)
    checks = [
        (1 <= args.unroll <= 8, "--unroll must be in [1, 8]"),
        (0 <= args.noise <= 1, "--noise must be in [0, 1]"),
        (1 <= args.eval_positions <= 16, "--eval-positions must be in [1, 16]"),
        (args.seq_len >= args.eval_positions + 2, "--seq-len must exceed --eval-positions + 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise CliError(message)
    from specserve.plugins.eagle_training import EagleTrainConfig

    return EagleTrainConfig(
        output=Path(args.output),
        model_path=args.model_path,
        quantization_encoding=args.quantization_encoding,
        draft_vocab_size=args.draft_vocab_size,
        max_minutes=args.max_minutes,
        max_steps=args.max_steps,
        resume=args.resume,
        data_from=None if args.data_from is None else Path(args.data_from),
        distill_prompts=args.distill_prompts,
        distill_max_tokens=args.distill_max_tokens,
        code_tokens=args.code_tokens,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        unroll=args.unroll,
        noise=args.noise,
        eval_positions=args.eval_positions,
        eval_every=args.eval_every,
        precision=args.precision,
        seed=args.seed,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
    )


def _check_common(args) -> None:
    if args.data_from is not None:
        given = [
            f
            for f, v in (("--distill-prompts", args.distill_prompts), ("--code-tokens", args.code_tokens))
            if v
        ]
        given += ["--resume"] if args.resume else []
        if given:
            raise CliError(f"--data-from takes that run's data set as it is: drop {', '.join(given)}")
    args.distill_prompts = 0 if args.distill_prompts is None else args.distill_prompts
    args.code_tokens = 24_000 if args.code_tokens is None else args.code_tokens
    checks = [
        (args.draft_vocab_size is None or args.draft_vocab_size >= 1, "--draft-vocab-size must be >= 1"),
        (args.max_minutes is None or args.max_minutes > 0, "--max-minutes must be > 0"),
        (args.max_steps is None or args.max_steps >= 1, "--max-steps must be >= 1"),
        (args.distill_prompts >= 0, "--distill-prompts must be >= 0"),
        (args.distill_max_tokens >= 1, "--distill-max-tokens must be >= 1"),
        (args.code_tokens >= 0, "--code-tokens must be >= 0"),
        (args.batch_size >= 1, "--batch-size must be >= 1"),
        (args.lr > 0, "--lr must be > 0"),
        (args.eval_every >= 1, "--eval-every must be >= 1"),
        (
            args.quantization_encoding in PRECISIONS,
            f"--quantization-encoding must be one of {', '.join(PRECISIONS)}",
        ),
        (args.precision in PRECISIONS, f"--precision must be one of {', '.join(PRECISIONS)}"),
        (args.threads is None or args.threads >= 1, "--threads must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise CliError(message)


def main(argv: list[str]) -> None:
    """Raises CliError for bad input (the caller prints it as one line, exit 2)."""
    config, threads = parse_config(argv)
    _set_threads(threads)
    from specserve.engine.memory import InsufficientMemoryError
    from specserve.engine.models.errors import ModelLoadError
    from specserve.plugins.medusa_training import MedusaTrainConfig, train_medusa

    try:
        if isinstance(config, MedusaTrainConfig):
            report = train_medusa(config)
        else:
            from specserve.plugins.eagle_training import train_eagle

            report = train_eagle(config)
    # ValueError covers TrainDraftError and the engine's start-up errors (bad weights, architecture).
    except (ValueError, FileNotFoundError, ModelLoadError, InsufficientMemoryError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    final = report["heldout"]["all"]
    summary = {
        "output": report["output"],
        "steps": report["training"]["steps"],
        "saved_step": report["training"]["saved_step"],
        "tokens_seen": report["training"]["tokens_seen"],
        "run_wall_seconds": report["training"]["run_wall_seconds"],
        "heldout_top1": final["top1"],
        "expected_acceptance_length": final["expected_acceptance_length"],
    }
    print(json.dumps(summary), file=sys.stdout)


def _set_threads(threads: int | None) -> None:
    import torch

    from .cpu_threads import default_num_threads

    # Process-wide by nature: set once, here at the boundary (as serve/generate do).
    torch.set_num_threads(threads or default_num_threads(torch.get_num_threads()))
