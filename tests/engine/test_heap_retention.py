"""A worker thread whose malloc heap is full keeps the heap malloc makes for a large block once the
command-line boundary has fixed glibc's heap settings (engine/heap_retention.py). Each case runs in a
fresh interpreter: malloc's state is per process, and this one's has been shaped by every test before."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# A worker thread (the engine's, in a server) fills its arena's first 64 MiB heap with 100 KiB blocks,
# frees the last three (a free tail of ~300 KiB), then takes, writes and frees a 1 MiB block four times
# (a forward's activations, step after step). Prints, per round, whether the block came from the main
# arena's brk heap (malloc made a heap for it, dropped it at once and fell back) and the page faults the
# round took. `setup` runs first.
_ROUNDS = """
import ctypes, json, threading
{setup}
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
HEAP = 64 << 20

def main_heap():
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                low, high = line.split()[0].split("-")
                return int(low, 16), int(high, 16)
    return 0, 0

def faults():
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt

def work(rounds):
    held = [libc.malloc(100 << 10)]
    while True:
        block = libc.malloc(100 << 10)
        if block // HEAP != held[0] // HEAP:  # the first heap is full
            libc.free(block)
            break
        held.append(block)
    for block in held[-3:]:
        libc.free(block)
    for _ in range(4):
        before = faults()
        block = libc.malloc(1 << 20)
        ctypes.memset(block, 1, 1 << 20)
        low, high = main_heap()
        rounds.append({{"main_arena": low <= block < high, "faults": faults() - before}})
        libc.free(block)

rounds = []
worker = threading.Thread(target=work, args=(rounds,))
worker.start()
worker.join()
print(json.dumps(rounds))
"""

_RETAINED = "from specserve.engine.heap_retention import retain_heaps\nassert retain_heaps()"

_VIA_THE_SERVE_COMMAND = """
from specserve.api.cli import ServeSettings, build_parser
from specserve.api.settings import engine_config_from, parse_settings
engine_config_from(parse_settings(ServeSettings, build_parser().parse_args(["serve"])))
"""


def _rounds(setup: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS.format(setup=setup)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_without_it_a_full_heap_sends_large_blocks_to_the_main_arena():
    """The control: after the first round (mapped on its own, below the adaptive threshold after),
    every 1 MiB block comes from the main arena, so the cases below can fail."""
    rounds = _rounds("")
    assert [r["main_arena"] for r in rounds[1:]] == [True, True, True]


def test_retained_heaps_serve_the_block_from_the_thread_arena_without_faults():
    rounds = _rounds(_RETAINED)
    assert not any(r["main_arena"] for r in rounds)
    assert rounds[0]["faults"] >= 200  # the new heap's pages, written once
    assert all(r["faults"] < 20 for r in rounds[1:])  # and kept


def test_the_serve_command_retains_heaps_before_the_engine_loads():
    rounds = _rounds(_VIA_THE_SERVE_COMMAND)
    assert not any(r["main_arena"] for r in rounds)
    assert all(r["faults"] < 20 for r in rounds[1:])
