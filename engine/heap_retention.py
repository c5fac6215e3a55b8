"""Keep the engine thread's malloc heaps instead of making and dropping one for a forward's activations.

The engine steps on its own thread, so glibc's malloc serves its tensors from a per-thread arena: a
chain of 64 MiB heaps. When the newest heap is full and a forward asks for a block larger than the free
tail left in it, malloc maps a new heap, makes it the arena's top and frees the old heap's tail; that
free's trim check (`heap_trim`) finds the new heap empty and the old tail worth keeping, so it unmaps
the new heap at once, and the block falls back to the main arena (shared with the server's other
threads). While the engine's heap sits in that state, every such block costs a 128 MiB mapping made,
trimmed and unmapped: served SmolLM2 8-client runs unmapped ~1000-2400 heaps each. In about half of
those server processes, plain 8-sequence forwards also fell into spells of ~150 engine-thread page
faults and 4-6 ms of system time each (31-36 ms instead of 26-29), lasting minutes and beginning and
ending mid-run; an strace inside one showed these heap cycles under torch's allocations. With the
settings below, 5-16 heaps were unmapped a run (five processes counted) and none of nine processes
had a spell (docs/bench/issue20-malloc-heaps-s32).

`heap_trim` keeps an empty heap while the previous heap's reclaimable tail is below the top pad, so a
top pad as large as the largest block served from a heap (the mmap threshold: larger blocks get their
own mapping) keeps every heap malloc makes. Setting any of the three disables glibc's adaptive
thresholds (the mmap threshold would otherwise rise from 128 KiB as large blocks are freed, and the
trim threshold with it), so all three are fixed: the mmap threshold at glibc's own ceiling for the
adaptive one, the trim threshold at twice it, as the adaptive rule keeps it. The price: a heap once made
is kept, with up to one top pad (32 MiB) of free memory at each arena's top (served resident memory
was lower with the settings than without: 1.37-1.63 against 1.62-1.75 GiB at the end of a run).

Process-wide by nature, like torch's thread count: the command-line boundary calls `retain_heaps` once,
before the engine loads. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger("specserve.engine")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# Blocks above this get their own mapping (a long prompt's prefill logits, hundreds of MB): they are
# rare, and a heap keeping them would hold that much after one long prompt. 32 MiB is glibc's ceiling
# for the adaptive threshold on 64-bit systems (half a heap).
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory kept at the top of a heap, and the reclaimable tail below which an emptied heap is kept:
# at least the largest block a heap serves, so no allocation can make a heap that its own free drops.
TOP_PAD_BYTES = MMAP_THRESHOLD_BYTES
# Free memory at the top of a heap beyond this is returned to the kernel (glibc's adaptive rule keeps
# it at twice the mmap threshold).
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES


def retain_heaps() -> bool:
    """Fix glibc's mmap threshold, top pad and trim threshold (True), or do nothing where malloc is not
    glibc's (False)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
    )
    # A list, not a generator: every setting is applied even after one is refused.
    applied = all([libc.mallopt(parameter, value) == 1 for parameter, value in settings])
    if not applied:
        logger.warning("mallopt refused the heap settings; forwards may map and unmap malloc heaps")
    return applied
