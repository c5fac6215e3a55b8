"""A worker thread whose first malloc heap is full (a ~300 KiB free tail) takes and frees a 1 MiB block
four times: prints, per round, whether the block came from the main arena's brk heap and the faults.

    python heap_fallback.py default   # [(False, 260), (True, 256), (True, 2), (True, 1)]
    python heap_fallback.py retain    # [(False, 257), (False, 0), (False, 1), (False, 0)]

Under `strace -f -e trace=mmap,munmap,mprotect` each default round after the first maps 128 MiB, trims
it to a 64 MiB heap, makes 1.2 MB of it writable and unmaps the heap again before the block is served.
(tests/engine/test_heap_retention.py is this, asserted.)"""

import ctypes
import sys
import threading

if sys.argv[1] == "retain":
    from specserve.engine.heap_retention import retain_heaps

    assert retain_heaps()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
HEAP = 64 << 20


def main_heap():
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = line.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
    return 0, 0


def faults():
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def work(out):
    held = [libc.malloc(100 << 10)]
    while True:
        block = libc.malloc(100 << 10)
        if block // HEAP != held[0] // HEAP:
            libc.free(block)
            break
        held.append(block)
    for block in held[-3:]:
        libc.free(block)
    for _ in range(4):
        before = faults()
        block = libc.malloc(1 << 20)
        ctypes.memset(block, 1, 1 << 20)
        lo, hi = main_heap()
        out.append((lo <= block < hi, faults() - before))
        libc.free(block)


out = []
t = threading.Thread(target=work, args=(out,))
t.start()
t.join()
print(out)
