from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

TOY_PLUGIN = '''
from specserve.engine.proposer import Proposals, Proposer


class RepeatLastProposer(Proposer):
    """Proposes the last token k times: often wrong, which exercises rejection."""

    name = "toy"

    def __init__(self, ctx):
        super().__init__(ctx)

    def propose(self, batch):
        return Proposals([[b.request.all_token_ids[-1]] * b.num_speculative_tokens for b in batch], [None] * len(batch))
'''


@pytest.fixture(scope="session")
def toy_plugin_entry_point(tmp_path_factory):
    """Install a third-party proposer the way pip would: a dist-info with an entry point."""
    root = tmp_path_factory.mktemp("site")
    (root / "toy_specserve_plugin.py").write_text(TOY_PLUGIN)
    dist = root / "toy_specserve_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-specserve-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[specserve.proposers]\ntoy = toy_specserve_plugin:RepeatLastProposer\n"
    )
    sys.path.insert(0, str(root))
    yield "toy"
    sys.path.remove(str(root))


@pytest.fixture(scope="session")
def medusa_heads_dir(tmp_path_factory) -> Path:
    """Random Medusa-1 heads (3 heads, 1 ResBlock each) for the tiny target (hidden 64, vocab 320)."""
    path = tmp_path_factory.mktemp("medusa")
    g = torch.Generator().manual_seed(5)
    state = {}
    for i in range(3):
        state[f"{i}.0.linear.weight"] = torch.randn(64, 64, generator=g) * 0.05
        state[f"{i}.0.linear.bias"] = torch.zeros(64)
        state[f"{i}.1.weight"] = torch.randn(320, 64, generator=g) * 0.2
    save_file(state, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(
        json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1, "hidden_size": 64})
    )
    return path
