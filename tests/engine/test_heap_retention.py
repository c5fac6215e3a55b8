"""Freed activation memory stays mapped for the next forward once the command-line boundary has fixed
glibc's heap thresholds (engine/heap_retention.py). Each case runs in a fresh interpreter: malloc's
adaptive state is per process and this one's has been shaped by every test before it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# Allocate, write and free 8 MiB three times (a forward's activations, step after step) and print the
# page faults each round took. `setup` runs first.
_ROUNDS = """
import ctypes
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def faults():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt

size = 8 << 20
for _ in range(3):
    before = faults()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    print(faults() - before)
"""

_VIA_THE_SERVE_COMMAND = """
from specserve.api.cli import ServeSettings, build_parser
from specserve.api.settings import engine_config_from, parse_settings
engine_config_from(parse_settings(ServeSettings, build_parser().parse_args(["serve"])))
"""


def _faults_per_round(setup: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS.format(setup=setup)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [int(line) for line in done.stdout.split()]


def test_without_it_glibc_hands_a_freed_block_back_and_faults_it_in_again():
    """The control: the second round's 8 MiB come back from the kernel (2048 pages), so the two cases
    below can fail."""
    first, second, _ = _faults_per_round("")
    assert first > 1500 and second > 1500


def test_retained_heap_reuses_a_freed_block_without_faults():
    setup = "from specserve.engine.heap_retention import retain_freed_heap\nassert retain_freed_heap()"
    first, second, third = _faults_per_round(setup)
    assert first > 1500  # the first round maps it
    assert second < 100 and third < 100


def test_the_serve_command_retains_the_heap_before_the_engine_loads():
    first, second, third = _faults_per_round(_VIA_THE_SERVE_COMMAND)
    assert second < 100 and third < 100
