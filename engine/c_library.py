"""Our C kernels (engine/*.c): compiled with the machine's C compiler at first use, cached by source,
flags, compiler and CPU, loaded with ctypes.

Why gcc at run time rather than a compiled wheel: `pip install -e .` stays pure Python (no build
isolation pulling a second torch), and -march=native gets the machine's vector instructions. The
callers (engine/paged_decode_kernel.py, engine/int4_kernel.py) turn a `KernelBuildError` into one
warning and keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11", "-Wall")
# Linked separately, without -ffast-math or -march: gcc 12 links crtfastmath.o into a shared library
# built with -ffast-math, which sets flush-to-zero for the whole process (torch's maths included).
LINK_FLAGS = ("-shared", "-fopenmp")
_BUILD_SECONDS = 120

Kernel = TypeVar("Kernel")


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled or loaded (no compiler, a compile error, an unloadable file)."""


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted))


def build_library(
    source: Path, cache_dir: Path, compiler: str = "gcc", defines: tuple[str, ...] = ()
) -> tuple[Path, ctypes.CDLL]:
    """Compile (or reuse) `source` as `cache_dir`/kernels/<stem>-<key>.so and load it. `defines` are
    extra -D macros (SPECSERVE_GENERIC builds the plain loops only). Raises KernelBuildError."""
    found = shutil.which(compiler)
    if found is None:
        raise KernelBuildError(f"no C compiler {compiler!r} on PATH")
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{compiler} --version failed: {e}") from e
    flags = (*COMPILE_FLAGS, *(f"-D{d}" for d in defines))
    key = hashlib.sha256(
        b"\0".join(
            [source.read_bytes(), " ".join(flags).encode(), version.encode(), _cpu_identity().encode()]
        )
    )
    target = cache_dir / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        _compile(found, flags, source, target)
    try:
        return target, ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelBuildError(f"could not load {target}: {e}") from e


def _compile(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    """Compile and link into a temporary file beside `target`, then rename: concurrent builders (two
    test processes) each finish a whole file, and the last rename wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        for command in (
            [compiler, *flags, "-c", str(source), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"],
        ):
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_SECONDS)
            except (OSError, subprocess.SubprocessError) as e:
                raise KernelBuildError(f"{' '.join(command)}: {e}") from e
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
                raise KernelBuildError(f"{' '.join(command)} failed: {first}")
        os.replace(lib, target)


def int_function(library: ctypes.CDLL, name: str, *argtypes: type) -> Callable[..., int]:
    """`library`'s C function `name`, which returns an int, with its argument types set (ctypes then
    converts every call's arguments and refuses a wrong count)."""
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = list(argtypes)
    return function


def build_for_process(
    switch: str, build: Callable[[Path, str], Kernel], unavailable: Callable[[KernelBuildError], object]
) -> Kernel | None:
    """A kernel for this process: `build(cache_dir, compiler)` under the model cache ($SPECSERVE_CACHE_DIR
    or ~/.cache/specserve) with $CC or gcc. None when the environment sets `switch` to 0 (A/B runs), or,
    after `unavailable(error)` (the caller's one log line), where it cannot be built."""
    if os.environ.get(switch, "1") == "0":
        return None
    from .models.loader import default_cache_dir  # here: models import the kernels' modules

    try:
        return build(default_cache_dir(), os.environ.get("CC") or "gcc")
    except KernelBuildError as e:
        unavailable(e)
        return None
