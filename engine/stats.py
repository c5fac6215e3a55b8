"""Engine statistics as plain dataclasses; only the server's exporter turns them into Prometheus metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposer_errors: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_position] if self.num_drafts else []


@dataclass
class StepEvents:
    """Per-step observations for histograms, drained by whoever exports them."""

    acceptance_lengths: list[int] = field(default_factory=list)  # 1 + accepted, per verification
    finished: list[RequestTiming] = field(default_factory=list)


@dataclass
class RequestTiming:
    finish_reason: str
    queue_seconds: float
    ttft_seconds: float | None
    e2e_seconds: float
    inter_token_seconds: list[float]
    prompt_tokens: int
    generation_tokens: int


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    request_success: Counter[str] = field(default_factory=Counter)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    events: StepEvents = field(default_factory=StepEvents)
    num_steps: int = 0

    def drain_events(self) -> StepEvents:
        events, self.events = self.events, StepEvents()
        return events
