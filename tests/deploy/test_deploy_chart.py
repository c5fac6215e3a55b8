"""helm/specserve rendered with the real helm binary, validated against the Kubernetes schemas.

helm comes from scripts/install_helm.sh (.tools/bin/helm); the tests skip only when no helm binary exists.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import (
    CHART,
    NAMESPACE,
    REPO,
    by_kind,
    container,
    crd_validator,
    one,
    render,
    requires_helm,
    run_helm,
)

pytestmark = requires_helm

K8S_VERSION = kubernetes_validate.latest_version()
# prometheus-operator CRDs are not in the core schemas: PrometheusRule is validated against its vendored
# CRD schema (tests/deploy/data), ServiceMonitor is checked by hand below.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
RULES = CHART / "rules" / "rules.yml"

GPU = {
    "devices": "gpu",
    "model": {
        "path": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "quantizationEncoding": "bfloat16",
        "servedModelName": "qwen-coder",
        "maxLength": 4096,
        "maxBatchSize": 16,
    },
    "draftModel": {"path": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "quantizationEncoding": "int8"},
    "speculative": {"method": "draft_model", "maxNumSteps": 4},
    "engine": {
        "deviceMemoryUtilization": 0.6,
        "enableChunkedPrefill": False,
        "enablePrefixCaching": True,
        "numThreads": 8,
    },
    "extraArgs": ["--max-num-steps=3"],
    "hfToken": {"existingSecret": "hf-token", "secretKey": "token"},
    "apiKey": {"existingSecret": "specserve-api", "secretKey": "key"},
    "cache": {
        "persistence": {
            "enabled": True,
            "storageClass": "fast-rwx",
            "accessModes": ["ReadWriteMany"],
            "size": "100Gi",
        }
    },
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
}
AUTOSCALING_CPU = {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8}}
AUTOSCALING_QUEUE = {
    "autoscaling": {
        "enabled": True,
        "maxReplicas": 6,
        "cpu": {"enabled": False},
        "requestsWaiting": {"enabled": True, "targetAverageValue": "3"},
    }
}
INGRESS = {
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
        "hosts": [
            {"host": "llm.example.com", "paths": [{"path": "/v1", "pathType": "Prefix"}]},
            {"paths": [{"path": "/", "pathType": "Prefix"}]},
        ],
        "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
    },
    "service": {"type": "LoadBalancer", "port": 8080},
}
OBSERVED = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}},
    "cache": {"persistence": {"enabled": True, "existingClaim": "models"}},
    "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
}

# The operator knobs of issue 17, all at once.
PREFETCH = {
    "name": "prefetch",
    "image": "ghcr.io/specserve/specserve:0.1.0-gpu",
    "command": ["specserve", "download", "Qwen/Qwen2.5-Coder-1.5B-Instruct"],
    "env": [{"name": "HOME", "value": "/tmp"}, {"name": "SPECSERVE_CACHE_DIR", "value": "/cache/specserve"}],
    "volumeMounts": [{"name": "cache", "mountPath": "/cache"}, {"name": "tmp", "mountPath": "/tmp"}],
}
OPERATOR = {
    "runtimeClassName": "nvidia",
    "gpuNodeAffinity": {
        "enabled": True,
        "matchExpressions": [
            {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]},
            {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]},
        ],
    },
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "specserve"}},
                    },
                }
            ]
        }
    },
    "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "initContainers": [PREFETCH],
    "extraEnv": [{"name": "SPECSERVE_MAX_WAITING_REQUESTS", "value": "64"}],
    "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "engine": {**GPU["engine"], "maxKvCacheTokens": 65536},
    "logging": {"level": "warning", "format": "json", "accessLog": False},
}

VARIANTS = {
    "default": {},
    "gpu": GPU,
    "autoscaling-cpu": AUTOSCALING_CPU,
    "autoscaling-queue": AUTOSCALING_QUEUE,
    "ingress": INGRESS,
    "observed": OBSERVED,
    "everything": {
        **GPU,
        **AUTOSCALING_QUEUE,
        **INGRESS,
        **OPERATOR,
        "serviceMonitor": OBSERVED["serviceMonitor"],
        "prometheusRule": OBSERVED["prometheusRule"],
        "grafanaDashboard": OBSERVED["grafanaDashboard"],
    },
}


# --- every variant renders, lints and validates -------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_validate_against_kubernetes_schemas(variant):
    docs = render(VARIANTS[variant])
    assert {"Deployment", "Service"} <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["kind"] == "PrometheusRule":
            errors = [
                f"{e.message} at {list(e.path)}" for e in crd_validator("prometheusrules").iter_errors(doc)
            ]
            assert not errors, errors
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {K8S_VERSION}: "
                f"{str(e).splitlines()[0]} at {list(e.path)}"
            )
        assert doc["metadata"]["namespace"] == NAMESPACE
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "specserve"


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_strict(variant):
    proc = run_helm("lint", "--strict", str(CHART), values=VARIANTS[variant])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_notes_render_with_instructions():
    proc = run_helm(
        "install",
        "rel",
        str(CHART),
        "--dry-run=client",
        "--namespace",
        NAMESPACE,
        values={**AUTOSCALING_QUEUE, "apiKey": {"existingSecret": "specserve-api"}},
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/rel-specserve" in notes
    assert "/v1/chat/completions" in notes and "Authorization: Bearer" in notes
    assert "specserve:num_requests_waiting" in notes


# --- the essentials -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_hit_health_on_the_served_port(variant):
    c = container(render(VARIANTS[variant]))
    port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
        assert c[probe]["httpGet"]["port"] in port_names, probe
    assert f"--port={port_names['http']}" in c["args"]
    # The startup probe leaves slow model loads time before liveness can restart the pod.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_default_values():
    docs = render()
    c = container(docs)
    assert c["command"] == ["specserve", "serve"]
    assert c["image"] == "ghcr.io/specserve/specserve:0.1.0"
    assert "--devices=cpu" in c["args"] and "--host=0.0.0.0" in c["args"]
    assert not any(a.startswith(("--model-path", "--draft-model-path")) for a in c["args"])  # embedded model
    assert "--speculative-method=auto" in c["args"]
    assert not any(a.startswith("--max-num-steps") for a in c["args"])  # the engine picks K per encoding
    assert not any(a.startswith("--num-threads") for a in c["args"])  # the server reads its CPU quota
    assert "--enable-chunked-prefill" in c["args"]
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    # A CPU limit, so the server's thread count follows the cgroup quota.
    assert c["resources"]["limits"]["cpu"] == c["resources"]["requests"]["cpu"]
    assert "--log-level=info" in c["args"] and "--log-format=text" in c["args"]
    assert "--no-access-log" not in c["args"] and not any("--max-kv-cache-tokens" in a for a in c["args"])
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert not {"runtimeClassName", "initContainers", "affinity", "topologySpreadConstraints"} & pod.keys()
    env = {e["name"]: e for e in c["env"]}
    assert "HF_TOKEN" not in env and "SPECSERVE_API_KEY" not in env
    assert one(docs, "Deployment")["spec"]["replicas"] == 1
    assert not by_kind(docs, "HorizontalPodAutoscaler") and not by_kind(docs, "Ingress")
    assert not by_kind(docs, "PersistentVolumeClaim") and not by_kind(docs, "ServiceMonitor")
    assert not by_kind(docs, "PrometheusRule")
    svc = one(docs, "Service")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]


def test_args_carry_model_draft_and_speculative_flags():
    c = container(render(GPU))
    args = c["args"]
    for flag in (
        "--model-path=Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "--quantization-encoding=bfloat16",
        "--served-model-name=qwen-coder",
        "--max-length=4096",
        "--max-batch-size=16",
        "--draft-model-path=Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "--draft-quantization-encoding=int8",
        "--speculative-method=draft_model",
        "--max-num-steps=4",
        "--device-memory-utilization=0.6",
        "--no-enable-chunked-prefill",
        "--enable-prefix-caching",
        "--num-threads=8",
        "--devices=gpu",
    ):
        assert flag in args, (flag, args)
    assert "--enable-chunked-prefill" not in args
    assert args[-1] == "--max-num-steps=3"  # extraArgs come last, so they override
    assert c["image"].endswith(":0.1.0-gpu")


def test_plugin_method_and_odd_paths_stay_one_arg():
    c = container(
        render(
            {
                "speculative": {"method": "my_pkg.proposers:Eagle", "maxNumSteps": 2},
                "model": {"path": "/cache/models/my model: v2"},
            }
        )
    )
    assert "--speculative-method=my_pkg.proposers:Eagle" in c["args"]
    assert "--model-path=/cache/models/my model: v2" in c["args"]


def test_secret_refs_used():
    c = container(render(GPU))
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["SPECSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "specserve-api", "key": "key"}
    assert "value" not in env["HF_TOKEN"] and "value" not in env["SPECSERVE_API_KEY"]


def test_gpu_preset_and_scheduling():
    docs = render(GPU)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == GPU["nodeSelector"]


def test_explicit_resources_replace_the_preset():
    res = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert container(render({"devices": "gpu", "resources": res}))["resources"] == res


def test_security_context_non_root_read_only_with_writable_volumes():
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {"/tmp", "/dev/shm", "/cache"} <= set(mounts)
    assert (
        "emptyDir" in volumes[mounts["/tmp"]]
        and volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    )
    assert "emptyDir" in volumes[mounts["/cache"]]
    env = {e["name"]: e.get("value") for e in c["env"]}
    for var in ("SPECSERVE_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME"):
        assert env[var].startswith("/cache/"), var
    assert env["HOME"] == "/tmp"


def test_cache_pvc():
    docs = render(GPU)
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["storageClassName"] == "fast-rwx"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]

    docs = render(OBSERVED)  # existingClaim: used, not created
    assert not by_kind(docs, "PersistentVolumeClaim")
    volumes = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == "models"


def test_autoscaling_cpu():
    docs = render(AUTOSCALING_CPU)
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert "replicas" not in one(docs, "Deployment")["spec"]  # the HPA owns it
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
        }
    ]


def test_autoscaling_on_requests_waiting():
    hpa = one(render(AUTOSCALING_QUEUE), "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "specserve:num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "3"},
            },
        }
    ]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_ingress_routes_to_the_service():
    docs = render(INGRESS)
    ing = one(docs, "Ingress")
    svc = one(docs, "Service")
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"][0]["port"] == 8080
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [{"hosts": ["llm.example.com"], "secretName": "llm-tls"}]
    assert ing["spec"]["rules"][0]["host"] == "llm.example.com" and "host" not in ing["spec"]["rules"][1]
    for rule in ing["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            assert path["backend"]["service"] == {"name": svc["metadata"]["name"], "port": {"name": "http"}}


def test_pdb():
    pdb = one(render(), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    pdb = one(render(OBSERVED), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    assert not by_kind(render({"podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget")


def test_service_monitor_scrapes_metrics():
    docs = render(OBSERVED)
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"] == one(docs, "Service")["spec"]["selector"]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert sm["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]


def test_grafana_dashboard_configmap():
    cms = [
        cm for cm in by_kind(render(OBSERVED), "ConfigMap") if cm["metadata"]["name"].endswith("-dashboard")
    ]
    assert len(cms) == 1
    cm = cms[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = (CHART / "dashboards" / "specserve-dashboard.json").read_text()
    assert cm["data"]["specserve-dashboard.json"] == shipped.rstrip("\n")
    dashboard = json.loads(cm["data"]["specserve-dashboard.json"])
    assert dashboard["title"] and dashboard["panels"]
    assert not by_kind(render({"grafanaDashboard": {"enabled": False}}), "ConfigMap")


def test_chart_dashboard_is_the_monitoring_dashboard():
    """The chart carries its own copy (helm cannot read outside the chart); it must equal the source."""
    source = REPO / "monitoring" / "grafana" / "specserve-dashboard.json"
    if not source.exists():
        pytest.skip(f"{source.relative_to(REPO)} does not exist yet; nothing to keep in sync")
    copy = CHART / "dashboards" / "specserve-dashboard.json"
    assert copy.read_bytes() == source.read_bytes(), (
        f"run: cp {source.relative_to(REPO)} {copy.relative_to(REPO)}"
    )


# --- bad values are refused at install time -----------------------------------------------------

INVALID = {
    "negative-replicas": ({"replicaCount": -1}, "replicaCount"),
    "utilisation-above-1": ({"engine": {"deviceMemoryUtilization": 1.5}}, "deviceMemoryUtilization"),
    "utilisation-zero": ({"engine": {"deviceMemoryUtilization": 0}}, "deviceMemoryUtilization"),
    "unknown-device": ({"devices": "tpu"}, "devices"),
    "bad-quantization": ({"model": {"quantizationEncoding": "int3"}}, "quantizationEncoding"),
    "zero-draft-steps": ({"speculative": {"maxNumSteps": 0}}, "maxNumSteps"),
    "string-replicas": ({"replicaCount": "two"}, "replicaCount"),
    "typo-key": ({"replicas": 2}, "replicas"),
    "typo-nested-key": ({"model": {"pathh": "x"}}, "pathh"),
    "zero-threads": ({"engine": {"numThreads": 0}}, "numThreads"),
    "zero-kv-tokens": ({"engine": {"maxKvCacheTokens": 0}}, "maxKvCacheTokens"),
    "bad-log-format": ({"logging": {"format": "xml"}}, "format"),
    "bad-runtime-class": ({"runtimeClassName": "Not A Name"}, "runtimeClassName"),
    "extra-volume-named-cache": ({"extraVolumes": [{"name": "cache", "emptyDir": {}}]}, "name"),
    "mount-without-path": ({"extraVolumeMounts": [{"name": "models"}]}, "mountPath"),
    "init-container-without-image": ({"initContainers": [{"name": "prefetch"}]}, "image"),
    "bad-gpu-affinity-operator": (
        {"gpuNodeAffinity": {"enabled": True, "matchExpressions": [{"key": "k", "operator": "Is"}]}},
        "operator",
    ),
    "typo-prometheus-rule-key": ({"prometheusRule": {"enable": True}}, "enable"),
    "draft-method-without-draft": ({"speculative": {"method": "draft_model"}}, "path"),
    "bad-ingress-path": ({"ingress": {"enabled": True, "hosts": [{"paths": [{"path": "v1"}]}]}}, "path"),
    "min-above-max-replicas": (
        {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
        "minReplicas",
    ),
    "autoscaling-without-metric": (
        {"autoscaling": {"enabled": True, "cpu": {"enabled": False}}},
        "autoscaling",
    ),
}


# Relations JSON Schema cannot state are checked by `fail` in the templates; `helm lint` only logs those.
TEMPLATE_CHECKED = {"min-above-max-replicas", "autoscaling-without-metric"}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_values_refused(case):
    values, field = INVALID[case]
    commands = [("template", "rel", str(CHART))]
    if case not in TEMPLATE_CHECKED:  # the schema refuses it, so lint does too
        commands.append(("lint", "--strict", str(CHART)))
    for args in commands:
        proc = run_helm(*args, values=values)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"helm {args[0]} accepted {values}:\n{out}"
        assert field in out, f"helm {args[0]} error does not name {field!r}:\n{out}"


@pytest.mark.parametrize(
    ("value", "ok"), [("0.6", True), ("1", True), ("1.5", False), ("0", False), ("-0.2", False)]
)
def test_utilisation_from_helm_set(value, ok):
    """`helm --set` passes decimals as strings; the schema takes numeric strings in (0, 1] too."""
    proc = run_helm("template", "rel", str(CHART), "--set", f"engine.deviceMemoryUtilization={value}")
    assert (proc.returncode == 0) is ok, proc.stderr
    if ok:
        assert f'"--device-memory-utilization={value}"' in proc.stdout
    else:
        assert "deviceMemoryUtilization" in proc.stderr


# --- issue 17: operator knobs, alerts in the cluster ---------------------------------------------


def test_operator_knobs_render():
    docs = render(VARIANTS["everything"])
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["initContainers"] == [PREFETCH]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert {"name": "SPECSERVE_MAX_WAITING_REQUESTS", "value": "64"} in c["env"]
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert "checksum/args" in annotations
    # A spread constraint without a selector selects this release's pods.
    (spread,) = pod["topologySpreadConstraints"]
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert spread["labelSelector"] == {"matchLabels": selector}
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    for flag in (
        "--max-kv-cache-tokens=65536",
        "--log-level=warning",
        "--log-format=json",
        "--no-access-log",
    ):
        assert flag in c["args"], (flag, c["args"])
    assert c["args"][-1] == "--max-num-steps=3"  # extraArgs still come last


def test_gpu_node_affinity():
    expressions = OPERATOR["gpuNodeAffinity"]["matchExpressions"]
    pod = one(render(VARIANTS["everything"]), "Deployment")["spec"]["template"]["spec"]
    affinity = pod["affinity"]
    assert affinity["podAntiAffinity"] == OPERATOR["affinity"]["podAntiAffinity"]  # the user's, kept
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": expressions}]
    # The user's own required terms are ORed: the GPU expressions are ANDed into each of them.
    own = {"key": "pool", "operator": "In", "values": ["a"]}
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [own]}, {"matchFields": [own]}]
            }
        }
    }
    values = {"devices": "gpu", "gpuNodeAffinity": OPERATOR["gpuNodeAffinity"], "affinity": user}
    pod = one(render(values), "Deployment")["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {"matchExpressions": [own, *expressions]},
        {"matchFields": [own], "matchExpressions": expressions},
    ]
    kubernetes_validate.validate(one(render(values), "Deployment"), K8S_VERSION, strict=True)
    # Only for GPU pods, and only when enabled.
    cpu = one(render({"gpuNodeAffinity": {"enabled": True}}), "Deployment")["spec"]["template"]["spec"]
    assert "affinity" not in cpu
    assert "affinity" not in one(render({"devices": "gpu"}), "Deployment")["spec"]["template"]["spec"]


def _rules_file() -> dict:
    return yaml.safe_load(RULES.read_text())


def test_prometheus_rule_is_the_monitoring_rules_file(tmp_path):
    docs = render(OBSERVED)
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == {"groups": _rules_file()["groups"]}  # one source, rendered whole
    # Prometheus's own template syntax reaches it untouched by helm's.
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "{{ $labels.instance }}" in alerts["SpecServeKVCacheNearlyFull"]["annotations"]["summary"]
    assert not by_kind(render({"prometheusRule": {"enabled": False}}), "PrometheusRule")
    # The rules as the operator hands them to Prometheus pass promtool.
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found; install it with: bash scripts/install_prometheus.sh")
    extracted = tmp_path / "extracted-rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    proc = subprocess.run(
        [promtool, "check", "rules", str(extracted)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 rules found" in proc.stdout


def test_monitoring_rules_file_is_the_chart_file():
    """monitoring/prometheus/rules.yml is a symlink to the chart's copy, so the two cannot differ."""
    link = REPO / "monitoring" / "prometheus" / "rules.yml"
    assert link.is_symlink() and link.resolve() == RULES.resolve()


