"""Train an EAGLE-1 head on the target's own features: `specserve train-draft --method eagle`.

What the head learns (eagle_head.py): from the pairs (f_i, x_{i+1}) up to position p -- f_i the
target's final-normed hidden state, x_{i+1} the token after it -- predict f_{p+1}, the target's next
feature; the draft token is the target's LM head on that prediction. Features come from one no-grad
prefill forward of the target over each whole sequence (prompt and answer: the head attends over the
prompt's pairs at inference too), kept in bfloat16 (medusa_features.FeatureCache).

Loss (EAGLE-1): SmoothL1(f^_{p+1}, f_{p+1}) + 0.1 x cross-entropy of the LM head on f^_{p+1} against
the target's own next-token distribution softmax(lm_head(f_{p+1})) (what greedy verification compares
with; over the draft vocabulary's rows with --draft-vocab-size, FR-Spec). Optional EAGLE noise
U(-noise, noise) x the features' RMS on the real input features.

Unrolling (`unroll` depths, default 2): at inference the second draft is made from the head's own
prediction f^_{p+1} fed back with the drafted token, attending to the real pairs before it. Depth d
of training reproduces exactly that: the pair at position q of depth d carries depth d-1's output at
q - 1, and attends to the real (depth-1) pairs up to q - d + 1 and to the depth-2..d pairs of its own
chain (one mask, see `chain_mask`). Every depth predicts the same targets (f_{q+1}, x_{q+2}), the
depths weigh equally. The same unrolled forward with k depths is the
held-out evaluation: draft j of a chain that starts after real position p is depth j's output at
p + j - 1, its label x_{p+j+1} (the data token: on distilled answers the target's greedy choice).

Initialisation: fc = [0 | I] (+ small noise) so the fused input is the feature itself, o_proj and
down_proj scaled down (x 0.1): the head starts near f^_{p+1} = f_p and training learns the shift.
The target's embedding and LM head are frozen and not saved.

Run: like medusa_training (shared helpers): data (stdlib code + distilled answers), held-out split,
evaluation at step 0 and every `eval_every` steps, resumable checkpoints, time budget, the best
held-out evaluation's head saved (early stopping), train_report.json beside it.
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
from specserve.plugins.eagle_head import EagleHead, head_arch, save_eagle_head
from specserve.plugins.medusa_data import TrainingData
from specserve.plugins.medusa_features import RECORDER, FeatureCache
from specserve.plugins.medusa_training import (
    CHECKPOINT_DIR,
    REPORT_FILE,
    WARMUP_STEPS,
    Progress,
    TrainDraftError,
    _autocast,
    _check_output,
    _data,
    _epoch_done,
    _left,
    _load_checkpoint,
    _next_batch,
    _row_map,
    _save_state,
    training_summary,
)

logger = logging.getLogger("specserve.train_draft")
CE_WEIGHT = 0.1  # EAGLE-1's weight of the token loss against the feature regression
EAGLE_RESUME_KEYS = ("unroll", "noise", "fc_bias")


@dataclass(frozen=True)
class EagleTrainConfig:
    output: Path
    model_path: str | None = None  # None: the embedded default model
    quantization_encoding: str = "float32"  # the target run for features and distillation
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
    lr: float = 1e-3
    unroll: int = 2  # training depths: 1 = teacher-forced only; 2 also trains the second draft
    noise: float = 0.0  # EAGLE's uniform input noise, relative to the features' RMS
    fc_bias: bool = True
    eval_positions: int = 5  # draft positions the held-out chain is simulated for
    eval_every: int = 20
    heldout_every: int = 20
    precision: str = "float32"  # bfloat16: autocast the head's matmuls
    seed: int = 0
    cache_dir: str | None = None
    progress: bool = True


def train_eagle(cfg: EagleTrainConfig, data: TrainingData | None = None) -> dict:
    """Train, save the head into cfg.output and return the report (also written to train_report.json).
    `data`: use these sequences instead of building the stdlib + distilled set (tests, own data)."""
    run_start = time.perf_counter()
    deadline = run_start + cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    ckpt = cfg.output / CHECKPOINT_DIR
    _check_output(cfg, ckpt)
    if cfg.resume:
        saved = json.loads((ckpt / "config.json").read_text())
        changed = [k for k in EAGLE_RESUME_KEYS if saved.get(k) != asdict(cfg).get(k)]
        if changed:
            raise TrainDraftError(f"--resume with other {', '.join(changed)} than the checkpoint's")
    llm = LLM(
        cfg.model_path,
        quantization_encoding=cfg.quantization_encoding,
        speculative_method=RECORDER,
        speculative_policy="static",
        num_speculative_tokens=1,
        max_length=1024,
        max_kv_cache_tokens=64 * 1024,
        max_batch_size=64,
        cache_dir=cfg.cache_dir,
    )
    model, arch = llm.engine.model, llm.engine.arch
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= arch.vocab_size:
        raise TrainDraftError(f"--draft-vocab-size must be in [1, {arch.vocab_size}] for this target")
    embed, lm_weight = _frozen_target_parts(model)
    distill_stop = run_start + cfg.max_minutes * 30 if cfg.max_minutes else math.inf
    data, draft_ids, data_info = _data(cfg, llm, ckpt, arch.vocab_size, data, distill_stop)
    lm_rows = lm_weight if draft_ids is None else lm_weight[draft_ids].contiguous()  # [N, hidden]
    row_of = _row_map(arch.vocab_size, draft_ids)
    torch.manual_seed(cfg.seed)
    head = EagleHead(head_arch(arch), fc_bias=cfg.fc_bias, input_norm=False)
    init_near_identity(head, cfg.seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    for group in optimizer.param_groups:
        group["base_lr"] = cfg.lr
    progress = Progress(curve=[])
    if cfg.resume:
        progress = _load_checkpoint(ckpt, head, optimizer)
    # Whole-sequence features (from position 0): the recorded answer-only features do not cover the prompt.
    features = FeatureCache(model, llm.engine.device, llm.engine.config.model.dtype)
    target = _Target(embed, lm_rows, row_of, draft_ids)

    def feats_of(split: str, indices: list[int]) -> list[torch.Tensor]:
        examples = data.train if split == "train" else data.heldout
        return features.get(
            [(split, i) for i in indices], [examples[i].tokens for i in indices], [0] * len(indices)
        )

    evaluate = _Evaluator(data, feats_of, target, cfg)
    extra = {"eagle_trained_by": "specserve train-draft", "target_model_path": cfg.model_path}
    last_eval_s, step_s = 0.0, 0.0

    def checkpoint() -> None:
        progress.curve.append(evaluate(head, progress, time.perf_counter() - run_start))
        score = progress.curve[-1]["all"]["expected_acceptance_length"]
        if score >= progress.best_score:
            progress.best_step, progress.best_score = progress.step, score
            save_eagle_head(cfg.output, head, draft_ids, extra)
        _save_state(cfg, ckpt, head, optimizer, progress)

    if not progress.curve:
        checkpoint()
        last_eval_s = progress.curve[-1]["eval_seconds"]
    from tqdm import tqdm

    bar = tqdm(total=cfg.max_steps, initial=progress.step, desc="train-draft eagle", disable=not cfg.progress)
    loop_start = time.perf_counter()
    trained_before = progress.train_seconds
    stop_reason = "max_steps"
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    while cfg.max_steps is None or progress.step < cfg.max_steps:
        if time.perf_counter() + step_s + 1.2 * last_eval_s + 2.0 > deadline:
            stop_reason = "max_minutes"
            break
        if cfg.max_minutes is None and cfg.max_steps is None and _epoch_done(progress, len(data.train)):
            stop_reason = "one_epoch"
            break
        step_start = time.perf_counter()
        indices = _next_batch(progress, len(data.train), cfg)
        batch = _Batch.build([data.train[i].tokens for i in indices], feats_of("train", indices))
        warmup = min(1.0, (progress.step + 1) / WARMUP_STEPS)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * warmup
        loss, parts = train_step(head, optimizer, batch, target, cfg, generator)
        progress.step += 1
        progress.tokens_seen += int(batch.lengths.sum())
        progress.train_seconds = trained_before + time.perf_counter() - loop_start
        step_s = time.perf_counter() - step_start
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", reg=f"{parts[0]:.3f}", ce=f"{parts[1]:.2f}", left=_left(deadline))
        if progress.step % cfg.eval_every == 0:
            checkpoint()
            last_eval_s = progress.curve[-1]["eval_seconds"]
    bar.close()
    if progress.curve[-1]["step"] != progress.step:
        checkpoint()
    report = _report(cfg, arch, data_info, draft_ids, progress, features, stop_reason, run_start)
    (cfg.output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


# --- model -----------------------------------------------------------------------------------------
def _frozen_target_parts(model: nn.Module) -> tuple[nn.Embedding, torch.Tensor]:
    embed = getattr(model, "embed_tokens", None)
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if not isinstance(embed, nn.Embedding) or weight is None or not weight.dtype.is_floating_point:
        raise TrainDraftError(
            "the target's embedding or LM head is not a float layer (use a float --quantization-encoding)"
        )
    return embed, weight.detach().float()


def init_near_identity(head: EagleHead, seed: int = 0, noise: float = 1e-3) -> None:
    """fc = [0 | I] + noise (the fused input is the feature), o_proj and down_proj x 0.1: the head
    starts close to f^_{p+1} = f_p, the residual stream carries the feature through."""
    hidden = head.arch.hidden_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = torch.randn(hidden, 2 * hidden, generator=g) * noise
        w[:, hidden:] += torch.eye(hidden)
        head.fc.weight.copy_(w)
        if head.fc.bias is not None:
            head.fc.bias.zero_()
        head.layer.self_attn.o_proj.weight.mul_(0.1)
        head.layer.mlp.down_proj.weight.mul_(0.1)


@dataclass
class _Target:
    """The frozen parts of the target the head is trained against."""

    embed: nn.Embedding
    lm_rows: torch.Tensor  # [N, hidden] float32: LM head rows of the draft vocabulary (all: N = V)
    row_of: torch.Tensor  # [V] target id -> row (IGNORE outside the draft vocabulary)
    draft_ids: torch.Tensor | None

    def embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.embed(tokens).float()


@dataclass
class _Batch:
    tokens: torch.Tensor  # [B, L] int64 (0-padded)
    feats: torch.Tensor  # [B, L, hidden] float32 (0-padded)
    lengths: torch.Tensor  # [B]

    @classmethod
    def build(cls, sequences: list[list[int]], feats: list[torch.Tensor]) -> _Batch:
        length = max(len(s) for s in sequences)
        hidden = feats[0].shape[-1]
        tokens = torch.zeros(len(sequences), length, dtype=torch.int64)
        out = torch.zeros(len(sequences), length, hidden)
        for b, (seq, f) in enumerate(zip(sequences, feats, strict=True)):
            tokens[b, : len(seq)] = torch.tensor(seq)
            out[b, : len(seq)] = f[: len(seq)].float()
        return cls(tokens, out, torch.tensor([len(s) for s in sequences]))

    def pair_valid(self) -> torch.Tensor:  # [B, T]: pair q = (f_q, x_{q+1}) exists, T = L - 1
        q = torch.arange(self.tokens.shape[1] - 1)
        return q[None, :] + 1 < self.lengths[:, None]


def chain_mask(length: int, depths: int) -> torch.Tensor:
    """[D*T, D*T] bool over (depth, position) pairs, depth-major: depth-d query at q sees the real
    (depth-1) pairs j <= q - d + 1 and the depth-e pairs of its own chain (2 <= e <= d) at q - d + e."""
    q = torch.arange(length)
    blocks = []
    for d in range(1, depths + 1):
        row = []
        for e in range(1, depths + 1):
            if e == 1:
                row.append(q[None, :] <= q[:, None] - d + 1)
            elif e <= d:
                row.append(q[None, :] == q[:, None] - d + e)
            else:
                row.append(torch.zeros(length, length, dtype=torch.bool))
        blocks.append(torch.cat(row, dim=1))
    mask = torch.cat(blocks, dim=0)
    return mask | torch.eye(depths * length, dtype=torch.bool)  # no empty rows (masked out of the loss)


def unrolled_forward(
    head: EagleHead,
    embeds: torch.Tensor,  # [B, T, hidden]: embeddings of x_{q+1}
    features: torch.Tensor,  # [B, T, hidden]: the real f_q
    key_valid: torch.Tensor,  # [B, T] bool: pair q exists
    depths: int,
) -> list[torch.Tensor]:  # per depth d: [B, T, hidden], the prediction of f_{q+1} from a chain of d
    """The head's chain, `depths` drafts deep, at every position at once (see chain_mask)."""
    length = embeds.shape[1]
    positions = torch.arange(length, device=embeds.device)
    mask = chain_mask(length, depths).to(embeds.device)
    keys = key_valid.repeat(1, depths)  # [B, D*T]
    mask = (mask[None] & keys[:, None, :]) | torch.eye(depths * length, dtype=torch.bool)[None]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    feats = features
    for d in range(depths):
        if d:
            prev = outs[-1]  # depth d's output at q - 1 is depth d+1's feature at q
            feats = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        x = head.fuse(embeds, feats)
        q, k, v = head.dense_qkv(x, positions)
        ks.append(k)
        vs.append(v)
        rows = mask[:, None, d * length : (d + 1) * length, : (d + 1) * length]  # [B, 1, T, (d+1)T]
        outs.append(head.dense_finish(x, q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), rows))
    return outs


