"""Medusa-1 proposer: extra heads on the target's last hidden state guess tokens t+2, t+3, ...

Checkpoint layout (FasterDecoding/Medusa): a directory with config.json (`medusa_num_heads`,
`medusa_num_layers`, `hidden_size`) and `medusa_lm_head.safetensors` holding, for head i,
`{i}.{j}.linear.weight/bias` for its j-th ResBlock and `{i}.{num_layers}.weight` for its vocab
projection. A ResBlock is x + SiLU(W x + b). Head i applied to the hidden state that produced the
last token proposes the token i+1 places after it, so k heads give a k-token chain in one shot.
(In training terms: head i at position t predicts token t + i + 2; the target's own LM head at t
predicts t + 1.)

Truncated vocabulary (FR-Spec; written by `specserve train-draft --draft-vocab-size N`):
`draft_vocab.safetensors` holds `token_ids` [N], the target ids of the projection's N rows. The heads
then score only those N tokens; a sampled draft's q is the full-vocabulary distribution with zeros
outside them, exactly what the token was drawn from, so verification stays lossless.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.engine.memory import module_bytes
from specserve.engine.proposer import ProposalRequest, Proposals, Proposer, ProposerContext, ProposerError
from specserve.engine.random_streams import Purpose
from specserve.engine.sampler import logits_to_probs

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_lm_head.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def build_heads(num_heads: int, num_layers: int, hidden: int, vocab: int) -> nn.ModuleList:
    """`vocab`: rows of each head's projection (the target's vocabulary, or the draft vocabulary)."""
    return nn.ModuleList(
        nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads)
    )


def save_medusa_heads(
    path: Path, heads: nn.ModuleList, num_layers: int, config: dict, draft_ids: torch.Tensor | None
) -> None:
    """Write `heads` in the layout `load_medusa_heads` reads (plus `config`'s extra keys)."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE))
    vocab_file = path / DRAFT_VOCAB_FILE
    if draft_ids is not None:
        save_file({"token_ids": draft_ids.to(torch.int64).contiguous()}, str(vocab_file))
    elif vocab_file.exists():
        vocab_file.unlink()  # a stale map from an earlier run would silently relabel the rows
    hidden = heads[0][-1].weight.shape[1]
    meta = {"medusa_num_heads": len(heads), "medusa_num_layers": num_layers, "hidden_size": hidden}
    if draft_ids is not None:
        meta["draft_vocab_size"] = len(draft_ids)  # informative: draft_vocab.safetensors is what counts
    (path / CONFIG_FILE).write_text(json.dumps({**config, **meta}, indent=2) + "\n")


def load_medusa_heads(path: Path, hidden: int, vocab: int) -> tuple[nn.ModuleList, dict, torch.Tensor | None]:
    """Heads, their config and the draft vocabulary ([N] target ids, None = the full vocabulary).
    Every mismatch with the target is a one-line ProposerError."""
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.exists() or not weights.exists():
        raise ProposerError(f"{path} is not a Medusa head checkpoint (needs {CONFIG_FILE} + {WEIGHTS_FILE})")
    cfg = json.loads(cfg_file.read_text())
    num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    if int(cfg.get("hidden_size", hidden)) != hidden:
        raise ProposerError(f"Medusa heads are for hidden size {cfg['hidden_size']}, the target has {hidden}")
    if int(cfg.get("vocab_size", vocab)) != vocab:
        raise ProposerError(
            f"Medusa heads are for a vocabulary of {cfg['vocab_size']} tokens, the target has {vocab}"
        )
    state = {k.removeprefix("medusa_head."): v for k, v in load_file(str(weights)).items()}
    draft_ids = _load_draft_vocab(path / DRAFT_VOCAB_FILE, vocab)
    rows = vocab if draft_ids is None else len(draft_ids)
    projection = state.get(f"0.{num_layers}.weight")
    if projection is not None and projection.dim() == 2 and projection.shape[1] != hidden:
        raise ProposerError(
            f"Medusa heads read hidden states of size {projection.shape[1]}, the target has {hidden}"
        )
    if projection is not None and projection.dim() == 2 and projection.shape[0] != rows:
        what = (
            f"its draft vocabulary of {rows}"
            if draft_ids is not None
            else f"the target's vocabulary of {vocab}"
        )
        raise ProposerError(
            f"Medusa heads project onto {projection.shape[0]} tokens, not {what} (wrong checkpoint for this target?)"
        )
    heads = build_heads(num_heads, num_layers, hidden, rows)
    try:
        heads.load_state_dict(state)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())  # torch's message spans lines: keep it to one
        raise ProposerError(f"Medusa checkpoint does not fit the target: {detail[:300]}") from exc
    return heads, cfg, draft_ids