def test_prometheus_rule_crd_schema_refuses_bad_objects():
    """The vendored CRD schema really checks: a typo'd field, a bad duration, a rule without expr."""
    good = one(render(OBSERVED), "PrometheusRule")
    validator = crd_validator("prometheusrules")
    assert not list(validator.iter_errors(good))
    bad_group = {"name": "g", "rules": [{"record": "x", "expr": "up"}], "intervall": "1m"}
    for spec in (
        {"groups": [bad_group]},
        {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": "ten minutes"}]}]},
        {"groups": [{"name": "g", "rules": [{"alert": "A"}]}]},
    ):
        assert list(validator.iter_errors({**good, "spec": spec})), spec


def test_packaged_chart_carries_the_rules(tmp_path):
    """`helm package` puts the rules (and dashboard) in the archive, and the archive renders them."""
    proc = run_helm("package", str(CHART), "--destination", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (archive,) = tmp_path.glob("specserve-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.extractfile("specserve/rules/rules.yml")
        assert member is not None and member.read() == RULES.read_bytes()
        assert "specserve/dashboards/specserve-dashboard.json" in tar.getnames()
    proc = run_helm("template", "rel", str(archive), "--set", "prometheusRule.enabled=true")
    assert proc.returncode == 0, proc.stderr
    (rule,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == _rules_file()["groups"]
