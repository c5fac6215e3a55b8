"""The proposer protocol: anything that guesses the next few tokens of running requests.

Built-in proposers live in specserve.plugins (ngram, draft_model, medusa); third parties register
through the entry-point group `specserve.proposers` or are named as `package.module:Class`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .request import Request

if TYPE_CHECKING:
    from .config import EngineConfig
    from .models import LlamaForCausalLM


@dataclass
class ProposalRequest:
    request: Request
    max_num_tokens: int  # k for this request this step (>= 1)
    # Target's final hidden state at the position that produced the request's last token (Medusa).
    last_hidden: torch.Tensor | None = None  # [hidden]


@dataclass
class Proposals:
    token_ids: list[list[int]]  # per request, at most max_num_tokens drafts
    # Per request the draft distribution each token was drawn from, [len, vocab]; None = one-hot.
    probs: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class ProposerContext:
    """What a proposer may use to build itself."""

    config: EngineConfig
    target: LlamaForCausalLM
    vocab_size: int  # the target's (sampling) vocabulary
    device: torch.device
    dtype: torch.dtype
    block_size: int
    cache_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Proposer(Protocol):
    name: str
    needs_hidden_states: bool

    def propose(self, batch: list[ProposalRequest]) -> Proposals: ...


class ProposerError(ValueError):
    """A proposer cannot be built (bad name, bad path, incompatible draft): a start-up error."""
