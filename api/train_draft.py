"""`specserve train-draft`: train a draft head on the target's hidden states, on the CPU.

--method medusa trains Medusa-1 heads (plugins/medusa_training.py) into the FasterDecoding layout that
`--speculative-method medusa --medusa-heads-path DIR` loads. --method eagle is refused (exit 2): the
EAGLE head and its proposer are not implemented yet (issue 15). Bad input is one error line, exit 2.
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
            "heads for --speculative-method medusa --medusa-heads-path DIR. --method eagle is not "
            "implemented yet (issue 15) and exits with status 2."
        ),
    )
    p.add_argument("--method", required=True, help="medusa (eagle: not implemented yet, issue 15)")
    p.add_argument(
        "--model-path", default=None, help="the target: hub id, HF directory or .gguf (default: SmolLM2-135M)"
    )
    p.add_argument(
        "--output", default=None, help="directory for the head, its checkpoint and train_report.json"
    )
    p.add_argument("--num-heads", type=int, default=4, help="draft positions (default: 4)")
    p.add_argument("--num-layers", type=int, default=1, help="ResBlocks per head (default: 1)")
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
        "--distill-prompts", type=int, default=0, help="add the target's answers to N prompts (default: 0)"
    )
    p.add_argument(
        "--distill-max-tokens", type=int, default=128, help="tokens per distilled answer (default: 128)"
    )
    p.add_argument(
        "--code-tokens", type=int, default=24_000, help="stdlib source tokens to train on (default: 24000)"
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per code sequence (default: 256)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW learning rate of the ResBlocks (default: 3e-3)"
    )
    p.add_argument(
        "--projection-lr",
        type=float,
        default=None,
        help="learning rate of the vocabulary projections (default: --lr / 10; 0 freezes them)",
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


def parse_config(argv: list[str]):
    """argv -> MedusaTrainConfig; any bad value is a CliError (one line)."""
    args = build_parser().parse_args(argv)
    if args.method not in METHODS:
        raise CliError(f"--method must be one of {', '.join(METHODS)}, not {args.method!r}")
    if args.method == "eagle":
        raise CliError("--method eagle is not implemented yet (issue 15); use --method medusa")
    if not args.output:
        raise CliError("--output DIR is required (see specserve train-draft --help)")
    checks = [
        (1 <= args.num_heads <= 16, "--num-heads must be in [1, 16]"),
        (1 <= args.num_layers <= 8, "--num-layers must be in [1, 8]"),
        (args.draft_vocab_size is None or args.draft_vocab_size >= 1, "--draft-vocab-size must be >= 1"),
        (args.max_minutes is None or args.max_minutes > 0, "--max-minutes must be > 0"),
        (args.max_steps is None or args.max_steps >= 1, "--max-steps must be >= 1"),
        (args.distill_prompts >= 0, "--distill-prompts must be >= 0"),
        (args.distill_max_tokens >= 1, "--distill-max-tokens must be >= 1"),
        (args.code_tokens >= 0, "--code-tokens must be >= 0"),
        (args.seq_len >= args.num_heads + 2, "--seq-len must exceed --num-heads + 1"),
        (args.batch_size >= 1, "--batch-size must be >= 1"),
        (args.lr > 0, "--lr must be > 0"),
        (args.projection_lr is None or args.projection_lr >= 0, "--projection-lr must be >= 0"),
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


def main(argv: list[str]) -> None:
    """Raises CliError for bad input (the caller prints it as one line, exit 2)."""
    config, threads = parse_config(argv)
    _set_threads(threads)
    from specserve.engine.memory import InsufficientMemoryError
    from specserve.engine.models.errors import ModelLoadError
    from specserve.plugins.medusa_training import train_medusa

    try:
        report = train_medusa(config)
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
