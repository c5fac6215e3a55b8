"""Prometheus exporter: turns the engine's plain stats dataclasses into metrics after every step.

Names mirror vLLM v1 with the prefix `specserve:` so dashboards port by a prefix change
(prometheus-client appends `_total` to counters, `_bucket`/`_sum`/`_count` to histograms and `_info`
to the info metric). Every series carries `model_name`; speculative-decoding series also carry
`proposer`. One CollectorRegistry per server (no global registry), so several servers can live in
one process.

`update()` runs on the event loop, after each engine step and on every scrape, possibly while the
next step runs in the worker thread. It therefore reads each engine counter once (a snapshot) and
exports the difference to the previous snapshot, so nothing is lost or counted twice whatever it
races with; the drained per-step events are re-checked once for items appended late.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from specserve.engine.engine_core import EngineCore
from specserve.engine.request import FinishReason
from specserve.engine.stats import StepEvents

logger = logging.getLogger("specserve.stats")
CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_MAX_SPEC_TOKENS = 32  # the engine's bound on k (EngineConfig.validate)


@dataclass(frozen=True)
class _Snapshot:
    """The engine's cumulative counters, read once."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    proposer_errors: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    @classmethod
    def of(cls, core: EngineCore) -> _Snapshot:
        st, pool = core.stats, core.kv_manager.pool
        spec = st.spec
        return cls(
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            tuple(spec.accepted_per_position),
            spec.draft_seconds,
            spec.verify_seconds,
            spec.proposer_errors,
            st.prompt_tokens,
            st.generation_tokens,
            st.num_preemptions,
            pool.num_queries,
            pool.num_hits,
        )


