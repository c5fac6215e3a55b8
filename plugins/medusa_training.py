"""Train Medusa-1 heads on the target's own hidden states: `specserve train-draft --method medusa`.

What a head learns: head i maps the target's final-normed hidden state at position t (what the engine
hands the proposer, see medusa_features.py) to the token at t + i + 2, the convention MedusaProposer
drafts with. Initialisation is Medusa's: each head's projection is the target's LM head (its draft
vocabulary rows), each ResBlock's weight and bias are zero, so a head starts as the target's own
next-token guess and training only has to learn the shift; that is what makes minutes of CPU useful.

Loss: sum over heads of 0.8^i x cross-entropy (Medusa's decay); labels outside the draft vocabulary are
ignored in the loss (the head cannot name them) and count as misses in the accuracy.

Run: build or reload the data (medusa_data.py), evaluate at step 0 and every `eval_every` steps on the
held-out split, checkpoint (heads, optimizer, step, data position, curve) at each evaluation, stop at
the time budget or the step limit. The head written (medusa.py's layout) is the evaluation with the best
held-out expected acceptance length (early stopping), with train_report.json beside it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine import LLM
from specserve.plugins.medusa import build_heads, save_medusa_heads
from specserve.plugins.medusa_data import (
    STDLIB_LICENCE,
    Example,
    TrainingData,
    distill,
    distill_prompts,
    frequency_ranked_vocab,
    stdlib_examples,
)
from specserve.plugins.medusa_features import RECORDER, FeatureCache

logger = logging.getLogger("specserve.train_draft")
CHECKPOINT_DIR = "checkpoint"
REPORT_FILE = "train_report.json"
HEAD_DECAY = 0.8  # Medusa's per-head loss weight 0.8^i
WARMUP_STEPS = 10
IGNORE = -100
# What a resumed run must share with the checkpoint (the rest may change between runs).
RESUME_KEYS = (
    "model_path",
    "quantization_encoding",
    "num_heads",
    "num_layers",
    "draft_vocab_size",
    "projection_lr",
)


class TrainDraftError(ValueError):
    """Bad input for train-draft: a one-line error (exit 2 at the CLI)."""


@dataclass(frozen=True)
class MedusaTrainConfig:
    output: Path
    model_path: str | None = None  # None: the embedded default model
    quantization_encoding: str = "float32"  # the target run for features and distillation
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int | None = None  # None: the target's whole vocabulary
    max_minutes: float | None = None  # wall budget of this run, data building included
    max_steps: int | None = None  # total optimizer steps (over resumed runs too)
    resume: bool = False
    data_from: Path | None = None  # an earlier run's output: train on its data set as it is
    distill_prompts: int = 0
    distill_max_tokens: int = 128
    code_tokens: int = 24_000
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3  # the ResBlocks'
    projection_lr: float | None = None  # None: lr / 10; 0: the projections stay the LM head's
    eval_every: int = 20
    heldout_every: int = 20  # every 20th sequence of each source is held out (5%)
    precision: str = "float32"  # bfloat16: autocast the heads' matmuls
    seed: int = 0
    cache_dir: str | None = None
    progress: bool = True


@dataclass
class Progress:
    """What a checkpoint restores: where training is and what it has measured."""

    step: int = 0
    epoch: int = 0
    position: int = 0  # sequences of this epoch's order already trained on
    tokens_seen: int = 0
    train_seconds: float = 0.0  # optimizer-loop time over every run so far
    curve: list | None = None
    best_step: int = -1  # the evaluation whose heads are saved (early stopping)
    best_score: float = -math.inf  # its held-out expected acceptance length


def train_medusa(cfg: MedusaTrainConfig, data: TrainingData | None = None) -> dict:
    """Train, save the head into cfg.output and return the report (also written to train_report.json).
    `data`: use these sequences instead of building the stdlib + distilled set (tests, own data)."""
    run_start = time.perf_counter()
    deadline = run_start + cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    ckpt = cfg.output / CHECKPOINT_DIR
    _check_output(cfg, ckpt)
    llm = LLM(
        cfg.model_path,
        quantization_encoding=cfg.quantization_encoding,
        # Distillation records the features the engine computes anyway (medusa_features.py).
        speculative_method=RECORDER,
        speculative_policy="static",
        num_speculative_tokens=1,
        max_length=1024,
        max_kv_cache_tokens=64 * 1024,
        max_batch_size=64,  # decode rows are cheaper in bigger batches; KV pages are touched lazily
        cache_dir=cfg.cache_dir,
    )
    model, arch = llm.engine.model, llm.engine.arch
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= arch.vocab_size:
        raise TrainDraftError(f"--draft-vocab-size must be in [1, {arch.vocab_size}] for this target")
    # Distillation may use at most half the budget (it starts no new batch past that).
    distill_stop = run_start + cfg.max_minutes * 30 if cfg.max_minutes else math.inf
    data, draft_ids, data_info = _data(cfg, llm, ckpt, arch.vocab_size, data, distill_stop)
    rows = arch.vocab_size if draft_ids is None else len(draft_ids)
    heads = build_heads(cfg.num_heads, cfg.num_layers, arch.hidden_size, rows)
    _init_from_target(heads, model, draft_ids)
    optimizer = _optimizer(heads, cfg)
    progress = Progress(curve=[])
    if cfg.resume:
        progress = _load_checkpoint(ckpt, heads, optimizer)
    row_of = _row_map(arch.vocab_size, draft_ids)  # [vocab] target id -> projection row (or IGNORE)
    features = FeatureCache(model, llm.engine.device, llm.engine.config.model.dtype)
    for split, examples in (("train", data.train), ("heldout", data.heldout)):
        for i, ex in enumerate(examples):
            if ex.features is not None:
                features.put((split, i), ex.features)
    evaluate = _Evaluator(data, features, row_of, draft_ids, cfg)
    head_info = {"model_path": cfg.model_path, "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size}
    last_eval_s, step_s = 0.0, 0.0

    def checkpoint() -> None:
        """Evaluate; save the head if it is the best so far, and the state to resume from."""
        progress.curve.append(evaluate(heads, progress, time.perf_counter() - run_start))
        score = progress.curve[-1]["all"]["expected_acceptance_length"]
        if score >= progress.best_score:  # ties: the later (longer trained) heads
            progress.best_step, progress.best_score = progress.step, score
            save_medusa_heads(cfg.output, heads, cfg.num_layers, head_info, draft_ids)
        _save_state(cfg, ckpt, heads, optimizer, progress)

    if not progress.curve:
        checkpoint()
        last_eval_s = progress.curve[-1]["eval_seconds"]
    from tqdm import tqdm

    bar = tqdm(
        total=cfg.max_steps, initial=progress.step, desc="train-draft medusa", disable=not cfg.progress
    )
    loop_start = time.perf_counter()
    trained_before = progress.train_seconds
    stop_reason = "max_steps"
    while cfg.max_steps is None or progress.step < cfg.max_steps:
        # Leave room for one more step, the final evaluation and the save.
        if time.perf_counter() + step_s + 1.2 * last_eval_s + 2.0 > deadline:
            stop_reason = "max_minutes"
            break
        if cfg.max_minutes is None and cfg.max_steps is None and _epoch_done(progress, len(data.train)):
            stop_reason = "one_epoch"
            break
        step_start = time.perf_counter()
        indices = _next_batch(progress, len(data.train), cfg)
        batch = [data.train[i] for i in indices]
        feats = features.get(
            [("train", i) for i in indices], [e.tokens for e in batch], [e.start for e in batch]
        )
        warmup = min(1.0, (progress.step + 1) / WARMUP_STEPS)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * warmup
        losses = _train_step(heads, optimizer, feats, batch, row_of, cfg)
        progress.step += 1
        progress.tokens_seen += sum(len(f) for f in feats)
        progress.train_seconds = trained_before + time.perf_counter() - loop_start
        step_s = time.perf_counter() - step_start
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses):.3f}", epoch=progress.epoch, left=_left(deadline))
        if progress.step % cfg.eval_every == 0:
            checkpoint()
            last_eval_s = progress.curve[-1]["eval_seconds"]
    bar.close()
    if progress.curve[-1]["step"] != progress.step:
        checkpoint()
    report = _report(cfg, arch, data, data_info, draft_ids, progress, features, stop_reason, run_start)
    (cfg.output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


# --- data ----------------------------------------------------------------------------------------
def _data(
    cfg: MedusaTrainConfig, llm: LLM, ckpt: Path, vocab: int, given: TrainingData | None, distill_stop: float
):
    """Build the data set (or reload the checkpoint's: distillation is not repeated on resume)."""
    saved = ckpt / "data.pt"
    if cfg.resume and saved.exists():
        state = torch.load(saved, weights_only=True)
        ids = state["draft_ids"] if state["draft_ids"].numel() else None
        return TrainingData.from_state(state["data"]), ids, state["info"]
    start = time.perf_counter()
    building = given is None and cfg.data_from is None  # else the sequences come as they are
    if given is not None:
        data = given
    elif cfg.data_from is not None:
        data = reused_data(cfg.data_from, cfg.model_path, vocab)
    else:
        data = TrainingData()
        code = stdlib_examples(llm.tokenizer.encode, cfg.code_tokens, cfg.seq_len, cfg.seed)
        data.add(code, cfg.heldout_every)
    distill_s = 0.0
    if cfg.distill_prompts and building:
        t = time.perf_counter()
        prompts = distill_prompts(cfg.distill_prompts, cfg.seed)
        recorder = llm.engine.proposer
        answers = distill(llm, recorder, prompts, cfg.distill_max_tokens, cfg.progress, distill_stop)
        for source in sorted({a.source for a in answers}):  # a held-out share of every category
            data.add([a for a in answers if a.source == source], cfg.heldout_every)
        distill_s = time.perf_counter() - t
    if not data.train or not data.heldout:
        raise TrainDraftError("not enough training text: raise --code-tokens or --distill-prompts")
    ids = frequency_ranked_vocab(data.train, vocab, cfg.draft_vocab_size) if cfg.draft_vocab_size else None
    info = {
        "sources": data.summary(),
        "code_licence": STDLIB_LICENCE if given is None else None,
        "data_from": None if cfg.data_from is None else str(cfg.data_from),
        "distill_seconds": round(distill_s, 1),
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    ckpt.mkdir(parents=True, exist_ok=True)
    empty = torch.zeros(0, dtype=torch.int64)
    torch.save({"data": data.to_state(), "draft_ids": empty if ids is None else ids, "info": info}, saved)
    return data, ids, info


def reused_data(run_dir: Path, model_path: str | None, vocab: int) -> TrainingData:
    """--data-from: the data set (held-out split included) an earlier run built for the same target.
    Distillation is the expensive part of a run (12 minutes of 64 answers on the 1.5B target), so
    trying other hyperparameters should not repeat it."""
    ckpt = Path(run_dir) / CHECKPOINT_DIR
    if not (ckpt / "data.pt").exists() or not (ckpt / "config.json").exists():
        raise TrainDraftError(
            f"--data-from {run_dir}: no {CHECKPOINT_DIR}/data.pt there (a train-draft --output?)"
        )
    built_for = json.loads((ckpt / "config.json").read_text()).get("model_path")
    if built_for != model_path:
        raise TrainDraftError(f"--data-from {run_dir}: built for target {built_for}, not {model_path}")
    data = TrainingData.from_state(torch.load(ckpt / "data.pt", weights_only=True)["data"])
    if max(max(e.tokens) for e in data.train + data.heldout) >= vocab:
        raise TrainDraftError(f"--data-from {run_dir}: token ids beyond this target's vocabulary")
    return data


def _next_batch(progress: Progress, num_train: int, cfg: MedusaTrainConfig) -> list[int]:
    """The next `batch_size` indices of this epoch's seeded order (a new order each epoch)."""
    if progress.position >= num_train:
        progress.epoch, progress.position = progress.epoch + 1, 0
    order = torch.randperm(
        num_train, generator=torch.Generator().manual_seed(cfg.seed * 1000 + progress.epoch)
    )
    batch = order[progress.position : progress.position + cfg.batch_size].tolist()
    progress.position += len(batch)
    return batch


def _epoch_done(progress: Progress, num_train: int) -> bool:
    return progress.epoch >= 1 or progress.position >= num_train


def _row_map(vocab: int, draft_ids: torch.Tensor | None) -> torch.Tensor:
    if draft_ids is None:
        return torch.arange(vocab)
    row_of = torch.full((vocab,), IGNORE, dtype=torch.int64)
    row_of[draft_ids] = torch.arange(len(draft_ids))
    return row_of


def head_labels(
    sequences: list[list[int]], num_heads: int, starts: list[int] | None = None, rows: list[int] | None = None
) -> torch.Tensor:
    """[num_heads, sum(rows)] target ids: head i at feature row j of a sequence (position p = start + j)
    gets token p + i + 2, IGNORE past the sequence's end. Default: start 0, one row per token."""
    out = []
    for n, seq in enumerate(sequences):
        start = starts[n] if starts else 0
        count = rows[n] if rows else len(seq) - start
        ids = torch.tensor(seq, dtype=torch.int64)
        labels = torch.full((num_heads, count), IGNORE, dtype=torch.int64)
        for i in range(num_heads):
            take = ids[start + i + 2 : start + i + 2 + count]
            labels[i, : len(take)] = take
        out.append(labels)
    return torch.cat(out, dim=1)


def _labels(examples: list[Example], feats: list[torch.Tensor], num_heads: int) -> torch.Tensor:
    return head_labels(
        [e.tokens for e in examples], num_heads, [e.start for e in examples], [len(f) for f in feats]
    )


# --- model -----------------------------------------------------------------------------------------
def _init_from_target(heads: nn.ModuleList, model: nn.Module, draft_ids: torch.Tensor | None) -> None:
    """Medusa's start: projections copy the target's LM head rows, ResBlocks are the identity."""
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if weight is None or not weight.dtype.is_floating_point:
        raise TrainDraftError(
            "the target's LM head is not a float nn.Linear (use a float --quantization-encoding)"
        )
    rows = weight.detach().float() if draft_ids is None else weight.detach().float()[draft_ids]
    with torch.no_grad():
        for head in heads:
            for block in head[:-1]:
                nn.init.zeros_(block.linear.weight)
                nn.init.zeros_(block.linear.bias)
            head[-1].weight.copy_(rows)


def _optimizer(heads: nn.ModuleList, cfg: MedusaTrainConfig) -> torch.optim.Optimizer:
    """AdamW; the ResBlocks at lr, the projections (already the LM head) at a tenth of it by default:
    in 4-minute runs on SmolLM2 that matched lr 1e-3 everywhere with 20% more steps. A projection_lr
    of 0 freezes them (no weight gradient: a third less compute)."""
    blocks = [p for head in heads for p in head[:-1].parameters()]
    projections = [head[-1].weight for head in heads]
    proj_lr = cfg.lr / 10 if cfg.projection_lr is None else cfg.projection_lr
    groups = [{"params": blocks, "base_lr": cfg.lr, "lr": cfg.lr}]
    if proj_lr > 0:
        groups.append({"params": projections, "base_lr": proj_lr, "lr": proj_lr})
    else:
        for weight in projections:
            weight.requires_grad_(False)
    return torch.optim.AdamW(groups, weight_decay=0.0)


def _autocast(cfg: MedusaTrainConfig):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16")


def _train_step(heads, optimizer, feats, examples, row_of, cfg) -> list[float]:
    x = torch.cat(feats).float()  # [T, hidden]
    rows = _rows(_labels(examples, feats, cfg.num_heads), row_of)  # [num_heads, T]
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for i, head in enumerate(heads):
        if not (rows[i] != IGNORE).any():
            losses.append(0.0)
            continue
        with _autocast(cfg):
            logits = head(x)  # [T, N]
        loss = F.cross_entropy(logits.float(), rows[i], ignore_index=IGNORE)
        # One head at a time: only one [T, N] logits tensor (and its grad) is alive at once.
        (loss * HEAD_DECAY**i).backward()
        losses.append(float(loss.detach()))
    torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
    optimizer.step()
    return losses


def _rows(labels: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """Target ids -> projection rows; IGNORE stays IGNORE, ids outside the draft vocabulary become IGNORE."""
    return torch.where(labels == IGNORE, IGNORE, row_of[labels.clamp(min=0)])


# --- evaluation ------------------------------------------------------------------------------------
class _Evaluator:
    """Held-out loss and top-1 per head, and the chain a greedy verifier would accept, per source."""

    def __init__(self, data: TrainingData, features: FeatureCache, row_of, draft_ids, cfg: MedusaTrainConfig):
        self.data, self.features, self.row_of, self.draft_ids, self.cfg = (
            data,
            features,
            row_of,
            draft_ids,
            cfg,
        )

    @torch.no_grad()
    def __call__(self, heads: nn.ModuleList, progress: Progress, elapsed: float) -> dict:
        began = time.perf_counter()
        n = self.cfg.num_heads
        sums: dict[str, torch.Tensor] = {}  # source -> [loss sum, in-vocab count, correct, labelled] x heads
        chains: dict[str, torch.Tensor] = {}  # source -> [chain correct x heads, positions]
        held = self.data.heldout
        feats = []
        for first in range(0, len(held), self.cfg.batch_size):  # first call: one target forward per batch
            idx = range(first, min(first + self.cfg.batch_size, len(held)))
            chunk = [held[i] for i in idx]
            feats += self.features.get(
                [("heldout", i) for i in idx], [e.tokens for e in chunk], [e.start for e in chunk]
            )
        for ex, feat in zip(held, feats, strict=True):
            source = ex.source
            labels = _labels([ex], [feat], n)  # [n, rows]
            rows = _rows(labels, self.row_of)
            with _autocast(self.cfg):
                logits = torch.stack([h(feat.float()) for h in heads]).float()  # [n, L, N]
            pred = logits.argmax(-1) if self.draft_ids is None else self.draft_ids[logits.argmax(-1)]
            correct = (pred == labels) & (labels != IGNORE)  # [n, L]
            ce = F.cross_entropy(
                logits.transpose(1, 2), rows, ignore_index=IGNORE, reduction="none"
            )  # [n, L]
            s = sums.setdefault(source, torch.zeros(4, n, dtype=torch.float64))
            s += torch.stack(
                [ce.sum(1), (rows != IGNORE).sum(1), correct.sum(1), (labels != IGNORE).sum(1)]
            ).double()
            full = labels[-1] != IGNORE  # positions where every head has a label
            chain = correct[:, full].cumprod(0)  # [n, P]: heads 0..i all right
            c = chains.setdefault(source, torch.zeros(n + 1, dtype=torch.float64))
            c[:n] += chain.sum(1).double()
            c[n] += int(full.sum())
        point = {
            "step": progress.step,
            "elapsed_seconds": round(elapsed, 1),
            "train_seconds": round(progress.train_seconds, 1),
            "tokens_seen": progress.tokens_seen,
            "all": _metrics(sum(sums.values()), sum(chains.values())),
            "by_source": {src: _metrics(sums[src], chains[src]) for src in sorted(sums)},
        }
        point["eval_seconds"] = round(time.perf_counter() - began, 2)
        logger.info("step %d: held-out top-1 per head %s", progress.step, point["all"]["top1"])
        return point


def _metrics(s: torch.Tensor, c: torch.Tensor) -> dict:
    n = s.shape[1]
    chain = [float(c[i] / c[n]) if c[n] else 0.0 for i in range(n)]
    return {
        "loss": [round(float(s[0, i] / s[1, i]), 4) if s[1, i] else None for i in range(n)],
        "top1": [round(float(s[2, i] / s[3, i]), 4) if s[3, i] else None for i in range(n)],
        "label_coverage": round(float(s[1, 0] / s[3, 0]), 4) if s[3, 0] else None,
        # Teacher-forced estimate of greedy acceptance: draft i is accepted when heads 0..i are all right.
        "chain_acceptance": [round(x, 4) for x in chain],
        "expected_acceptance_length": round(1 + sum(chain), 4),
        "labelled_tokens": int(s[3, 0]),
    }


# --- checkpoints and report ------------------------------------------------------------------------
def _check_output(cfg: MedusaTrainConfig, ckpt: Path) -> None:
    if cfg.output.exists() and not cfg.output.is_dir():
        raise TrainDraftError(f"--output {cfg.output} is a file, not a directory")
    if cfg.resume and not (ckpt / "state.pt").exists():
        raise TrainDraftError(f"--resume: no checkpoint in {ckpt}")
    if not cfg.resume and (ckpt / "state.pt").exists():
        raise TrainDraftError(f"{cfg.output} holds a checkpoint: pass --resume, or choose another --output")
    if cfg.resume:
        saved = json.loads((ckpt / "config.json").read_text())
        changed = [k for k in RESUME_KEYS if saved.get(k) != asdict(cfg).get(k)]
        if changed:
            raise TrainDraftError(f"--resume with other {', '.join(changed)} than the checkpoint's")


def _save_state(cfg, ckpt: Path, heads, optimizer, progress: Progress) -> None:
    """What --resume continues from (the current heads, not the best ones), written then renamed."""
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / "state.pt.tmp"
    torch.save(
        {"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "progress": asdict(progress)}, tmp
    )
    tmp.replace(ckpt / "state.pt")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    (ckpt / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _load_checkpoint(ckpt: Path, heads: nn.ModuleList, optimizer) -> Progress:
    state = torch.load(ckpt / "state.pt", weights_only=True)
    heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    return Progress(**state["progress"])


def _left(deadline: float) -> str:
    return "-" if math.isinf(deadline) else f"{max(0.0, deadline - time.perf_counter()) / 60:.1f}m"


def training_summary(cfg, progress: Progress, features, stop_reason: str, run_start: float) -> dict:
    """The report's "training" block (both methods): steps, tokens, time, stop reason, the run's config."""
    return {
        "steps": progress.step,
        "saved_step": progress.best_step,
        "epochs_completed": progress.epoch,
        "tokens_seen": progress.tokens_seen,
        "train_seconds": round(progress.train_seconds, 1),
        "run_wall_seconds": round(time.perf_counter() - run_start, 1),
        "target_forward_tokens": features.tokens_computed,
        "target_forward_seconds": round(features.seconds, 1),
        "stop_reason": stop_reason,
        "precision": cfg.precision,
        "threads": torch.get_num_threads(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
    }


def _report(cfg, arch, data, data_info, draft_ids, progress, features, stop_reason, run_start) -> dict:
    best = next(p for p in progress.curve if p["step"] == progress.best_step)
    return {
        "method": "medusa",
        "model_path": cfg.model_path,
        "output": str(cfg.output),
        "target": {"hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size},
        "heads": {
            "num_heads": cfg.num_heads,
            "num_layers": cfg.num_layers,
            "draft_vocab_size": None if draft_ids is None else len(draft_ids),
        },
        "data": data_info,
        "training": training_summary(cfg, progress, features, stop_reason, run_start),
        # The saved head is the evaluation with the best held-out expected acceptance length (early
        # stopping: a few thousand answers are seen many times in a long run, and heads overfit them).
        "heldout": best,
        "final_step_heldout": progress.curve[-1],
        "curve": progress.curve,
    }
