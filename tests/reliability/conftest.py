from __future__ import annotations

import pytest
from server_harness import start_server


@pytest.fixture(scope="session")
def roomy_server(tiny_llama_dir, tmp_path_factory):
    """A server with plenty of KV cache (ngram speculation on), shared by the reliability tests."""
    srv = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"), "--served-model-name", "tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")
