"""Prometheus exporter: turns the engine's plain stats dataclasses into metrics after every step.

Names mirror vLLM v1 with the prefix `specserve:` so dashboards port by a prefix change. One
CollectorRegistry per server (no global registry), so several servers can live in one process.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from specserve.engine.engine_core import EngineCore
from specserve.engine.stats import SpecDecodingStats

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


class MetricsExporter:
    def __init__(self, model_name: str, core: EngineCore):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.proposer = core.proposer_name
        r, m = self.registry, ["model_name"]
        sm = ["model_name", "proposer"]
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
            "Accepted drafts by position",
            [*sm, "position"],
            registry=r,
        )
        self.spec_draft_seconds = Counter(
            "specserve:spec_decode_draft_seconds", "Time spent proposing", sm, registry=r
        )
        self.spec_verify_seconds = Counter(
            "specserve:spec_decode_verify_seconds", "Time spent verifying", sm, registry=r
        )
        self.spec_errors = Counter(
            "specserve:spec_decode_proposer_errors", "Proposer failures (fell back to plain)", sm, registry=r
        )
        self.spec_k = Gauge(
            "specserve:spec_decode_num_speculative_tokens",
            "Current max draft tokens per step",
            sm,
            registry=r,
        )
        self.spec_accept_len = Histogram(
            "specserve:spec_decode_acceptance_length",
            "Tokens emitted per verification (1 + accepted)",
            sm,
            buckets=tuple(range(1, 34)),
            registry=r,
        )
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
        self.ttft = Histogram(
            "specserve:time_to_first_token_seconds",
            "Time to first token",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specserve:inter_token_latency_seconds",
            "Inter-token latency",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specserve:e2e_request_latency_seconds",
            "End-to-end latency",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "specserve:request_queue_time_seconds",
            "Time waiting before first schedule",
            m,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_info.info(
            {
                "block_size": str(core.config.block_size),
                "num_blocks": str(core.num_blocks),
                "device_memory_utilization": str(core.config.device_memory_utilization),
            }
        )
        self.spec_k.labels(model_name, self.proposer).set(core.scheduler.config.num_speculative_tokens)
        # Label children exist from the start so every series is visible at 0 before traffic.
        for c in (
            self.spec_num_drafts,
            self.spec_num_draft_tokens,
            self.spec_num_accepted,
            self.spec_draft_seconds,
            self.spec_verify_seconds,
            self.spec_errors,
        ):
            c.labels(model_name, self.proposer)
        for c in (
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
        ):
            c.labels(model_name)
        self._seen = SpecDecodingStats()
        self._seen_counts = {"prompt": 0, "gen": 0, "preempt": 0, "pq": 0, "ph": 0}
        self._last_log = time.monotonic()
        self._last_gen = 0

    def update(self, core: EngineCore) -> None:
        """Called after each engine step, on the event loop (the step has finished)."""
        name, prop = self.model_name, self.proposer
        st, seen = core.stats, self._seen
        spec = st.spec
        self.spec_num_drafts.labels(name, prop).inc(spec.num_drafts - seen.num_drafts)
        self.spec_num_draft_tokens.labels(name, prop).inc(spec.num_draft_tokens - seen.num_draft_tokens)
        self.spec_num_accepted.labels(name, prop).inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
        self.spec_draft_seconds.labels(name, prop).inc(spec.draft_seconds - seen.draft_seconds)
        self.spec_verify_seconds.labels(name, prop).inc(spec.verify_seconds - seen.verify_seconds)
        self.spec_errors.labels(name, prop).inc(spec.proposer_errors - seen.proposer_errors)
        for pos, count in enumerate(spec.accepted_per_position):
            before = seen.accepted_per_position[pos] if pos < len(seen.accepted_per_position) else 0
            if count > before:
                self.spec_accepted_per_pos.labels(name, prop, str(pos)).inc(count - before)
        self._seen = SpecDecodingStats(
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
            list(spec.accepted_per_position),
            spec.draft_seconds,
            spec.verify_seconds,
            spec.proposer_errors,
        )
        pool = core.kv_manager.pool
        counts = {
            "prompt": st.prompt_tokens,
            "gen": st.generation_tokens,
            "preempt": st.num_preemptions,
            "pq": pool.num_queries,
            "ph": pool.num_hits,
        }
        for key, metric in (
            ("prompt", self.prompt_tokens),
            ("gen", self.generation_tokens),
            ("preempt", self.preemptions),
            ("pq", self.prefix_queries),
            ("ph", self.prefix_hits),
        ):
            metric.labels(name).inc(counts[key] - self._seen_counts[key])
        self._seen_counts = counts
        self.running.labels(name).set(core.num_running)
        self.waiting.labels(name).set(core.num_waiting)
        self.kv_usage.labels(name).set(pool.usage())
        events = st.drain_events()
        for length in events.acceptance_lengths:
            self.spec_accept_len.labels(name, prop).observe(length)
        for t in events.finished:
            self.request_success.labels(name, t.finish_reason).inc()
            self.e2e.labels(name).observe(t.e2e_seconds)
            self.queue_time.labels(name).observe(max(0.0, t.queue_seconds))
            if t.ttft_seconds is not None:
                self.ttft.labels(name).observe(t.ttft_seconds)
            for gap in t.inter_token_seconds:
                self.itl.labels(name).observe(gap)

    def maybe_log(self, core: EngineCore, interval: float) -> None:
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        gen = core.stats.generation_tokens
        rate = (gen - self._last_gen) / (now - self._last_log)
        self._last_log, self._last_gen = now, gen
        spec = core.stats.spec
        per_pos = ", ".join(f"{x:.2f}" for x in spec.per_position_acceptance())
        logger.info(
            "generation %.1f tok/s | running %d, waiting %d | KV usage %.1f%% | spec(%s): mean acceptance length"
            " %.2f, acceptance rate %.1f%%, per-position [%s]",
            rate,
            core.num_running,
            core.num_waiting,
            100 * core.kv_manager.pool.usage(),
            self.proposer,
            spec.mean_acceptance_length,
            100 * spec.acceptance_rate,
            per_pos,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
