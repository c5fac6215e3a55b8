"""The proposer contract: the one thing a proposer (built-in or plugin) implements.

A proposer guesses the next few tokens of running requests; the target verifies them. Subclass
`Proposer`, implement `propose`, and override only the hooks you need (every hook has a no-op
default). The engine calls the hooks, and never probes a proposer for attributes.

When each hook is called, in the life of one request:

    bind_kv_cache(num_slots)           once at start-up, after the KV pool is sized
    propose(batch)                     every step the request decodes with k >= 1 draft slots
    on_hidden_states(request, p, h)    every step the target verified positions of the request (only
                                       for proposers with needs_all_hidden_states)
    on_accepted(request, n)            every step the request samples a token (n accepted drafts, 0..k)
    on_preempted(request)              its KV blocks were freed; it will be recomputed from scratch
    on_finished(request)               finished for any reason (stop, length, abort, error)

Exactness rules (what keeps speculative decoding lossless):
- `Proposals.probs[i]` is exactly the distribution draft token j of request i was sampled from
  ([num_drafts, vocab], rows summing to 1), or None when the drafts are deterministic (n-gram,
  greedy): the verifier then treats each draft as one-hot. A q that is not the sampling distribution
  breaks exactness silently, so the engine checks shape, finiteness, sign and row sums and drops a
  request's drafts (it decodes plainly this step) when they are off.
- Greedy requests (`request.params.greedy`) should get the draft's argmax and probs None.
- Drafts are token ids in [0, vocab_size); at most `num_speculative_tokens` per request.

KV slots: a proposer that keeps its own KV (a draft model) declares `kv_bytes_per_token()`; the
pool is sized for target + proposer bytes per slot, and `bind_kv_cache(num_slots)` hands it the slot
count (allocate exactly that many: the last one is the reserved padding slot that `forward_sequences`
reads for attention padding and nothing writes). It then writes at the request's own slots:
`request.block_ids` map position p to slot `block_ids[p // block_size] * block_size + p % block_size`,
the same slots the target uses.

Proposers are found by name through the entry-point group `specserve.proposers` (the built-ins are
declared there too, in pyproject.toml) or as `package.module:Class`: see `proposer_registry.py` and
docs/plugins.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .proposer_registry import ProposerError as ProposerError  # defined torch-free, raised by plugins
from .random_streams import RequestRandom
from .request import Request
from .spec_controller import Preview
from .step_cost_model import DraftCostProfile

if TYPE_CHECKING:
    from .config import EngineConfig
    from .models import CausalDecoder


@dataclass
class ProposalRequest:
    request: Request
    num_speculative_tokens: int  # k for this request this step (>= 1): propose at most this many
    # Target's final hidden state at the position that produced the request's last token (Medusa).
    # Set only for proposers with needs_hidden_states.
    last_hidden: torch.Tensor | None = None  # [hidden]
    # The request's random streams. A sampled draft for output position p (the first draft is at
    # len(request.output_token_ids)) draws with random.sample(q, p, Purpose.DRAFT), so the same
    # seed drafts the same tokens however the engine batches or windows the request. The engine
    # always sets it.
    random: RequestRandom | None = None
    # For a proposer whose previews say it stops where unsure (Preview.stops_unsure): end the window
    # after the first draft at which the product of the draft probabilities of its drafts so far is
    # below this (0: draft all num_speculative_tokens). Set by the speculation controller.
    stop_below: float = 0.0


@dataclass
class Proposals:
    token_ids: list[list[int]]  # per request of the batch, in order: at most k drafts
    # Per request the draft distribution each token was drawn from, [num_drafts, vocab]; None = one-hot.
    probs: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class ProposerContext:
    """What a proposer may use to build itself."""

    config: EngineConfig
    target: CausalDecoder
    vocab_size: int  # the target's (sampling) vocabulary
    device: torch.device
    dtype: torch.dtype
    block_size: int
    cache_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # "tokenizer": the target's Tokenizer


class Proposer:
    """Base class of every proposer. Subclasses set `name` and implement `propose`."""

    name: str = "unnamed"
    # True: the engine keeps the target's last hidden state per request and passes it in
    # ProposalRequest.last_hidden (heads that read the target's features: Medusa, EAGLE).
    needs_hidden_states: bool = False
    # True: the engine hands over the target's final hidden state of EVERY position it verifies
    # (prompt chunks, the last token, accepted drafts) through `on_hidden_states` (EAGLE: its head
    # reads the feature sequence, not just the last one).
    needs_all_hidden_states: bool = False

    def __init__(self, ctx: ProposerContext) -> None:
        self.ctx = ctx

    def propose(self, batch: list[ProposalRequest]) -> Proposals:
        """Guess up to `item.num_speculative_tokens` tokens for each request of `batch`.

        Called from the engine's worker thread once per step. May read the requests (tokens, params,
        block ids) but must not modify them; keep per-request state in the proposer, keyed by
        `request.request_id`, and let the hooks below maintain it. An exception here costs speed,
        not correctness: the step decodes without drafts and the error is counted."""
        raise NotImplementedError

    def preview(self, request: Request, max_drafts: int) -> Preview | None:
        """What `propose` would give `request` now with at most `max_drafts` drafts, if the proposer
        can tell without drafting (an n-gram lookup can; a model cannot): the number of drafts and a
        class of the proposal (`hint`, a small int) whose acceptance the speculation controller
        tracks separately. Called by the scheduler for every adaptive request in decode, every step,
        so it must be cheap. None (the default): cannot tell; the controller uses the request's
        overall acceptance. A preview that raises or is malformed is ignored (counted as a proposer
        error)."""
        return None

    # --- memory --------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache this proposer keeps per token slot (0: none). Read once at start-up."""
        return 0

    def weight_bytes(self) -> int:
        """Bytes of weights this proposer holds besides the target's (counted before KV sizing)."""
        return 0

    def step_weight_bytes(self) -> int:
        """Bytes of weights one draft step reads: before the speculation controller has timed a
        draft step, it prices one at this share of the target's weights. Default: all it holds."""
        return self.weight_bytes()

    def bind_kv_cache(self, num_slots: int) -> None:
        """Allocate the proposer's KV for `num_slots` slots (only called when kv_bytes_per_token > 0)."""

    def profile_cost(self, max_requests: int) -> DraftCostProfile | None:
        """Time a draft step (for 1..max_requests requests) and a catch-up token at start-up, after
        `bind_kv_cache`, before any request: the speculation controller prices drafts at this until
        it has timed real ones. None (the default): it prices them by `step_weight_bytes` instead.
        A proposer that drafts without model work (a lookup) has nothing to time."""
        return None

    # --- request lifecycle ---------------------------------------------------------------------
    def on_accepted(self, request: Request, num_accepted: int) -> None:
        """After every step in which the request sampled (a decode, or its prefill's last chunk):
        `num_accepted` of this step's drafts were kept (0 when it had none, or the engine dropped
        them). `request.num_computed_tokens` already counts them, so any proposer state past that
        position is stale."""

    def on_hidden_states(self, request: Request, start_position: int, hidden: torch.Tensor) -> None:
        """Only with `needs_all_hidden_states`: `hidden` [n, hidden] are the target's final-normed hidden
        states at the request's positions start_position .. start_position + n - 1, all verified (the
        tokens there are the request's). Called after the forward, before `on_accepted`; consecutive
        calls continue where the previous one ended, except after a prefix-cache hit (the cached
        positions get none) or a preemption."""

    def on_preempted(self, request: Request) -> None:
        """The request lost its KV blocks and will be recomputed: forget its cached state."""

    def on_finished(self, request: Request) -> None:
        """The request is done (any reason): release its per-request state."""
