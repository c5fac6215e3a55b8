"""Engine statistics as plain dataclasses; only the server's exporter turns them into Prometheus metrics.

`EngineStats` is what the engine mutates while it steps; `EngineSnapshot` is what everything else reads
(one frozen copy, taken by `EngineCore.snapshot()`). The acceptance formulas live here once, as pure
functions, and serve the per-request stats, the exporter's log line and the API's usage block alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float:
    """Accepted drafts / proposed drafts (0 when nothing was proposed)."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


def mean_acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """Tokens emitted per verification: 1 (the recovered/bonus token) + accepted drafts (1 without drafts)."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts else 1.0


def per_position_acceptance(accepted_per_position: Sequence[int], num_drafts: int) -> list[float]:
    """Share of verifications that accepted the draft at each position (0 = first)."""
    return [a / num_drafts for a in accepted_per_position] if num_drafts else []


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposer_errors: int = 0
    # Drafts a grammar forced (structured output) that were accepted; also counted in the totals above.
    num_forced_tokens: int = 0
    grammar_seconds: float = 0.0  # structured output: masks, draft checks, commits (finished requests)
    # k the scheduler gave decoding requests (0 included): how much the controller let them draft.
    num_k_decisions: int = 0
    sum_k: int = 0
    # The adaptive controller's predictions against what happened, summed over the steps it decided.
    controller_steps: int = 0
    quiet_steps: int = 0  # of which it drafted nothing without weighing (a quiet spell)
    predicted_tokens: float = 0.0
    measured_tokens: int = 0
    predicted_step_seconds: float = 0.0  # the cost model's price of each step as it ran
    measured_step_seconds: float = 0.0

    def record_k(self, k: int) -> None:
        self.num_k_decisions += 1
        self.sum_k += k

    @property
    def mean_k(self) -> float:
        """Mean drafts allowed per decoding step (0 when it never decoded with a proposer)."""
        return self.sum_k / self.num_k_decisions if self.num_k_decisions else 0.0

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
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_accepted_tokens, self.num_drafts)

    def per_position_acceptance(self) -> list[float]:
        return per_position_acceptance(self.accepted_per_position, self.num_drafts)


# Per-step observations kept while no exporter drains them (a few MB at most).
MAX_UNDRAINED_EVENTS = 100_000


@dataclass
class StepEvents:
    """Per-step observations for histograms, drained by whoever exports them.

    The lists only ever grow at the end. A step in the worker thread that raced with a drain may still
    append one item to the events it had in hand, so a consumer re-reads the last drained events once.
    """

    acceptance_lengths: list[int] = field(default_factory=list)  # 1 + accepted, per verification
    chosen_k: list[int] = field(default_factory=list)  # k per decoding request per step
    # (sequences, tokens, predicted s, measured s) of each target forward the cost model saw
    forward_costs: list[tuple[int, int, float, float]] = field(default_factory=list)
    finished: list[RequestTiming] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)  # every step as it ran


@dataclass(frozen=True)
class StepRecord:
    """One engine step as it ran: what it held, where its time went, what it emitted, and what the
    speculation controller expected of it (benchmarks/step_ledger.py adds these up per kind of step)."""

    num_sequences: int
    num_tokens: int  # tokens the target ran: windows and prefill chunks
    prefill_tokens: int  # of which prefill chunks
    drafting: int  # requests with drafts
    draft_tokens: int  # drafts verified
    probes: int  # drafting requests whose one draft was the controller's probe
    setup_tokens: int  # tokens proposers fed to catch up before drafting
    emitted_tokens: int
    draft_seconds: float
    forward_seconds: float
    step_seconds: float
    predicted_tokens: float | None = None  # the controller's expectation (None: it did not decide)
    predicted_seconds: float | None = None
    quiet: bool = False  # the controller drafted nothing without weighing (a quiet spell)
    # The decision's reasons (spec_controller.Decision; None where it did not weigh): its best drafting
    # plan's goodput over the bar, the bar's factor over plain decode, the costly drafts' calibration.
    headroom: float | None = None
    required_gain: float | None = None
    gain_factor: float | None = None
    # Drafts the step's windows allowed (the k it scheduled): more than draft_tokens where a proposer
    # ended windows early (Decision.stop_below) or had fewer to give.
    window_tokens: int = 0


@dataclass
class RequestTiming:
    finish_reason: str
    queue_seconds: float
    ttft_seconds: float | None
    e2e_seconds: float
    inter_token_seconds: list[float]
    prompt_tokens: int
    generation_tokens: int


@dataclass(frozen=True)
class EngineSnapshot:
    """Everything the metrics exporter and the stats log line read from the engine, read once.

    Counters are cumulative since the engine started (a reader exports differences between two
    snapshots); gauges are the values at the time of the snapshot; `events` are the per-step events
    drained by this snapshot (see StepEvents for why they may still grow by one late item).
    The defaults are an engine that has done nothing, the baseline of the first difference.
    """

    # --- cumulative counters ------------------------------------------------------------------
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposer_errors: int = 0
    num_forced_tokens: int = 0
    grammar_seconds: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    request_success: Mapping[str, int] = field(default_factory=dict)  # finish reason -> requests
    nonfinite_logits_requests: int = 0
    # the adaptive controller's predictions and what happened, over the steps it decided
    controller_steps: int = 0
    controller_quiet_steps: int = 0
    controller_predicted_tokens: float = 0.0
    controller_measured_tokens: int = 0
    controller_predicted_step_seconds: float = 0.0
    controller_measured_step_seconds: float = 0.0
    # --- gauges -------------------------------------------------------------------------------
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0-1
    num_speculative_tokens: int = 0  # the cap K_max (0 = no speculation)
    # --- static configuration -----------------------------------------------------------------
    block_size: int = 0
    num_blocks: int = 0
    device_memory_utilization: float = 0.0
    proposer_name: str = "none"
    # --- drained per-step events --------------------------------------------------------------
    events: StepEvents = field(default_factory=StepEvents)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    request_success: Counter[str] = field(default_factory=Counter)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    events: StepEvents = field(default_factory=StepEvents)
    # Requests failed because their logits held NaN/inf (the rest of their batch carried on).
    nonfinite_logits_requests: int = 0

    def drain_events(self) -> StepEvents:
        events, self.events = self.events, StepEvents()
        return events

    def bound_events(self, limit: int = MAX_UNDRAINED_EVENTS) -> bool:
        """Drop the per-step events when nobody has drained them for `limit` observations (an
        offline LLM run, a server nobody scrapes), so they cannot grow without end. Dropping is a
        drain whose result is thrown away: the exporter's accounting stays consistent. True if dropped."""
        e = self.events
        longest = max(
            len(e.acceptance_lengths), len(e.chosen_k), len(e.forward_costs), len(e.finished), len(e.steps)
        )
        if longest <= limit:
            return False
        self.drain_events()
        return True

    def snapshot(
        self,
        *,
        prefix_cache_queries: int,
        prefix_cache_hits: int,
        num_running: int,
        num_waiting: int,
        kv_cache_usage: float,
        num_speculative_tokens: int,
        block_size: int,
        num_blocks: int,
        device_memory_utilization: float,
        proposer_name: str,
    ) -> EngineSnapshot:
        """These counters read once plus what the engine core adds, draining the per-step events.

        May run on the event loop while a step mutates these stats in the worker thread: each field is
        read once (copies, not live lists), so two snapshots' differences never lose or double-count.
        """
        spec = self.spec
        return EngineSnapshot(
            num_drafts=spec.num_drafts,
            num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            accepted_per_position=tuple(spec.accepted_per_position),
            draft_seconds=spec.draft_seconds,
            verify_seconds=spec.verify_seconds,
            proposer_errors=spec.proposer_errors,
            num_forced_tokens=spec.num_forced_tokens,
            grammar_seconds=spec.grammar_seconds,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix_cache_queries,
            prefix_cache_hits=prefix_cache_hits,
            request_success=dict(self.request_success),
            nonfinite_logits_requests=self.nonfinite_logits_requests,
            controller_steps=spec.controller_steps,
            controller_quiet_steps=spec.quiet_steps,
            controller_predicted_tokens=spec.predicted_tokens,
            controller_measured_tokens=spec.measured_tokens,
            controller_predicted_step_seconds=spec.predicted_step_seconds,
            controller_measured_step_seconds=spec.measured_step_seconds,
            num_running=num_running,
            num_waiting=num_waiting,
            kv_cache_usage=kv_cache_usage,
            num_speculative_tokens=num_speculative_tokens,
            block_size=block_size,
            num_blocks=num_blocks,
            device_memory_utilization=device_memory_utilization,
            proposer_name=proposer_name,
            events=self.drain_events(),
        )
