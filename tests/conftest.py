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


def _noisy_copy_of_target(path: Path, noise: float) -> Path:
    import torch

    model = build_tiny_model(path, "llama", seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * noise)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> Path:
    """The target's weights plus noise, sharing its tokenizer: a draft that agrees often, not always."""
    return _noisy_copy_of_target(tmp_path_factory.mktemp("tiny-draft"), 0.04)


@pytest.fixture(scope="session")
def tiny_close_draft_dir(tmp_path_factory) -> Path:
    """A draft closer to the target (a quarter of tiny_draft_dir's noise): accepted often enough on
    every position that the adaptive controller keeps drafting with it, yet not always."""
    return _noisy_copy_of_target(tmp_path_factory.mktemp("tiny-close-draft"), 0.01)
