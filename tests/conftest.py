from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(path, "llama", seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """A different random llama sharing the target's tokenizer/vocab: a real but weak draft."""
    path = tmp_path_factory.mktemp("tiny-draft")
    build_tiny_model(path, "llama", seed=1, num_hidden_layers=1)
    return path