def train_step(
    head: EagleHead,
    optimizer: torch.optim.Optimizer,
    batch: _Batch,
    target: _Target,
    cfg: EagleTrainConfig,
    generator: torch.Generator | None = None,
) -> tuple[float, tuple[float, float]]:
    """One AdamW step on the EAGLE loss over `cfg.unroll` depths; returns (loss, (regression, ce))."""
    head.train()
    valid = batch.pair_valid()  # [B, T]
    feats_in = batch.feats[:, :-1]
    if cfg.noise > 0:
        scale = feats_in.pow(2).mean().sqrt()
        u = torch.rand(feats_in.shape, generator=generator) * 2 - 1
        feats_in = feats_in + u * cfg.noise * scale
    goal = batch.feats[:, 1:]  # [B, T, hidden]: f_{q+1}
    with torch.no_grad():
        soft = torch.softmax(goal @ target.lm_rows.T, dim=-1)  # [B, T, N]: the target's next token
    embeds = target.embeds(batch.tokens[:, 1:])
    optimizer.zero_grad(set_to_none=True)
    with _autocast(cfg):
        outs = unrolled_forward(head, embeds, feats_in, valid, cfg.unroll)
    reg_sum, ce_sum = 0.0, 0.0
    loss = torch.zeros(())
    q = torch.arange(valid.shape[1])
    for d, out in enumerate(outs):
        mask = valid & (q[None, :] >= d)  # depth d+1 needs d earlier pairs of its own chain
        if not mask.any():
            continue
        pred = out.float()[mask]  # [M, hidden]
        reg = F.smooth_l1_loss(pred, goal[mask])
        with _autocast(cfg):
            logits = pred @ target.lm_rows.T
        ce = -(soft[mask] * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
        loss = loss + (reg + CE_WEIGHT * ce) / len(outs)
        reg_sum += float(reg.detach()) / len(outs)
        ce_sum += float(ce.detach()) / len(outs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
    optimizer.step()
    return float(loss.detach()), (reg_sum, ce_sum)


# --- evaluation ------------------------------------------------------------------------------------
class _Evaluator:
    """Held-out: the head's chain simulated `eval_positions` drafts deep from every position of the
    answer, per source: top-1 of draft j given drafts 1..j-1 were right, and the expected acceptance
    length 1 + sum_j prod_{i<=j} a_i that greedy verification would see."""

    def __init__(self, data: TrainingData, feats_of, target: _Target, cfg: EagleTrainConfig):
        self.data, self.feats_of, self.target, self.cfg = data, feats_of, target, cfg

    @torch.no_grad()
    def __call__(self, head: EagleHead, progress: Progress, elapsed: float) -> dict:
        began = time.perf_counter()
        head.eval()
        k = self.cfg.eval_positions
        stats: dict[str, torch.Tensor] = {}  # source -> [chain correct x k, chains, reg sum, reg count]
        held = self.data.heldout
        for first in range(0, len(held), self.cfg.batch_size):
            idx = list(range(first, min(first + self.cfg.batch_size, len(held))))
            examples = [held[i] for i in idx]
            batch = _Batch.build([e.tokens for e in examples], self.feats_of("heldout", idx))
            rows = chain_stats(head, batch, self.target, k, [e.start for e in examples], self.cfg)
            for b, s in rows.items():
                source = examples[b].source
                stats[source] = stats.get(source, torch.zeros(k + 3, dtype=torch.float64)) + s
        head.train()
        point = {
            "step": progress.step,
            "elapsed_seconds": round(elapsed, 1),
            "train_seconds": round(progress.train_seconds, 1),
            "tokens_seen": progress.tokens_seen,
            "all": _metrics(sum(stats.values()), k),
            "by_source": {src: _metrics(stats[src], k) for src in sorted(stats)},
        }
        point["eval_seconds"] = round(time.perf_counter() - began, 2)
        logger.info(
            "step %d: held-out acceptance per draft position %s, expected length %.3f",
            progress.step,
            point["all"]["top1"],
            point["all"]["expected_acceptance_length"],
        )
        return point


def chain_stats(
    head: EagleHead, batch: _Batch, target: _Target, k: int, starts: list[int], cfg: EagleTrainConfig
) -> dict[int, torch.Tensor]:
    """Per row of the batch: [k chain-correct counts, chains, depth-1 regression loss sum, its count].
    A chain starts after the real pair p (start <= p, all k labels inside the sequence): draft j is
    depth j's output at p + j - 1, right when its argmax is x_{p+j+1}."""
    valid = batch.pair_valid()
    embeds = target.embeds(batch.tokens[:, 1:])
    with _autocast(cfg):
        outs = unrolled_forward(head, embeds, batch.feats[:, :-1], valid, k)
    length = valid.shape[1]  # T pairs
    correct = []
    for j, out in enumerate(outs, start=1):
        pred = (out.float() @ target.lm_rows.T).argmax(-1)  # [B, T] rows
        pred = pred if target.draft_ids is None else target.draft_ids[pred]
        # chain start p: draft j at q = p + j - 1, label x_{q+2} = tokens[:, p + j + 1]
        shift = j - 1
        got = pred[:, shift:]  # [B, T - shift], index p
        labels = batch.tokens[:, j + 1 :]  # [B, L - j - 1] = [B, T - j], index p
        n = min(got.shape[1], labels.shape[1])
        c = torch.zeros(valid.shape, dtype=torch.bool)
        c[:, :n] = got[:, :n] == labels[:, :n]
        correct.append(c)
    chain = torch.stack(correct).cumprod(0).bool()  # [k, B, T]
    p = torch.arange(length)
    reg = F.smooth_l1_loss(outs[0].float(), batch.feats[:, 1:], reduction="none").mean(-1)  # [B, T]
    out: dict[int, torch.Tensor] = {}
    for b in range(valid.shape[0]):
        ok = (p >= starts[b]) & (p + k + 1 < batch.lengths[b])
        s = torch.zeros(k + 3, dtype=torch.float64)
        s[:k] = chain[:, b, ok].sum(1).double()
        s[k] = float(ok.sum())
        s[k + 1] = float(reg[b][valid[b]].sum())
        s[k + 2] = float(valid[b].sum())
        out[b] = s
    return out


def _metrics(s: torch.Tensor, k: int) -> dict:
    chains = float(s[k])
    chain = [float(s[j] / chains) if chains else 0.0 for j in range(k)]
    conditional = [
        float(s[j] / (s[j - 1] if j else chains)) if (s[j - 1] if j else chains) else 0.0 for j in range(k)
    ]
    return {
        # Draft j's top-1 given drafts 1..j-1 were right: the acceptance probability at position j.
        "top1": [round(x, 4) for x in conditional],
        "chain_acceptance": [round(x, 4) for x in chain],  # drafts 1..j all right
        "expected_acceptance_length": round(1 + sum(chain), 4),
        "feature_loss": round(float(s[k + 1] / s[k + 2]), 5) if s[k + 2] else None,
        "chains": int(chains),
    }


# --- report ----------------------------------------------------------------------------------------
def _report(cfg, arch, data_info, draft_ids, progress, features, stop_reason, run_start) -> dict:
    best = next(p for p in progress.curve if p["step"] == progress.best_step)
    return {
        "method": "eagle",
        "model_path": cfg.model_path,
        "output": str(cfg.output),
        "target": {"hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size},
        "head": {
            "layers": 1,
            "draft_vocab_size": None if draft_ids is None else len(draft_ids),
            "unroll": cfg.unroll,
            "noise": cfg.noise,
        },
        "data": data_info,
        "training": training_summary(cfg, progress, features, stop_reason, run_start),
        # Labels are the data's tokens: on distilled answers the target's greedy choices, so the chain
        # is what greedy verification would accept; on code, agreement with the text.
        "heldout": best,
        "final_step_heldout": progress.curve[-1],
        "curve": progress.curve,  # held-out numbers against training time and tokens seen
    }
