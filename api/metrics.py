"""Prometheus exporter: turns the engine's stats snapshots into metrics after every step.

Every exported series is declared once, in `SERIES` (name, type, help, labels, how to read it from an
`EngineSnapshot`); the exporter, the README's metric list and the monitoring tests are driven by it.
Adding a metric = one field in EngineSnapshot + one row here.

Names mirror vLLM v1 with the prefix `specserve:` so dashboards port by a prefix change
(prometheus-client appends `_total` to counters, `_bucket`/`_sum`/`_count` to histograms and `_info`
to the info metric). Every series carries `model_name`, the info metric included; speculative-decoding
series also carry `proposer`. One CollectorRegistry per server (no global registry), so several servers
can live in one process. This is the only module that imports prometheus_client.

`promtool check metrics` passes on the output except for one rule we break on purpose: the ':' in the
names, shared with vLLM so its dashboards and queries port by a prefix change (Prometheus reserves ':'
for recording rules, but scrapes and stores such names fine). Counters' and histograms' `_created`
samples are switched off: promtool and most dashboards do not use them, and they double the series.

`update()` runs on the event loop, after each engine step and on every scrape, possibly while the
next step runs in the worker thread. It therefore works from snapshots (each engine counter read
once) and exports the difference to the previous snapshot, so nothing is lost or counted twice
whatever it races with; the previous snapshot's drained events are re-checked once for items
appended late.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from specserve.engine.request import FinishReason
from specserve.engine.sampling_params import MAX_NUM_SPECULATIVE_TOKENS
from specserve.engine.stats import (
    EngineSnapshot,
    acceptance_rate,
    mean_acceptance_length,
    per_position_acceptance,
)

logger = logging.getLogger("specserve.stats")
CONTENT_TYPE = CONTENT_TYPE_LATEST
# prometheus-client's switch is process-wide (no per-registry option); this module owns every metric.
disable_created_metrics()

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


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


# vLLM ends its length buckets at max_model_len; ours are declared before any model is loaded, so they
# end at 200k tokens (past the longest context of the families we load; longer lands in +Inf).
_LENGTH_BUCKETS = build_1_2_5_buckets(200_000)

Kind = Literal["counter", "gauge", "histogram", "info"]
# What a row's reader returns, by kind -- counter: the cumulative value, or {label value: cumulative
# value} for a series with a label of its own; gauge: the current value; histogram: the observations
# in the snapshot's drained events (a sequence that only grows at the end); info: the info labels.
Reading = float | Mapping[str, float] | Sequence[float] | Mapping[str, str]

# Label values the exporter fills in itself; any other label is keyed by the reader's mapping.
_FIXED_LABELS = ("model_name", "proposer")
_M = ("model_name",)
_SPEC = ("model_name", "proposer")


@dataclass(frozen=True)
class Series:
    """One exported metric family."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    read: Callable[[EngineSnapshot], Reading]
    buckets: tuple[float, ...] = ()

    @property
    def key_label(self) -> str | None:
        """The one label whose values come from the reader (`position`, `finished_reason`), if any."""
        keyed = [label for label in self.labels if label not in _FIXED_LABELS]
        return keyed[0] if keyed else None

    @property
    def exposed_name(self) -> str:
        """The name as scraped (a histogram's samples add `_bucket`, `_sum` and `_count` to it)."""
        return {"counter": f"{self.name}_total", "info": f"{self.name}_info"}.get(self.kind, self.name)

    @property
    def sample_names(self) -> tuple[str, ...]:
        """Every sample name a query can select (`_created` samples are disabled)."""
        if self.kind == "histogram":
            return tuple(f"{self.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        return (self.exposed_name,)


def _accepted_by_position(s: EngineSnapshot) -> dict[str, int]:
    # Positions 0..k-1 exist from the start (at 0); a later, larger k adds positions as they count.
    n = max(len(s.accepted_per_position), s.num_speculative_tokens)
    counts = s.accepted_per_position + (0,) * (n - len(s.accepted_per_position))
    return {str(pos): c for pos, c in enumerate(counts)}


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _success_by_reason(s: EngineSnapshot) -> dict[str, int]:
    return {r.value: s.request_success.get(r.value, 0) for r in FinishReason}


def _cache_config(s: EngineSnapshot) -> dict[str, str]:
    return {
        "block_size": str(s.block_size),
        "num_blocks": str(s.num_blocks),
        "device_memory_utilization": str(s.device_memory_utilization),
    }


# Registration order is exposition order.
SERIES: tuple[Series, ...] = (
    # --- speculative decoding (labels model_name, proposer) -----------------------------------
    Series(
        "specserve:spec_decode_num_drafts",
        "counter",
        "Verification steps with drafts",
        _SPEC,
        lambda s: s.num_drafts,
    ),
    Series(
        "specserve:spec_decode_num_draft_tokens",
        "counter",
        "Draft tokens proposed",
        _SPEC,
        lambda s: s.num_draft_tokens,
    ),
    Series(
        "specserve:spec_decode_num_accepted_tokens",
        "counter",
        "Draft tokens accepted",
        _SPEC,
        lambda s: s.num_accepted_tokens,
    ),
    Series(
        "specserve:spec_decode_num_accepted_tokens_per_pos",
        "counter",
        "Accepted draft tokens by position in the draft (0 = first)",
        (*_SPEC, "position"),
        _accepted_by_position,
    ),
    Series(
        "specserve:spec_decode_draft_seconds",
        "counter",
        "Time spent proposing drafts",
        _SPEC,
        lambda s: s.draft_seconds,
    ),
    Series(
        "specserve:spec_decode_verify_seconds",
        "counter",
        "Time spent in target forward passes that verify drafts",
        _SPEC,
        lambda s: s.verify_seconds,
    ),
    Series(
        "specserve:spec_decode_proposer_errors",
        "counter",
        "Proposer failures (fell back to plain)",
        _SPEC,
        lambda s: s.proposer_errors,
    ),
    Series(
        "specserve:spec_decode_num_forced_tokens",
        "counter",
        "Accepted draft tokens that a grammar forced (structured output); part of num_accepted_tokens",
        _SPEC,
        lambda s: s.num_forced_tokens,
    ),
    Series(
        "specserve:structured_output_grammar_seconds",
        "counter",
        "Time spent computing grammar masks, checking drafts and advancing grammars (finished requests)",
        _M,
        lambda s: s.grammar_seconds,
    ),
    Series(
        "specserve:spec_decode_num_speculative_tokens",
        "gauge",
        "Mean draft tokens allowed per decoding request in the steps since the last update (the"
        " controller's k, or the drafts of a window the draft model ended where unsure; 0 = no"
        " speculation)",
        _SPEC,
        lambda s: _mean(s.events.chosen_k),
    ),
    Series(
        "specserve:spec_decode_chosen_num_speculative_tokens",
        "histogram",
        "Draft tokens allowed per decoding request per step (k, 0 included; a window ended unsure: its drafts)",
        _SPEC,
        lambda s: s.events.chosen_k,
        buckets=tuple(range(MAX_NUM_SPECULATIVE_TOKENS + 1)),  # one per possible k
    ),
    Series(
        "specserve:spec_decode_controller_steps",
        "counter",
        "Steps whose k the adaptive controller chose",
        _SPEC,
        lambda s: s.controller_steps,
    ),
    Series(
        "specserve:spec_decode_controller_quiet_steps",
        "counter",
        "Of those, steps it drafted nothing without weighing (a quiet spell after a clear no)",
        _SPEC,
        lambda s: s.controller_quiet_steps,
    ),
    Series(
        "specserve:spec_decode_controller_predicted_tokens",
        "counter",
        "Tokens the controller expected its decoding requests to emit in those steps",
        _SPEC,
        lambda s: s.controller_predicted_tokens,
    ),
    Series(
        "specserve:spec_decode_controller_measured_tokens",
        "counter",
        "Tokens those requests emitted in those steps",
        _SPEC,
        lambda s: s.controller_measured_tokens,
    ),
    Series(
        "specserve:spec_decode_controller_predicted_step_seconds",
        "counter",
        "Step time the controller's cost model predicted for those steps as they ran",
        _SPEC,
        lambda s: s.controller_predicted_step_seconds,
    ),
    Series(
        "specserve:spec_decode_controller_measured_step_seconds",
        "counter",
        "Step time measured for those steps",
        _SPEC,
        lambda s: s.controller_measured_step_seconds,
    ),
    Series(
        "specserve:spec_decode_acceptance_length",
        "histogram",
        "Tokens emitted per verification (1 + accepted drafts)",
        _SPEC,
        lambda s: s.events.acceptance_lengths,
        buckets=tuple(range(1, MAX_NUM_SPECULATIVE_TOKENS + 2)),  # one per possible length
    ),
    # --- tokens, requests, cache (label model_name) --------------------------------------------
    Series(
        "specserve:prompt_tokens",
        "counter",
        "Prompt tokens of finished requests",
        _M,
        lambda s: s.prompt_tokens,
    ),
    Series("specserve:generation_tokens", "counter", "Generated tokens", _M, lambda s: s.generation_tokens),
    Series("specserve:num_preemptions", "counter", "Requests preempted", _M, lambda s: s.num_preemptions),
    Series(
        "specserve:num_requests_nonfinite_logits",
        "counter",
        "Requests failed alone because their logits were not finite (NaN or inf)",
        _M,
        lambda s: s.nonfinite_logits_requests,
    ),
    Series(
        "specserve:request_success",
        "counter",
        "Finished requests",
        (*_M, "finished_reason"),
        _success_by_reason,
    ),
    Series(
        "specserve:prefix_cache_queries",
        "counter",
        "Prefix cache block lookups",
        _M,
        lambda s: s.prefix_cache_queries,
    ),
    Series(
        "specserve:prefix_cache_hits",
        "counter",
        "Prefix cache block hits",
        _M,
        lambda s: s.prefix_cache_hits,
    ),
    Series("specserve:num_requests_running", "gauge", "Requests running", _M, lambda s: s.num_running),
    Series("specserve:num_requests_waiting", "gauge", "Requests waiting", _M, lambda s: s.num_waiting),
    Series("specserve:kv_cache_usage_perc", "gauge", "KV cache usage (0-1)", _M, lambda s: s.kv_cache_usage),
    Series("specserve:cache_config", "info", "KV cache configuration", _M, _cache_config),
    Series(
        "specserve:time_to_first_token_seconds",
        "histogram",
        "Time to first token",
        _M,
        lambda s: [t.ttft_seconds for t in s.events.finished if t.ttft_seconds is not None],
        buckets=_LATENCY_BUCKETS,
    ),
    Series(
        "specserve:inter_token_latency_seconds",
        "histogram",
        "Inter-token latency",
        _M,
        lambda s: [gap for t in s.events.finished for gap in t.inter_token_seconds],
        buckets=_LATENCY_BUCKETS,
    ),
    Series(
        "specserve:e2e_request_latency_seconds",
        "histogram",
        "End-to-end request latency",
        _M,
        lambda s: [t.e2e_seconds for t in s.events.finished],
        buckets=_LATENCY_BUCKETS,
    ),
    Series(
        "specserve:request_queue_time_seconds",
        "histogram",
        "Time waiting before first schedule",
        _M,
        lambda s: [max(0.0, t.queue_seconds) for t in s.events.finished],
        buckets=_LATENCY_BUCKETS,
    ),
    Series(
        "specserve:request_prompt_tokens",
        "histogram",
        "Prompt tokens per finished request",
        _M,
        lambda s: [t.prompt_tokens for t in s.events.finished],
        buckets=_LENGTH_BUCKETS,
    ),
    Series(
        "specserve:request_generation_tokens",
        "histogram",
        "Generated tokens per finished request",
        _M,
        lambda s: [t.generation_tokens for t in s.events.finished],
        buckets=_LENGTH_BUCKETS,
    ),
)


def markdown_table(series: Sequence[Series] = SERIES) -> str:
    """The README's metric list (tests/api/test_metrics.py keeps the README equal to this)."""
    rows = ["| Series | Type | Labels | Meaning |", "| --- | --- | --- | --- |"]
    for row in series:
        # An info metric's labels are its own and its content.
        names = (*row.labels, *row.read(EngineSnapshot())) if row.kind == "info" else row.labels
        labels = ", ".join(f"`{name}`" for name in names)
        rows.append(f"| `{row.exposed_name}` | {row.kind} | {labels} | {row.help} |")
    return "\n".join(rows)


def _create(row: Series, registry: CollectorRegistry) -> Counter | Gauge | Histogram | Info:
    if row.kind == "counter":
        return Counter(row.name, row.help, row.labels, registry=registry)
    if row.kind == "gauge":
        return Gauge(row.name, row.help, row.labels, registry=registry)
    if row.kind == "histogram":
        return Histogram(row.name, row.help, row.labels, buckets=row.buckets, registry=registry)
    return Info(row.name, row.help, row.labels, registry=registry)


class MetricsExporter:
    def __init__(self, model_name: str, first: EngineSnapshot, series: Sequence[Series] = SERIES):
        """`first` supplies the static labels (proposer, cache config) and the starting values."""
        self.registry = CollectorRegistry()
        # process_resident_memory_bytes & co.: what a soak watches for leaks (Linux /proc based).
        ProcessCollector(registry=self.registry)
        self.model_name = model_name
        self.proposer = first.proposer_name
        self._series = tuple(series)
        self._metrics = {row.name: _create(row, self.registry) for row in self._series}
        # Every series exists from the start (at 0), so rate() and the dashboard work before traffic.
        for row in self._series:
            metric = self._metrics[row.name]
            if row.kind == "info":
                metric.labels(*self._label_values(row)).info(row.read(first))
            elif row.key_label is not None:
                for key in row.read(first):
                    metric.labels(*self._label_values(row, key))
            elif row.kind != "gauge":  # gauges are set by update() below
                metric.labels(*self._label_values(row))
        self._seen = EngineSnapshot()  # what has been exported: nothing yet
        # How many observations of each histogram the last drained events held when exported (a step
        # that raced with the drain may still append to them once).
        self._observed = {row.name: 0 for row in self._series if row.kind == "histogram"}
        self._last_log = time.monotonic()
        self._logged = EngineSnapshot()
        self.update(first)

    def _label_values(self, row: Series, key: str | None = None) -> list[str]:
        fixed = {"model_name": self.model_name, "proposer": self.proposer}
        return [fixed.get(label, key) for label in row.labels]

    def update(self, now: EngineSnapshot) -> None:
        """Export `now` (a snapshot newer than the last one given); called after each step and on scrape."""
        prev, self._seen = self._seen, now
        for row in self._series:
            metric = self._metrics[row.name]
            if row.kind == "counter":
                self._add_counter(row, metric, row.read(prev), row.read(now))
            elif row.kind == "gauge":
                metric.labels(*self._label_values(row)).set(row.read(now))
            elif row.kind == "histogram":
                child = metric.labels(*self._label_values(row))
                for value in self._new_observations(row, prev, now):
                    child.observe(value)

    def _add_counter(self, row: Series, metric: Counter, before: Reading, after: Reading) -> None:
        if row.key_label is None:
            if after > before:
                metric.labels(*self._label_values(row)).inc(after - before)
            return
        for key, value in after.items():
            old = before.get(key, 0)
            if value > old:
                metric.labels(*self._label_values(row, key)).inc(value - old)

    def _new_observations(self, row: Series, prev: EngineSnapshot, now: EngineSnapshot) -> list[float]:
        """Late items of the previous drain, then all of this one; each list read once (tuple copy)."""
        done = self._observed[row.name]
        if now.events is prev.events:  # the same snapshot again: only what was appended since
            current = tuple(row.read(now))
            self._observed[row.name] = len(current)
            return list(current[done:])
        late = tuple(row.read(prev))[done:]
        current = tuple(row.read(now))
        self._observed[row.name] = len(current)
        return [*late, *current]

    def maybe_log(self, snapshot: EngineSnapshot, interval: float) -> None:
        """Every `interval` s (0: never), one line like vLLM's; rates cover the interval since the last line."""
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        line = self.log_line(snapshot, now)
        self._last_log = now
        logger.info("%s", line)

    def log_line(self, cur: EngineSnapshot, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        prev, self._logged = self._logged, cur
        elapsed = max(now - self._last_log, 1e-9)
        drafts = cur.num_drafts - prev.num_drafts
        draft_tokens = cur.num_draft_tokens - prev.num_draft_tokens
        accepted = cur.num_accepted_tokens - prev.num_accepted_tokens
        line = (
            f"Avg prompt throughput: {(cur.prompt_tokens - prev.prompt_tokens) / elapsed:.1f} tokens/s,"
            f" Avg generation throughput: {(cur.generation_tokens - prev.generation_tokens) / elapsed:.1f}"
            f" tokens/s, Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs,"
            f" KV cache usage: {100 * cur.kv_cache_usage:.1f}%"
        )
        if self.proposer == "none":
            return line
        if drafts == 0:
            return line + f" | SpecDecoding ({self.proposer}): no drafts"
        before = prev.accepted_per_position
        per_pos_accepted = [
            c - (before[i] if i < len(before) else 0) for i, c in enumerate(cur.accepted_per_position)
        ]
        per_pos = per_position_acceptance(per_pos_accepted, drafts)
        return line + (
            f" | SpecDecoding ({self.proposer}): Mean acceptance length:"
            f" {mean_acceptance_length(accepted, drafts):.2f},"
            f" Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens,"
            f" Draft acceptance rate: {100 * acceptance_rate(accepted, draft_tokens):.1f}%,"
            f" Per-position acceptance rate: {', '.join(f'{x:.3f}' for x in per_pos)}"
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
