"""Medusa-1 proposer: extra heads on the target's last hidden state guess tokens t+2, t+3, ...

Checkpoint layout (FasterDecoding/Medusa): a directory with config.json (`medusa_num_heads`,
`medusa_num_layers`, `hidden_size`) and `medusa_lm_head.safetensors` holding, for head i,
`{i}.{j}.linear.weight/bias` for its j-th ResBlock and `{i}.{num_layers}.weight` for its vocab
projection. A ResBlock is x + SiLU(W x + b). Head i applied to the hidden state that produced the
last token proposes the token i+1 places after it, so k heads give a k-token chain in one shot.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from specserve.engine.memory import module_bytes
from specserve.engine.proposer import ProposalRequest, Proposals, Proposer, ProposerContext, ProposerError
from specserve.engine.random_streams import Purpose
from specserve.engine.sampler import logits_to_probs


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def build_heads(num_heads: int, num_layers: int, hidden: int, vocab: int) -> nn.ModuleList:
    return nn.ModuleList(
        nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads)
    )


def load_medusa_heads(path: Path, hidden: int, vocab: int) -> tuple[nn.ModuleList, dict]:
    cfg_file = path / "config.json"
    weights = path / "medusa_lm_head.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise ProposerError(
            f"{path} is not a Medusa head checkpoint (needs config.json + medusa_lm_head.safetensors)"
        )
    cfg = json.loads(cfg_file.read_text())
    num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    if int(cfg.get("hidden_size", hidden)) != hidden:
        raise ProposerError(f"Medusa heads are for hidden size {cfg['hidden_size']}, the target has {hidden}")
    heads = build_heads(num_heads, num_layers, hidden, vocab)
    state = {k.removeprefix("medusa_head."): v for k, v in load_file(str(weights)).items()}
    try:
        heads.load_state_dict(state)
    except RuntimeError as exc:
        raise ProposerError(f"Medusa checkpoint does not fit the target: {str(exc).splitlines()[0]}") from exc
    return heads, cfg


class MedusaProposer(Proposer):
    name = "medusa"
    needs_hidden_states = True

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        if not ctx.config.medusa_heads_path:
            raise ProposerError("--speculative-method medusa needs --medusa-heads-path")
        cfg = ctx.target.config
        heads, _ = load_medusa_heads(Path(ctx.config.medusa_heads_path), cfg.hidden_size, cfg.vocab_size)
        self.heads = heads.to(device=ctx.device, dtype=ctx.dtype).eval().requires_grad_(False)
        self.num_heads = len(self.heads)

    def weight_bytes(self) -> int:
        return module_bytes(self.heads)

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        items = [b for b in batch if b.last_hidden is not None]
        if not items:
            return Proposals([[] for _ in batch], [None] * len(batch))
        hidden = torch.stack([b.last_hidden for b in items])  # [B, hidden]
        k = min(self.num_heads, max(b.num_speculative_tokens for b in items))
        with torch.inference_mode():
            head_logits = torch.stack([self.heads[i](hidden).float() for i in range(k)], dim=1)  # [B, k, V]
        by_id = {}
        for row, item in enumerate(items):
            n = min(k, item.num_speculative_tokens)
            params = item.request.params
            if params.greedy:
                by_id[id(item)] = (head_logits[row, :n].argmax(-1).tolist(), None)
                continue
            probs = logits_to_probs(head_logits[row, :n], [params] * n)  # [n, V]
            if item.random is None:
                raise ValueError(
                    f"request {item.request.request_id}: sampled drafts need ProposalRequest.random"
                )
            # Head i guesses the token at output position p0 + i: draw it with that position's DRAFT value.
            p0 = len(item.request.output_token_ids)
            tokens = [item.random.sample(p, p0 + i, Purpose.DRAFT) for i, p in enumerate(probs)]
            by_id[id(item)] = (tokens, probs)
        tokens = [by_id.get(id(b), ([], None))[0] for b in batch]
        probs_out = [by_id.get(id(b), ([], None))[1] for b in batch]
        return Proposals(tokens, probs_out)
