"""Helpers for the deployment tests: find the real helm binary and render the chart with it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specserve"
DATA = Path(__file__).resolve().parent / "data"
RELEASE = "rel"
NAMESPACE = "llm"


def find_helm() -> str | None:
    """$HELM, then the project-local install (scripts/install_helm.sh), then PATH."""
    for candidate in (os.environ.get("HELM"), str(REPO / ".tools" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    return None


HELM = find_helm()
requires_helm = pytest.mark.skipif(
    HELM is None,
    reason="helm binary not found ($HELM, .tools/bin/helm or PATH); install it with `bash scripts/install_helm.sh`",
)


def run_helm(*args: str, values: dict | None = None) -> subprocess.CompletedProcess[str]:
    """Runs helm with the given values (written as a JSON file, which is valid YAML) and no network."""
    assert HELM is not None
    cmd = [HELM, *args]
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/specserve-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/specserve-helm/config",
        "HELM_DATA_HOME": "/tmp/specserve-helm/data",
    }
    if values is not None:
        path = Path("/tmp/specserve-helm") / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
        cmd += ["-f", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)


@cache
def _render(values_json: str) -> tuple[dict, ...]:
    proc = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, values=json.loads(values_json))
    if proc.returncode != 0:
        raise AssertionError(f"helm template failed:\n{proc.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(values: dict | None = None) -> list[dict]:
    """The chart's manifests (helm template) for these values, as dicts."""
    return list(_render(json.dumps(values or {}, sort_keys=True)))


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists properties and does not allow others
    (what the API server's strict field validation does for a structural CRD schema)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(plural: str, version: str = "v1") -> Any:
    """jsonschema validator for a vendored prometheus-operator CRD (tests/deploy/data/README.md)."""
    import jsonschema

    (crd,) = [d for d in yaml.safe_load_all((DATA / f"monitoring.coreos.com_{plural}.yaml").read_text()) if d]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(served["schema"]["openAPIV3Schema"])
    # What the API server checks besides the schema: the group/version and kind of the object.
    schema["properties"]["apiVersion"]["const"] = f"{crd['spec']['group']}/{version}"
    schema["properties"]["kind"]["const"] = crd["spec"]["names"]["kind"]
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return jsonschema.Draft7Validator(schema)