class MetricsExporter:
    def __init__(self, model_name: str, core: EngineCore):
        self.registry = CollectorRegistry()
        # process_resident_memory_bytes & co.: what a soak watches for leaks (Linux /proc based).
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        self.proposer = core.proposer_name
        r, m = self.registry, ["model_name"]
        sm = ["model_name", "proposer"]
        # --- speculative decoding (labels model_name, proposer) -------------------------------
        self.spec_num_drafts = Counter(
            "specserve:spec_decode_num_drafts", "Verification steps with drafts", sm, registry=r
        )
        self.spec_num_draft_tokens = Counter(
            "specserve:spec_decode_num_draft_tokens", "Draft tokens proposed", sm, registry=r
        )
        self.spec_num_accepted = Counter(
            "specserve:spec_decode_num_accepted_tokens", "Draft tokens accepted", sm, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "specserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0 = first)",
            [*sm, "position"],
            registry=r,
        )
        self.spec_draft_seconds = Counter(
            "specserve:spec_decode_draft_seconds", "Time spent proposing drafts", sm, registry=r
        )
        self.spec_verify_seconds = Counter(
            "specserve:spec_decode_verify_seconds",
            "Time spent in target forward passes that verify drafts",
            sm,
            registry=r,
        )
        self.spec_errors = Counter(
            "specserve:spec_decode_proposer_errors", "Proposer failures (fell back to plain)", sm, registry=r
        )
        self.spec_k = Gauge(
            "specserve:spec_decode_num_speculative_tokens",
            "Current max draft tokens per verification (k; 0 = no speculation)",
            sm,
            registry=r,
        )
        self.spec_accept_len = Histogram(
            "specserve:spec_decode_acceptance_length",
            "Tokens emitted per verification (1 + accepted drafts)",
            sm,
            buckets=tuple(range(1, _MAX_SPEC_TOKENS + 2)),
            registry=r,
        )
        # --- tokens, requests, cache (label model_name) --------------------------------------
        self.prompt_tokens = Counter(
            "specserve:prompt_tokens", "Prompt tokens of finished requests", m, registry=r
        )
        self.generation_tokens = Counter("specserve:generation_tokens", "Generated tokens", m, registry=r)
        self.preemptions = Counter("specserve:num_preemptions", "Requests preempted", m, registry=r)
        self.request_success = Counter(
            "specserve:request_success", "Finished requests", [*m, "finished_reason"], registry=r
        )
        self.prefix_queries = Counter(
            "specserve:prefix_cache_queries", "Prefix cache block lookups", m, registry=r
        )
        self.prefix_hits = Counter("specserve:prefix_cache_hits", "Prefix cache block hits", m, registry=r)
        self.running = Gauge("specserve:num_requests_running", "Requests running", m, registry=r)
        self.waiting = Gauge("specserve:num_requests_waiting", "Requests waiting", m, registry=r)
        self.kv_usage = Gauge("specserve:kv_cache_usage_perc", "KV cache usage (0-1)", m, registry=r)
        self.cache_info = Info("specserve:cache_config", "KV cache configuration", registry=r)

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=_LATENCY_BUCKETS, registry=r)

        self.ttft = latency("specserve:time_to_first_token_seconds", "Time to first token")
        self.itl = latency("specserve:inter_token_latency_seconds", "Inter-token latency")
        self.e2e = latency("specserve:e2e_request_latency_seconds", "End-to-end request latency")
        self.queue_time = latency(
            "specserve:request_queue_time_seconds", "Time waiting before first schedule"
        )

        self.cache_info.info(
            {
                "block_size": str(core.config.block_size),
                "num_blocks": str(core.num_blocks),
                "device_memory_utilization": str(core.config.device_memory_utilization),
            }
        )
        # Every series exists from the start (at 0), so rate() and the dashboard work before traffic.
        k = core.scheduler.config.num_speculative_tokens
        self.spec_k.labels(model_name, self.proposer).set(k)
        for c in (
            self.spec_num_drafts,
            self.spec_num_draft_tokens,
            self.spec_num_accepted,
            self.spec_draft_seconds,
            self.spec_verify_seconds,
            self.spec_errors,
            self.spec_accept_len,
        ):
            c.labels(model_name, self.proposer)
        for pos in range(k):
            self.spec_accepted_per_pos.labels(model_name, self.proposer, str(pos))
        for c in (
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
        ):
            c.labels(model_name)
        for reason in FinishReason:
            self.request_success.labels(model_name, reason.value)
        self.running.labels(model_name).set(0)
        self.waiting.labels(model_name).set(0)
        self.kv_usage.labels(model_name).set(0)

        self._seen = _Snapshot()
        # The last drained events and how much of them was exported (the engine may still append to
        # them once if the drain raced with a step in the worker thread).
        self._drained = StepEvents()
        self._drained_done = (0, 0)
        self._last_log = time.monotonic()
        self._logged = _Snapshot()

    def update(self, core: EngineCore) -> None:
        """Called after each engine step and on each scrape, on the event loop."""
        name, prop = self.model_name, self.proposer
        now, seen = _Snapshot.of(core), self._seen
        self._seen = now
        for metric, delta in (
            (self.spec_num_drafts, now.num_drafts - seen.num_drafts),
            (self.spec_num_draft_tokens, now.num_draft_tokens - seen.num_draft_tokens),
            (self.spec_num_accepted, now.num_accepted_tokens - seen.num_accepted_tokens),
            (self.spec_draft_seconds, now.draft_seconds - seen.draft_seconds),
            (self.spec_verify_seconds, now.verify_seconds - seen.verify_seconds),
            (self.spec_errors, now.proposer_errors - seen.proposer_errors),
        ):
            if delta > 0:
                metric.labels(name, prop).inc(delta)
        for pos, count in enumerate(now.accepted_per_position):
            before = seen.accepted_per_position[pos] if pos < len(seen.accepted_per_position) else 0
            if count > before:
                self.spec_accepted_per_pos.labels(name, prop, str(pos)).inc(count - before)
        for metric, delta in (
            (self.prompt_tokens, now.prompt_tokens - seen.prompt_tokens),
            (self.generation_tokens, now.generation_tokens - seen.generation_tokens),
            (self.preemptions, now.num_preemptions - seen.num_preemptions),
            (self.prefix_queries, now.prefix_queries - seen.prefix_queries),
            (self.prefix_hits, now.prefix_hits - seen.prefix_hits),
        ):
            if delta > 0:
                metric.labels(name).inc(delta)
        self.spec_k.labels(name, prop).set(core.scheduler.config.num_speculative_tokens)
        self.running.labels(name).set(core.num_running)
        self.waiting.labels(name).set(core.num_waiting)
        self.kv_usage.labels(name).set(core.kv_manager.pool.usage())

        old, (n_len, n_fin) = self._drained, self._drained_done
        self._observe(old.acceptance_lengths[n_len:], old.finished[n_fin:])
        events = core.stats.drain_events()
        self._drained = events
        self._drained_done = (len(events.acceptance_lengths), len(events.finished))
        self._observe(
            events.acceptance_lengths[: self._drained_done[0]], events.finished[: self._drained_done[1]]
        )

    def _observe(self, acceptance_lengths, finished) -> None:
        name = self.model_name
        for length in acceptance_lengths:
            self.spec_accept_len.labels(name, self.proposer).observe(length)
        for t in finished:
            self.request_success.labels(name, t.finish_reason).inc()
            self.e2e.labels(name).observe(t.e2e_seconds)
            self.queue_time.labels(name).observe(max(0.0, t.queue_seconds))
            if t.ttft_seconds is not None:
                self.ttft.labels(name).observe(t.ttft_seconds)
            for gap in t.inter_token_seconds:
                self.itl.labels(name).observe(gap)

    def maybe_log(self, core: EngineCore, interval: float) -> None:
        """Every `interval` s (0: never), one line like vLLM's; rates cover the interval since the last line."""
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        line = self.log_line(core, now)
        self._last_log = now
        logger.info("%s", line)

    def log_line(self, core: EngineCore, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        cur, prev = _Snapshot.of(core), self._logged
        self._logged = cur
        elapsed = max(now - self._last_log, 1e-9)
        drafts = cur.num_drafts - prev.num_drafts
        draft_tokens = cur.num_draft_tokens - prev.num_draft_tokens
        accepted = cur.num_accepted_tokens - prev.num_accepted_tokens
        line = (
            f"Avg prompt throughput: {(cur.prompt_tokens - prev.prompt_tokens) / elapsed:.1f} tokens/s,"
            f" Avg generation throughput: {(cur.generation_tokens - prev.generation_tokens) / elapsed:.1f}"
            f" tokens/s, Running: {core.num_running} reqs, Waiting: {core.num_waiting} reqs,"
            f" KV cache usage: {100 * core.kv_manager.pool.usage():.1f}%"
        )
        if self.proposer == "none":
            return line
        if drafts == 0:
            return line + f" | SpecDecoding ({self.proposer}): no drafts"
        per_pos = [
            (c - (prev.accepted_per_position[i] if i < len(prev.accepted_per_position) else 0)) / drafts
            for i, c in enumerate(cur.accepted_per_position)
        ]
        return line + (
            f" | SpecDecoding ({self.proposer}): Mean acceptance length: {1 + accepted / drafts:.2f},"
            f" Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens,"
            f" Draft acceptance rate: {100 * accepted / max(draft_tokens, 1):.1f}%,"
            f" Per-position acceptance rate: {', '.join(f'{x:.3f}' for x in per_pos)}"
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
