"""The glibc behaviour behind the spells on its own, printed rather than asserted: runs the reproduction of
tests/engine/test_heap_retention.py (a worker thread whose first malloc heap is full, with a ~300 KiB free
tail, takes and frees a 1 MiB block four times) in a fresh interpreter and prints, per round, whether the
block came from the main arena's brk heap and the page faults the round took.

    python docs/bench/issue20-malloc-heaps-s32/heap_fallback.py default   # rounds 2-4 in the main arena
    python docs/bench/issue20-malloc-heaps-s32/heap_fallback.py retain    # all in the thread's arena

Under `strace -f -e trace=mmap,munmap,mprotect` each default round after the first maps 128 MiB, trims it
to a 64 MiB heap, makes 1.2 MB of it writable and unmaps the heap again before the block is served.
"""

import importlib.util
import sys
from pathlib import Path

test_file = Path(__file__).resolve().parents[3] / "tests" / "engine" / "test_heap_retention.py"
spec = importlib.util.spec_from_file_location("test_heap_retention", test_file)
reproduction = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduction)
for number, round_ in enumerate(
    reproduction._rounds(reproduction._RETAINED if sys.argv[1] == "retain" else "")
):
    print(f"round {number}: main arena {round_['main_arena']}, faults {round_['faults']}")
