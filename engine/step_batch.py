"""What one engine step works on: each in-flight request's engine-side state, and the window batch.

The window batch is built once per step from the scheduler's output and the proposals. It holds the
target's input (one `SequenceInput` per scheduled request: its next prompt chunk, or its last token
followed by its drafts) and, for every request that samples this step, its verification window with
the logits rows that belong to it, so no later phase recomputes row offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .detokenizer import IncrementalDetokenizer
from .grammar import GrammarMatcher
from .random_streams import RequestRandom
from .request import Request
from .runner import SequenceInput
from .scheduler import ScheduledRequest


@dataclass
class RequestState:
    """Everything the engine core keeps for one in-flight request."""

    request: Request
    detokenizer: IncrementalDetokenizer
    random: RequestRandom  # the request's keyed random streams (its seed, or one the engine drew)
    token_times: list[float] = field(default_factory=list)  # monotonic time of each emitted token
    # Target's final hidden state at the row that produced the last token (for needs_hidden_states).
    last_hidden: torch.Tensor | None = None  # [hidden]
    grammar: GrammarMatcher | None = None  # structured output: the grammar after the committed output
    forced_next: list[int] = field(default_factory=list)  # tokens the grammar forces next (free drafts)


@dataclass
class Draft:
    """A validated proposal for one request: token ids and the distributions they came from."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [len(token_ids), V] or None (one-hot)
    num_forced: int = 0  # the last num_forced tokens were forced by the grammar, not proposed
    cut: tuple[int, torch.Tensor] | None = None  # (first forbidden draft, its q row [V]): verifier.py

    @property
    def num_proposed(self) -> int:
        return len(self.token_ids) - self.num_forced


@dataclass
class VerificationWindow:
    """A request that samples this step: logits rows [first_row, first_row + len(drafts) + 1)."""

    state: RequestState
    draft: Draft
    first_row: int
    hidden_row: int = 0  # with all hidden states: row of this request's first fed token in them
    num_new_tokens: int = 1  # tokens fed besides the drafts (1 in decode; a prefill's last chunk)

    @property
    def num_rows(self) -> int:
        return len(self.draft.token_ids) + 1

    @property
    def rows(self) -> slice:
        return slice(self.first_row, self.first_row + self.num_rows)


@dataclass
class WindowBatch:
    scheduled: list[ScheduledRequest]
    sequences: list[SequenceInput]  # one per scheduled request, in order: the target's input
    windows: list[VerificationWindow]  # the scheduled requests that sample, in logits-row order
    num_rows: int  # logits rows the target returns: sum of the windows' rows
    # With all hidden states (a proposer that reads every feature): the target returns a hidden row
    # for every fed token; `hidden_starts[i]` is sequence i's first row there and `window_rows`
    # [num_rows] picks the windows' rows out of them for the logits. None: hidden rows = window rows.
    hidden_starts: list[int] | None = None
    window_rows: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        scheduled: list[ScheduledRequest],
        states: dict[str, RequestState],
        drafts: dict[str, Draft],
        all_hidden: bool = False,
    ) -> WindowBatch:
        sequences: list[SequenceInput] = []
        windows: list[VerificationWindow] = []
        row = 0
        hidden_starts: list[int] = []
        window_rows: list[int] = []
        hidden_row = 0
        for s in scheduled:
            req = s.request
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start : start + s.num_new_tokens]
            # A request samples once this step's tokens reach its end (decode, or a prefill's last chunk).
            samples = start + s.num_new_tokens == req.num_tokens
            draft = drafts.get(req.request_id, Draft([], None)) if samples else Draft([], None)
            window = (
                VerificationWindow(states[req.request_id], draft, row, hidden_row, len(tokens))
                if samples
                else None
            )
            fed = tokens + draft.token_ids
            num_outputs = len(fed) if all_hidden else (window.num_rows if window else 0)
            sequences.append(SequenceInput(fed, start, req.block_ids, num_outputs))
            hidden_starts.append(hidden_row)
            if window is not None:
                windows.append(window)
                row += window.num_rows
                # the window's rows: its last token (or chunk's last) and the drafts, at the end
                first = hidden_row + len(fed) - window.num_rows
                window_rows += range(first, first + window.num_rows)
            hidden_row += num_outputs
        if not all_hidden:
            return cls(scheduled, sequences, windows, row)
        return cls(
            scheduled, sequences, windows, row, hidden_starts, torch.tensor(window_rows, dtype=torch.long)
        )
