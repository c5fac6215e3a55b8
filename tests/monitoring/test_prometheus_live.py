"""A real Prometheus (Debian package, run by the test on 127.0.0.1) scrapes a live `specserve serve`
with the shipped config and rules: the acceptance-rate recording rule comes out non-zero, every rule
evaluates cleanly, and every dashboard query runs."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from monitoring_helpers import (
    INSTALL_HINT,
    PROMETHEUS_SYNTHETIC,
    PROMETHEUS_YML,
    RULES,
    dashboard_exprs,
    load_dashboard,
    load_rules,
    promql_metric_names,
    tool,
)
from server_harness import start_server

PROMETHEUS = tool("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus binary not found; {INSTALL_HINT}")

MODEL = "tiny"
# Repetitive prompts: prompt lookup (ngram) finds continuations, and the tiny model's greedy output
# loops, so drafts get accepted.
PROMPTS = [
    "1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5 6 7 8 9 10 11 12 1 2 3 4 5 6 7 8 9 10 11 12",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return a + b\ndef add(a, b):\n",
]
# Grafana's variables, as Grafana would substitute them with "All" selected.
GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$__range": "5m",
    "$namespace": ".*",
    "$job": ".*",
    "$model_name": ".*",
}


def _get(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except OSError as exc:  # not listening yet
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


class Prometheus:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def query(self, expr: str) -> list[dict]:
        body = _get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        return body["data"]["result"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = start_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("logs"),
        "--served-model-name",
        MODEL,
        "--speculative-method",
        "ngram",
        "--max-num-steps",
        "3",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """Our own Prometheus process: temp config and data dir, 1 s scrape/eval, loopback, free port."""
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [server.base_url.removeprefix("http://")]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = work / "prometheus.log"
    for _ in range(3):  # the free port could be taken between probe and bind
        port = _free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={work / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                cwd=work,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}"
        if _ready(proc, url, timeout=20):
            break
        proc.kill()
        proc.wait(10)
        if "address already in use" not in log.read_text():
            pytest.fail(f"Prometheus did not start:\n{log.read_text()[-3000:]}")
    else:
        pytest.fail(f"Prometheus could not bind a free port:\n{log.read_text()[-3000:]}")
    yield Prometheus(proc, url, log)
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _ready(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    """Wait for /-/ready; False as soon as the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def _complete(base_url: str, prompt: str) -> dict:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"{base_url}/v1/completions", body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def traffic(server, prometheus):
    """Requests over a few scrape intervals, sent once Prometheus scrapes the server."""
    _wait(
        lambda: any(s["value"][1] == "1" for s in prometheus.query('up{job="specserve"}')),
        20,
        "Prometheus to scrape specserve (up == 1)",
    )
    results: list[dict] = []
    for _ in range(3):
        threads = [
            threading.Thread(target=lambda p=p: results.append(_complete(server.base_url, p)))
            for p in PROMPTS
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(1.2)
    assert len(results) == 3 * len(PROMPTS)
    return results


def test_acceptance_rate_recording_rule_is_nonzero(server, prometheus, traffic):
    spec = [r["usage"]["speculative"] for r in traffic]
    accepted = sum(u["num_accepted_tokens"] for u in spec)
    assert accepted > 0, f"the workload must get drafts accepted: {spec}"
    # The server's counters agree with what its responses reported (this is the only traffic).
    live = _raw_metrics(server.base_url)
    for name, total in (
        ("specserve:spec_decode_num_accepted_tokens_total", accepted),
        ("specserve:spec_decode_num_draft_tokens_total", sum(u["num_draft_tokens"] for u in spec)),
        ("specserve:generation_tokens_total", sum(r["usage"]["completion_tokens"] for r in traffic)),
    ):
        (value,) = re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", live, re.M)
        assert float(value) == total, name

    def nonzero():
        return [
            s
            for s in prometheus.query("specserve:spec_decode_acceptance_rate:rate1m")
            if float(s["value"][1]) > 0
        ]

    (sample,) = _wait(nonzero, 30, "a non-zero specserve:spec_decode_acceptance_rate:rate1m", 0.5)
    assert 0 < float(sample["value"][1]) <= 1
    labels = sample["metric"]
    assert labels["model_name"] == MODEL and labels["proposer"] == "ngram" and labels["job"] == "specserve"
    (length,) = _wait(
        lambda: prometheus.query("specserve:spec_decode_mean_acceptance_length:rate1m > 1"),
        15,
        "mean acceptance length > 1",
        0.5,
    )
    assert 1 < float(length["value"][1]) <= 4  # k = 3


def test_every_rule_evaluates_cleanly(prometheus, traffic):
    def evaluated():
        groups = _get(f"{prometheus.url}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules) else None

    rules = _wait(evaluated, 15, "every rule to be evaluated")
    assert {r["name"] for r in rules} == {r.get("record") or r.get("alert") for r in load_rules()}
    for r in rules:
        assert r["health"] == "ok", r
    firing = [r["name"] for r in rules if r["type"] == "alerting" and r["state"] == "firing"]
    assert not firing, firing


def test_dashboard_queries_run_and_metrics_exist(server, prometheus, traffic):
    names_in_tsdb = set(_get(f"{prometheus.url}/api/v1/label/__name__/values")["data"])
    live = set(re.findall(r"^([a-zA-Z_:][\w:]*)", _raw_metrics(server.base_url), re.M))
    exprs = dashboard_exprs(load_dashboard())
    for title, expr in exprs:
        for name in promql_metric_names(expr) - PROMETHEUS_SYNTHETIC:
            assert name in live, f"panel {title!r}: {name} not in the live /metrics"
            assert name in names_in_tsdb, f"panel {title!r}: {name} not scraped by Prometheus"
        q = expr
        for var, val in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
            q = q.replace(var, val)
        prometheus.query(q)  # asserts status == success: the PromQL parses and evaluates
    # The headline panels have data after the traffic.
    by_title = {}
    for title, expr in exprs:
        by_title.setdefault(title, expr)
    for title in (
        "Draft acceptance rate",
        "Generation tokens/s",
        "Requests running / waiting",
        "Time per output token (TPOT)",
        "Finish reasons (time range)",
        "Prompt length per request",
        "Generation length per request",
    ):
        q = by_title[title]
        for var, val in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
            q = q.replace(var, val)
        assert prometheus.query(q), title


def _raw_metrics(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        return r.read().decode()
