from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    """Make packages installed into `folder` importable (and their entry points visible) meanwhile."""
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


def _install_single_module_plugin(root: Path, module: str, source: str, entry: str) -> None:
    """Install a one-module proposer the way pip would: the module plus a dist-info with an entry
    point `name = module:Class` in the group `specserve.proposers`."""
    (root / f"{module}.py").write_text(source)
    dist = root / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[specserve.proposers]\n{entry}\n")


@pytest.fixture(scope="session")
def toy_plugin_entry_point(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    _install_single_module_plugin(
        root, "toy_specserve_plugin", TOY_PLUGIN, "toy = toy_specserve_plugin:RepeatLastProposer"
    )
    with _on_sys_path(root):
        yield "toy"


BROKEN_PLUGIN = '''
import torch

from specserve.engine.proposer import Proposals, Proposer


class BrokenProposer(Proposer):
    """A buggy third-party proposer: by the prompt's first token, each request gets one kind of bad
    proposal, or (first token % 6 == 5) a valid one."""

    name = "broken"

    def propose(self, batch):
        vocab = self.ctx.vocab_size
        tokens, probs = [], []
        for b in batch:
            k = b.num_speculative_tokens
            last = b.request.all_token_ids[-1]
            kind = b.request.prompt_token_ids[0] % 6
            if kind == 0:
                tokens.append([vocab + 7, last][:k]), probs.append(None)  # id outside the vocabulary
            elif kind == 1:
                tokens.append([last] * k), probs.append(torch.full((vocab,), 1.0 / vocab))  # 1-D q
            elif kind == 2:
                tokens.append([last] * k), probs.append(torch.full((k, vocab), 0.5))  # rows sum to vocab/2
            elif kind == 3:
                q = torch.full((k, vocab), 1.0 / vocab)
                q[0, 0] = float("nan")
                tokens.append([last] * k), probs.append(q)  # not finite
            elif kind == 4:
                q = torch.full((k, vocab), 2.0 / vocab)
                q[:, : vocab // 2] = 0.0
                q[0, 0], q[0, 1] = -0.5, 0.5
                tokens.append([last] * k), probs.append(q)  # a negative entry
            else:
                tokens.append([last] * k), probs.append(None)  # valid (often rejected, still exact)
        return Proposals(tokens, probs)
'''


@pytest.fixture(scope="session")
def broken_plugin_entry_point(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken-site")
    _install_single_module_plugin(
        root, "broken_specserve_plugin", BROKEN_PLUGIN, "broken = broken_specserve_plugin:BrokenProposer"
    )
    with _on_sys_path(root):
        yield "broken"


EXAMPLE_PLUGIN = Path(__file__).resolve().parents[2] / "examples" / "specserve-bigram-proposer"


@pytest.fixture(scope="session")
def example_plugin_entry_point(tmp_path_factory):
    """pip-install the out-of-tree example plugin (examples/) into a private folder on sys.path; the
    engine finds it through its `specserve.proposers` entry point, as after `pip install` for a user."""
    target = tmp_path_factory.mktemp("example-plugin-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(target), str(EXAMPLE_PLUGIN)],
        check=True,
    )
    with _on_sys_path(target):
        yield "bigram"


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
