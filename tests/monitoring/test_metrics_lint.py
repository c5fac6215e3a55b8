"""`promtool check metrics` on a live server's /metrics (after real traffic): clean apart from the ':' in
our vLLM-style names (the documented exception), no `_created` samples, `model_name` on every series."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request

import pytest
from monitoring_helpers import INSTALL_HINT, exported_names, tool
from prometheus_client.parser import text_string_to_metric_families
from server_harness import start_server

from specserve.api.metrics import SERIES

PROMTOOL = tool("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool not found; {INSTALL_HINT}")
# The one lint rule we break on purpose (README, "Monitoring"): names keep vLLM's ':' so dashboards port.
COLON = re.compile(r"^(specserve:[a-z0-9_:]+) metric names should not contain ':'$")


@pytest.fixture(scope="module")
def scraped(tiny_llama_dir, tmp_path_factory) -> str:
    srv = start_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("lint"),
        "--served-model-name",
        "tiny",
        "--speculative-method",
        "ngram",
    )
    try:
        body = {"model": "tiny", "prompt": "1 2 3 1 2 3 1 2 3 1 2", "max_tokens": 8, "ignore_eos": True}
        request = urllib.request.Request(
            srv.api_url + "/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as r:
            return r.read().decode()
    finally:
        srv.stop()


def test_promtool_check_metrics_passes_but_for_the_colon(scraped):
    proc = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=scraped, capture_output=True, text=True, timeout=60
    )
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    others = [line for line in problems if not COLON.match(line)]
    assert not others, "promtool found more than the documented ':' exception:\n" + "\n".join(others)
    # The exception covers exactly our own families, nothing else.
    flagged = {COLON.match(line).group(1) for line in problems}
    assert flagged and flagged <= exported_names() | {row.name for row in SERIES}


def test_no_created_samples_and_model_name_everywhere(scraped):
    assert "_created" not in scraped
    ours = 0
    for family in text_string_to_metric_families(scraped):
        for sample in family.samples:
            if sample.name.startswith("specserve:"):
                ours += 1
                assert sample.labels.get("model_name") == "tiny", sample
            else:
                assert sample.name.startswith(("process_", "python_")), sample.name
    assert ours
    assert "specserve:cache_config_info{" in scraped and 'model_name="tiny"' in scraped
