"""Shared by tests/monitoring: paths, PromQL metric-name extraction, the exporter's metric names."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from specserve.api.metrics import SERIES

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
DASHBOARD = MONITORING / "grafana" / "specserve-dashboard.json"
PROMETHEUS_YML = MONITORING / "prometheus" / "prometheus.yml"
RULES = MONITORING / "prometheus" / "rules.yml"
RULES_TEST = MONITORING / "prometheus" / "rules_test.yml"
HELM_DASHBOARD = REPO / "helm" / "specserve" / "dashboards" / "specserve-dashboard.json"
INSTALL_HINT = "install it with: bash scripts/install_prometheus.sh (Debian package `prometheus`)"

# Series Prometheus itself attaches to every target.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "atan2",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (Grafana's $variables allowed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    e = re.sub(r"\$\{?\w+\}?", "", e)  # Grafana variables
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range and subquery selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.:])[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        if e[m.end() :].lstrip().startswith("("):  # function or aggregation
            continue
        if m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expression) for every query of every panel, rows included."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return out


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def load_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def exported_names() -> set[str]:
    """Every sample name the server exports (with _total, _bucket, _info... suffixes), from the table of
    series the exporter is built from (tests/api/test_metrics.py checks a live exporter against it)."""
    return {name for row in SERIES for name in row.sample_names}


def tool(name: str) -> str | None:
    return shutil.which(name)
