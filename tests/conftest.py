from __future__ import annotations

import atexit
import compileall
import gc
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model, perturb_weights  # noqa: E402

# After pytest is done (its own cleanup, which collects garbage to report unraisable exceptions, has
# run): freeze the heap so the interpreter's final collection does not walk everything torch built.
atexit.register(gc.freeze)


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile the package once: the servers and CLIs the tests start import it from this source
    tree, and with PYTHONDONTWRITEBYTECODE set (as here) each would compile every module again (~0.4 s
    a process). Python checks each .pyc against its source's mtime and size, so none goes stale."""
    root = Path(__file__).resolve().parents[1]
    for package in ("specserve_pkg", "engine", "api", "plugins", "benchmarks"):
        compileall.compile_dir(root / package, quiet=1)


@pytest.fixture
def switch_kernel_off(monkeypatch):
    """Call it with a C kernel's switch (SPECSERVE_..._KERNEL) and its cached per-process builder: the
    builder then answers as in a process started with the switch at 0. Both are restored afterwards."""
    cleared = []

    def off(switch: str, default) -> None:
        monkeypatch.setenv(switch, "0")
        default.cache_clear()
        cleared.append(default)

    yield off
    monkeypatch.undo()
    for default in cleared:
        default.cache_clear()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(path, "llama", seed=0)
    return path


def _noisy_copy_of_target(path: Path, noise: float) -> Path:
    model = build_tiny_model(path, "llama", seed=0)
    perturb_weights(model, noise)
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


def _eagle_head(tiny_dir: Path, seed: int):
    """A random EAGLE head for the tiny target whose prediction starts near "the next feature is this
    one" (fc = [small | I]): drafts are often wrong and sometimes right, as rejection tests need."""
    import torch

    from specserve.engine.models.arch import ArchConfig
    from specserve.plugins.eagle_head import EagleHead, head_arch

    arch = ArchConfig.from_directory(tiny_dir)
    torch.manual_seed(seed)
    head = EagleHead(head_arch(arch))
    with torch.no_grad():
        hidden = arch.hidden_size
        head.fc.weight.mul_(0.1)
        head.fc.weight[:, hidden:] += torch.eye(hidden)
    return head


@pytest.fixture(scope="session")
def eagle_head_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """A random EAGLE head over the tiny target's full vocabulary, saved by specserve's writer."""
    from specserve.plugins.eagle_head import save_eagle_head

    path = tmp_path_factory.mktemp("eagle")
    save_eagle_head(path, _eagle_head(tiny_llama_dir, seed=7), None, {})
    return path


@pytest.fixture(scope="session")
def eagle_vocab_head_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """The same kind of head with a truncated draft vocabulary (FR-Spec): 160 of the 320 token ids,
    chosen so that the prompts' frequent ids (11, 12, 13) are in and many others are not."""
    import torch

    from specserve.plugins.eagle_head import save_eagle_head

    path = tmp_path_factory.mktemp("eagle-vocab")
    ids = torch.tensor([i for i in range(320) if i % 2 == 1 or i in (12, 2)][:160])
    save_eagle_head(path, _eagle_head(tiny_llama_dir, seed=8), ids, {})
    return path
