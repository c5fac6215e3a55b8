"""monitoring/: the Grafana dashboard and the Prometheus config and rules are valid and name only
metrics the server exports."""

from __future__ import annotations

import re
import subprocess

import pytest
from monitoring_helpers import (
    DASHBOARD,
    HELM_DASHBOARD,
    INSTALL_HINT,
    PROMETHEUS_SYNTHETIC,
    PROMETHEUS_YML,
    RULES,
    RULES_TEST,
    dashboard_exprs,
    exported_names,
    load_dashboard,
    load_rules,
    promql_metric_names,
    tool,
)


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names the server exports, from the exporter's table of series."""
    return exported_names()


def test_promql_metric_names_extractor():
    expr = (
        'sum by (position) (rate(specserve:a_total{namespace=~"$namespace", x="sum(y)"}[$__rate_interval]))\n'
        "/ ignoring (position) group_left ()\n"
        "(sum(rate(specserve:b_total[5m] offset 1h)) > 0) and on (instance) up == 0 or vector(1e-3)"
    )
    assert promql_metric_names(expr) == {"specserve:a_total", "specserve:b_total", "up"}
    assert promql_metric_names("histogram_quantile(0.9, sum by (le) (rate(m_bucket[1m])))") == {"m_bucket"}


def test_dashboard_is_importable_grafana_json():
    d = load_dashboard()
    assert d["schemaVersion"] >= 39
    assert d["title"] and d["uid"] == "specserve"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for v in variables.values():
        if "datasource" in v:
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    text = DASHBOARD.read_text()
    # No hard-coded datasource: every uid in the file is the variable (or the dashboard's own uid).
    uids = set(re.findall(r'"uid": "([^"]*)"', text))
    assert uids <= {"${datasource}", "specserve", "-- Grafana --"}, uids
    ids = []
    for p in d["panels"]:
        ids.append(p["id"])
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert t["expr"].strip() and t["refId"]
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24
    assert len(ids) == len(set(ids))


def test_dashboard_covers_the_issue(exported):
    exprs = dashboard_exprs(load_dashboard())
    used = set().union(*(promql_metric_names(e) for _, e in exprs))
    for name in (
        "specserve:spec_decode_num_accepted_tokens_total",
        "specserve:spec_decode_num_draft_tokens_total",
        "specserve:spec_decode_num_drafts_total",
        "specserve:spec_decode_num_accepted_tokens_per_pos_total",
        "specserve:spec_decode_chosen_num_speculative_tokens_sum",
        "specserve:spec_decode_chosen_num_speculative_tokens_count",
        "specserve:spec_decode_chosen_num_speculative_tokens_bucket",
        "specserve:spec_decode_controller_predicted_tokens_total",
        "specserve:spec_decode_controller_measured_tokens_total",
        "specserve:spec_decode_controller_predicted_step_seconds_total",
        "specserve:spec_decode_controller_measured_step_seconds_total",
        "specserve:spec_decode_controller_quiet_steps_total",
        "specserve:spec_decode_draft_seconds_total",
        "specserve:spec_decode_verify_seconds_total",
        "specserve:generation_tokens_total",
        "specserve:time_to_first_token_seconds_bucket",
        "specserve:inter_token_latency_seconds_bucket",
        "specserve:e2e_request_latency_seconds_bucket",
        "specserve:num_requests_running",
        "specserve:num_requests_waiting",
        "specserve:kv_cache_usage_perc",
        "specserve:num_preemptions_total",
    ):
        assert name in used, name
    quantiles = [e for _, e in exprs if e.startswith("histogram_quantile(")]
    # The vLLM dashboard's request panels, from the series we have (issue 17).
    by_title: dict[str, set[str]] = {}
    for title, e in exprs:
        by_title.setdefault(title, set()).update(promql_metric_names(e))
    assert by_title["Time per output token (TPOT)"] == {
        "specserve:inter_token_latency_seconds_sum",
        "specserve:inter_token_latency_seconds_count",
    }
    assert {
        "specserve:request_queue_time_seconds_sum",
        "specserve:time_to_first_token_seconds_sum",
        "specserve:e2e_request_latency_seconds_sum",
    } <= by_title["Queue, prefill and decode time per request"]
    for kind in ("prompt", "generation"):
        metric = f"specserve:request_{kind}_tokens"
        assert by_title[f"{kind.capitalize()} length per request"] == {
            f"{metric}_bucket",
            f"{metric}_sum",
            f"{metric}_count",
        }
        qs = {e.split(",")[0] for e in quantiles if f"{metric}_bucket" in e}
        assert qs == {"histogram_quantile(0.5", "histogram_quantile(0.9", "histogram_quantile(0.99"}, kind
    assert by_title["Finish reasons (time range)"] == {"specserve:request_success_total"}
    for metric in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        qs = {e.split(",")[0] for e in quantiles if f"specserve:{metric}_seconds_bucket" in e}
        assert qs == {"histogram_quantile(0.5", "histogram_quantile(0.9", "histogram_quantile(0.99"}, metric


def test_dashboard_names_only_exported_metrics(exported):
    assert "specserve:spec_decode_num_accepted_tokens_per_pos_total" in exported
    assert "specserve:cache_config_info" in exported
    for title, expr in dashboard_exprs(load_dashboard()):
        names = promql_metric_names(expr)
        assert names, (title, expr)
        unknown = names - exported - PROMETHEUS_SYNTHETIC
        assert not unknown, f"panel {title!r} uses metrics the server does not export: {unknown}"


def test_rules_name_only_exported_metrics(exported):
    rules = load_rules()
    recorded = {r["record"] for r in rules if "record" in r}
    assert {
        "specserve:spec_decode_acceptance_rate:rate1m",
        "specserve:spec_decode_mean_acceptance_length:rate1m",
    } <= recorded
    alerts = {r["alert"] for r in rules if "alert" in r}
    assert {
        "SpecServeAcceptanceRateCollapse",
        "SpecServeKVCacheNearlyFull",
        "SpecServeWaitingQueueGrowing",
        "SpecServeDown",
    } <= alerts
    for r in rules:
        names = promql_metric_names(r["expr"])
        assert names, r
        unknown = names - exported - PROMETHEUS_SYNTHETIC - recorded
        assert not unknown, f"rule {r.get('record') or r.get('alert')} uses unknown metrics: {unknown}"
    down = next(r for r in rules if r.get("alert") == "SpecServeDown")
    assert "up" in promql_metric_names(down["expr"]) and "== 0" in down["expr"]


def test_helm_chart_carries_the_same_dashboard():
    assert HELM_DASHBOARD.read_bytes() == DASHBOARD.read_bytes()


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip(f"promtool not found; {INSTALL_HINT}")
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_config():
    r = _promtool("check", "config", str(PROMETHEUS_YML))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr


def test_promtool_check_rules():
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_rule_unit_tests():
    r = _promtool("test", "rules", str(RULES_TEST))
    assert r.returncode == 0, r.stdout + r.stderr
