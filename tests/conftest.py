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
    """The target's weights plus noise, sharing its tokenizer: a draft that agrees often, not always."""
    import torch

    path = tmp_path_factory.mktemp("tiny-draft")
    model = build_tiny_model(path, "llama", seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.04)
    model.save_pretrained(path)
    return path
