"""The Prometheus exporter against the offline engine: exact counter values after a known workload.

The engine keeps two independent tallies of speculation (per request in `Request.spec`, globally in
`EngineStats.spec`) and the exporter turns the global one (through `EngineCore.snapshot()`) into
Prometheus counters step by step; here every exported value is checked against what the requests
themselves returned. The exporter, the README's metric list and the monitoring tests all come from
the one table `SERIES`; the tests at the end hold them together.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_adaptive_llm, make_llm, mixed_prompts

from specserve.api.metrics import SERIES, MetricsExporter, markdown_table
from specserve.engine import SamplingParams
from specserve.engine.stats import EngineSnapshot, RequestTiming

MODEL = "tiny"
K = 3

# Every name the issue lists, as exposed (prometheus-client adds _total / _info / _bucket...).
COUNTERS = [
    "specserve:spec_decode_num_drafts_total",
    "specserve:spec_decode_num_draft_tokens_total",
    "specserve:spec_decode_num_accepted_tokens_total",
    "specserve:spec_decode_draft_seconds_total",
    "specserve:spec_decode_verify_seconds_total",
    "specserve:prompt_tokens_total",
    "specserve:generation_tokens_total",
    "specserve:num_preemptions_total",
    "specserve:prefix_cache_queries_total",
    "specserve:prefix_cache_hits_total",
]
GAUGES = [
    "specserve:num_requests_running",
    "specserve:num_requests_waiting",
    "specserve:kv_cache_usage_perc",
    "specserve:spec_decode_num_speculative_tokens",
]
HISTOGRAMS = [
    "specserve:time_to_first_token_seconds",
    "specserve:inter_token_latency_seconds",
    "specserve:e2e_request_latency_seconds",
    "specserve:request_queue_time_seconds",
    "specserve:spec_decode_acceptance_length",
    "specserve:spec_decode_chosen_num_speculative_tokens",
    "specserve:request_prompt_tokens",
    "specserve:request_generation_tokens",
]
SPEC = {
    "specserve:spec_decode_num_drafts_total",
    "specserve:spec_decode_num_draft_tokens_total",
    "specserve:spec_decode_num_accepted_tokens_total",
    "specserve:spec_decode_num_accepted_tokens_per_pos_total",
    "specserve:spec_decode_draft_seconds_total",
    "specserve:spec_decode_verify_seconds_total",
    "specserve:spec_decode_num_speculative_tokens",
    "specserve:spec_decode_acceptance_length_count",
}


def parse(text: bytes) -> dict[str, dict[frozenset, float]]:
    """sample name -> {frozenset(labels.items()): value}"""
    out: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def value(samples, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    hits = [v for k, v in samples[name].items() if set(labels.items()) <= dict(k).items()]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


@pytest.fixture(scope="module")
def run(tiny_llama_dir):
    """A known workload (greedy, fixed seed) through the offline engine, exported after each step."""
    llm = make_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=K, seed=0)
    core = llm.engine
    exporter = MetricsExporter(MODEL, core.snapshot())
    before = parse(exporter.render())

    step, steps = core.step, []

    def step_and_export():  # what the server's on_step hook does
        outputs = step()
        exporter.update(core.snapshot())
        steps.append(len(outputs))
        return outputs

    core.step = step_and_export
    prompts = mixed_prompts(6, seed=3)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # A reference run tells which token to stop at, so one request ends with finish_reason "stop".
    ref = make_llm(tiny_llama_dir).generate([prompts[1]], greedy, use_chat_template=False)[0].token_ids
    stop = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ref[6]])
    params = [greedy] * 4 + [stop, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    outs = llm.generate([*prompts[:4], prompts[1], prompts[4]], params, use_chat_template=False)
    exporter.update(core.snapshot())  # a scrape after the last step changes nothing
    return llm, exporter, outs, before, parse(exporter.render()), steps


def test_series_exist_before_traffic(run):
    _, _, _, before, _, _ = run
    for name in COUNTERS:
        assert value(before, name, model_name=MODEL) == 0
    for name in GAUGES:
        value(before, name, model_name=MODEL)
    # Mean k allowed in the steps since the last update: none yet.
    assert value(before, "specserve:spec_decode_num_speculative_tokens", proposer="ngram") == 0
    for name in HISTOGRAMS:
        assert value(before, name + "_count", model_name=MODEL) == 0
    for reason in ("stop", "length", "abort", "error"):
        assert value(before, "specserve:request_success_total", finished_reason=reason) == 0
    for pos in range(K):
        assert (
            value(before, "specserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == 0
        )
    info = value(before, "specserve:cache_config_info", model_name=MODEL)
    assert info == 1
    (labels,) = before["specserve:cache_config_info"]
    assert {"model_name", "block_size", "num_blocks", "device_memory_utilization"} <= dict(labels).keys()


def test_label_sets(run):
    _, _, _, _, after, _ = run
    assert after["process_resident_memory_bytes"], "process metrics (RSS for soak tests) are exported"
    for name, series in after.items():
        if not name.startswith("specserve:"):
            continue  # the standard process_* series
        for labels in series:
            keys = dict(labels).keys()
            assert "model_name" in keys, name
            assert ("proposer" in keys) == name.startswith("specserve:spec_decode_"), name
    value(after, "specserve:spec_decode_num_drafts_total", model_name=MODEL, proposer="ngram")


def test_counters_equal_what_the_requests_returned(run):
    llm, _, outs, _, m, _ = run
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    drafts = sum(o.spec.num_drafts for o in outs)
    draft_tokens = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert draft_tokens > 0 and accepted > 0, "the workload must exercise speculation"
    assert value(m, "specserve:spec_decode_num_drafts_total") == drafts
    assert value(m, "specserve:spec_decode_num_draft_tokens_total") == draft_tokens
    assert value(m, "specserve:spec_decode_num_accepted_tokens_total") == accepted
    per_pos = {
        int(dict(k)["position"]): v
        for k, v in m["specserve:spec_decode_num_accepted_tokens_per_pos_total"].items()
    }
    assert sum(per_pos.values()) == accepted
    assert sorted(per_pos) == list(range(K))
    for pos in range(K):
        assert per_pos[pos] == sum(sum(o.spec.accepted_per_position[pos : pos + 1]) for o in outs)
    assert value(m, "specserve:generation_tokens_total") == sum(len(o.token_ids) for o in outs)
    assert value(m, "specserve:prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in outs)
    for reason in ("stop", "length"):
        n = sum(o.finish_reason == reason for o in outs)
        assert value(m, "specserve:request_success_total", finished_reason=reason) == n
    assert value(m, "specserve:request_success_total", finished_reason="abort") == 0
    assert value(m, "specserve:num_preemptions_total") == llm.engine.stats.num_preemptions == 0
    stats = llm.engine.stats.spec
    assert value(m, "specserve:spec_decode_draft_seconds_total") == pytest.approx(stats.draft_seconds)
    assert value(m, "specserve:spec_decode_verify_seconds_total") == pytest.approx(stats.verify_seconds)
    assert stats.verify_seconds > 0


def test_histograms(run):
    _, _, outs, _, m, _ = run
    n = len(outs)
    drafts = sum(o.spec.num_drafts for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    # One acceptance-length observation (1 + accepted) per verification with drafts.
    assert value(m, "specserve:spec_decode_acceptance_length_count") == drafts
    assert value(m, "specserve:spec_decode_acceptance_length_sum") == drafts + accepted
    assert value(m, "specserve:spec_decode_acceptance_length_bucket", le="1.0") == drafts - sum(
        o.spec.accepted_per_position[0] if o.spec.accepted_per_position else 0 for o in outs
    )
    assert value(m, "specserve:spec_decode_acceptance_length_bucket", le="+Inf") == drafts
    for name in (
        "specserve:e2e_request_latency_seconds",
        "specserve:request_queue_time_seconds",
        "specserve:time_to_first_token_seconds",
    ):
        assert value(m, name + "_count") == n
    # One inter-token gap per generated token after the first.
    assert value(m, "specserve:inter_token_latency_seconds_count") == sum(len(o.token_ids) - 1 for o in outs)


def test_length_histograms(run):
    """One prompt-length and one generation-length observation per finished request (vLLM's
    request_prompt_tokens / request_generation_tokens), in 1-2-5 buckets."""
    _, _, outs, _, m, _ = run
    for name, lengths in (
        ("specserve:request_prompt_tokens", [len(o.prompt_token_ids) for o in outs]),
        ("specserve:request_generation_tokens", [len(o.token_ids) for o in outs]),
    ):
        assert value(m, name + "_count") == len(outs) == len(lengths)
        assert value(m, name + "_sum") == sum(lengths)
        for le in (1, 5, 10, 20, 50, 100):
            expected = sum(n <= le for n in lengths)
            assert value(m, name + "_bucket", le=f"{float(le)}") == expected, (name, le)
        assert value(m, name + "_bucket", le="+Inf") == len(outs)
    # The workload's generation lengths differ (5, a stop, 24), so the buckets tell them apart.
    assert value(m, "specserve:request_generation_tokens_bucket", le="5.0") >= 1
    assert value(m, "specserve:request_generation_tokens_bucket", le="20.0") < len(outs)


def test_length_buckets_are_vllms_1_2_5_series():
    from specserve.api.metrics import build_1_2_5_buckets

    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-3:] == (500, 1000, 2000)
    row = next(r for r in SERIES if r.name == "specserve:request_prompt_tokens")
    assert row.buckets[:7] == (1, 2, 5, 10, 20, 50, 100) and row.buckets[-1] >= 131072


def test_chosen_k_histogram_counts_every_decode_step(run):
    _, _, outs, _, m, _ = run
    decisions = sum(o.spec.num_k_decisions for o in outs)
    assert decisions > 0
    name = "specserve:spec_decode_chosen_num_speculative_tokens"
    assert value(m, name + "_count") == decisions
    assert value(m, name + "_sum") == sum(o.spec.sum_k for o in outs)
    assert value(m, name + "_bucket", le=f"{K - 1}.0") < decisions  # static K: mostly k = K


def _exported_after_a_run(llm):
    """(the exported samples, the engine's spec stats) after four mixed prompts of 12 greedy tokens."""
    exporter = MetricsExporter(MODEL, llm.engine.snapshot())
    llm.generate(mixed_prompts(4, seed=5), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    exporter.update(llm.engine.snapshot())
    return parse(exporter.render()), llm.engine.stats.spec


def test_controller_predictions_are_exported(tiny_llama_dir):
    llm = make_adaptive_llm(tiny_llama_dir, speculative_method="ngram", num_speculative_tokens=K)
    m, spec = _exported_after_a_run(llm)
    steps = value(m, "specserve:spec_decode_controller_steps_total")
    assert steps == spec.controller_steps > 0
    assert value(m, "specserve:spec_decode_controller_measured_tokens_total") == spec.measured_tokens > 0
    predicted = value(m, "specserve:spec_decode_controller_predicted_tokens_total")
    assert predicted == pytest.approx(spec.predicted_tokens) and predicted >= steps
    measured_s = value(m, "specserve:spec_decode_controller_measured_step_seconds_total")
    assert measured_s == pytest.approx(spec.measured_step_seconds) and measured_s > 0
    assert value(m, "specserve:spec_decode_controller_predicted_step_seconds_total") > 0


def test_quiet_steps_are_exported(tiny_llama_dir):
    """Drafting too dear to pay and deciding worth saving: the controller's quiet steps are counted."""
    llm = make_adaptive_llm(
        tiny_llama_dir, slope=1.0, quiet_share=0.0, speculative_method="ngram", num_speculative_tokens=K
    )
    m, spec = _exported_after_a_run(llm)
    quiet = value(m, "specserve:spec_decode_controller_quiet_steps_total")
    assert quiet == spec.quiet_steps > 0
    assert quiet < value(m, "specserve:spec_decode_controller_steps_total")


def test_gauges_after_the_run(run):
    llm, _, _, _, m, _ = run
    assert value(m, "specserve:num_requests_running") == 0
    assert value(m, "specserve:num_requests_waiting") == 0
    assert value(m, "specserve:kv_cache_usage_perc") == llm.engine.kv_manager.pool.usage() == 0


def test_late_event_after_drain_is_not_lost(run):
    """A step in the worker thread may append to the events a scrape just drained; the next update sees it."""
    llm, exporter, _, _, _, _ = run
    core = llm.engine
    exporter.update(core.snapshot())
    drained = core.stats.events  # what the engine appends to now...
    exporter.update(core.snapshot())  # ...is drained here, as if a step raced with this scrape
    drained.acceptance_lengths.append(2)
    drained.finished.append(RequestTiming("abort", 0.0, None, 0.5, [0.1], 3, 2))
    m0 = parse(exporter.render())
    again = core.snapshot()
    exporter.update(again)
    exporter.update(again)  # the same snapshot twice: counted once only
    exporter.update(core.snapshot())
    m1 = parse(exporter.render())
    for h in (
        "specserve:spec_decode_acceptance_length_count",
        "specserve:e2e_request_latency_seconds_count",
        "specserve:inter_token_latency_seconds_count",
        "specserve:request_prompt_tokens_count",
        "specserve:request_generation_tokens_count",
    ):
        assert value(m1, h) == value(m0, h) + 1, h


def test_log_line(run, caplog):
    llm, exporter, _, _, _, _ = run
    core = llm.engine
    exporter._logged = type(exporter._logged)()  # as if nothing was logged yet
    exporter._last_log -= 100
    snapshot = core.snapshot()
    exporter.update(snapshot)  # what the server's on_step hook does with each snapshot
    with caplog.at_level(logging.INFO, logger="specserve.stats"):
        exporter.maybe_log(snapshot, 10.0)
        exporter.maybe_log(snapshot, 10.0)  # within the interval: silent
    (record,) = caplog.records
    line = record.getMessage()
    spec = core.stats.spec
    for part in (
        "Avg prompt throughput:",
        "Avg generation throughput:",
        "Running: 0 reqs",
        "Waiting: 0 reqs",
        "KV cache usage: 0.0%",
        f"Mean acceptance length: {spec.mean_acceptance_length:.2f}",
        f"Draft acceptance rate: {100 * spec.acceptance_rate:.1f}%",
        "Per-position acceptance rate: " + ", ".join(f"{x:.3f}" for x in spec.per_position_acceptance()),
    ):
        assert part in line, (part, line)
    exporter.maybe_log(snapshot, 0)  # 0 turns logging off


# --- the table of series drives the exporter and the README ---------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
TABLE_START = "<!-- metrics table: generated from specserve.api.metrics.SERIES -->"
TABLE_END = "<!-- end metrics table -->"


def test_the_table_is_what_is_exported(run):
    """Every exported family is a row of SERIES with its type and help, and every row is exported."""
    _, exporter, _, _, _, _ = run
    families = {f.name: f for f in exporter.registry.collect() if f.name.startswith("specserve:")}
    assert set(families) == {row.name for row in SERIES}
    for row in SERIES:
        assert (families[row.name].type, families[row.name].documentation) == (row.kind, row.help), row.name
    exposed = {s.name for f in families.values() for s in f.samples}
    assert not [name for name in exposed if name.endswith("_created")], "_created samples are disabled"
    assert exposed == {name for row in SERIES for name in row.sample_names}
    # The labels each row declares are exactly those of its samples (histograms add `le`).
    for f in families.values():
        row = next(r for r in SERIES if r.name == f.name)
        for s in f.samples:
            keys = set(s.labels) - {"le"}
            info_keys = set(row.read(EngineSnapshot())) if row.kind == "info" else set()
            assert keys == set(row.labels) | info_keys


def test_readme_metric_list_is_the_table():
    text = README.read_text()
    assert TABLE_START in text and TABLE_END in text, "the README's metric list lost its markers"
    listed = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    expected = markdown_table()
    assert listed == expected, (
        f"README.md's metric list is stale; between the markers it should read:\n{expected}"
    )


def test_readme_names_only_exported_series():
    """Series named anywhere in the README exist (recording rules `a:b:rate1m` and image tags aside)."""
    mentioned = set(re.findall(r"specserve:[a-z_]+(?![\w:])", README.read_text()))
    known = {name for row in SERIES for name in (row.name, *row.sample_names)}
    assert mentioned, "the README names no metric at all"
    assert mentioned <= known, mentioned - known
