from __future__ import annotations

import pytest
from server_harness import start_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """One real server (ngram speculation on) shared by a test module."""
    srv = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"), "--served-model-name", "tiny")
    yield srv
    srv.stop()
