"""Keep freed heap memory in the process instead of handing it back to the kernel after every forward.

glibc's malloc adapts two thresholds as a program runs: blocks above the mmap threshold get their own
mapping, and free memory at the top of a heap beyond twice that threshold is returned to the kernel.
A CPU forward allocates and frees the same activation tensors layer after layer; once a served engine's
mix of prefill and decode shapes has set the thresholds low, every plain 8-sequence SmolLM2 decode
forward gave ~600 KB back and took it again: 152 page faults and ~4.5 ms of system time a forward, which
then ran at 31 ms instead of 26 (docs/bench/issue20-heap-retention-s31). Fixing both thresholds high
stops the churn: freed activations stay mapped for the next forward (the process keeps its peak
activation memory, which the KV cache budget already sets aside).

Process-wide by nature, like torch's thread count: the command-line boundary calls `retain_freed_heap`
once, before the engine loads. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger("specserve.engine")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks above this still get their own mapping (a long prompt's prefill logits, hundreds of MB): they
# are rare, and a heap keeping them would hold that much after one long prompt. 32 MiB is glibc's own
# ceiling for the adaptive threshold on 64-bit systems.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the top of a heap is returned beyond this; above a forward's activations at any batch
# this engine runs on CPU.
TRIM_THRESHOLD_BYTES = 512 << 20


def retain_freed_heap() -> bool:
    """Fix glibc's mmap and trim thresholds (True), or do nothing where malloc is not glibc's (False)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    applied = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    applied = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and applied
    if not applied:
        logger.warning("mallopt refused the heap thresholds; freed activations go back to the kernel")
    return applied