def _load_draft_vocab(path: Path, vocab: int) -> torch.Tensor | None:
    if not path.exists():
        return None
    ids = load_file(str(path)).get("token_ids")
    if ids is None or ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise ProposerError(f"{path} needs a non-empty 1-D integer tensor 'token_ids'")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ProposerError(f"{path} names token ids outside the target's vocabulary [0, {vocab})")
    if ids.unique().numel() != ids.numel():
        raise ProposerError(f"{path} names a token id twice")
    return ids


class MedusaProposer(Proposer):
    name = "medusa"
    needs_hidden_states = True

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        path = ctx.config.medusa_heads_path or ctx.config.speculative_head_path
        if not path:
            raise ProposerError(
                "--speculative-method medusa needs --speculative-head-path (or --medusa-heads-path)"
            )
        cfg = ctx.target.config
        heads, _, draft_ids = load_medusa_heads(Path(path), cfg.hidden_size, cfg.vocab_size)
        self.heads = heads.to(device=ctx.device, dtype=ctx.dtype).eval().requires_grad_(False)
        self.num_heads = len(self.heads)
        self.vocab_size = cfg.vocab_size
        # [N] target ids of the projection rows; None: the rows are the target's vocabulary
        self.draft_ids = None if draft_ids is None else draft_ids.to(ctx.device)

    def weight_bytes(self) -> int:
        return module_bytes(self.heads)

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        items = [b for b in batch if b.last_hidden is not None]
        if not items:
            return Proposals([[] for _ in batch], [None] * len(batch))
        hidden = torch.stack([b.last_hidden for b in items])  # [B, hidden]
        k = min(self.num_heads, max(b.num_speculative_tokens for b in items))
        with torch.inference_mode():
            # [B, k, N]: N = the draft vocabulary's size, or the target's vocabulary
            head_logits = torch.stack([self.heads[i](hidden).float() for i in range(k)], dim=1)
        by_id = {}
        for row, item in enumerate(items):
            n = min(k, item.num_speculative_tokens)
            params = item.request.params
            if params.greedy:
                by_id[id(item)] = (self._to_target_ids(head_logits[row, :n].argmax(-1)), None)
                continue
            probs = logits_to_probs(head_logits[row, :n], [params] * n)  # [n, N]
            if item.random is None:
                raise ValueError(
                    f"request {item.request.request_id}: sampled drafts need ProposalRequest.random"
                )
            # Head i guesses the token at output position p0 + i: draw it with that position's DRAFT value.
            p0 = len(item.request.output_token_ids)
            drawn = [item.random.sample(p, p0 + i, Purpose.DRAFT) for i, p in enumerate(probs)]
            rows = torch.tensor(drawn, device=probs.device)
            by_id[id(item)] = (self._to_target_ids(rows), self._to_target_vocab(probs))
        tokens = [by_id.get(id(b), ([], None))[0] for b in batch]
        probs_out = [by_id.get(id(b), ([], None))[1] for b in batch]
        return Proposals(tokens, probs_out)

    def _to_target_ids(self, rows: torch.Tensor) -> list[int]:  # [n] projection rows -> target ids
        return (rows if self.draft_ids is None else self.draft_ids[rows]).tolist()

    def _to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:  # [n, N] -> [n, vocab]
        """q over the whole vocabulary: the draft distribution, zero outside the draft vocabulary."""
        if self.draft_ids is None:
            return probs
        full = torch.zeros(probs.shape[0], self.vocab_size, dtype=probs.dtype, device=probs.device)
        full[:, self.draft_ids] = probs
        return full
