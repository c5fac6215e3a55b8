"""oneDNN's primitive cache against a working set of bf16 attention-like matmul shapes: three passes over
4 x 5 x N shapes (two matmuls each), printing each pass's page faults, time, system time and how much
the process's resident memory grew. Run with ONEDNN_PRIMITIVE_CACHE_CAPACITY set to 0, 1024 (the
default) or more: the first pass's growth prices a cached primitive, the later passes' time shows a
working set over the capacity being made again.

    python cache_probe.py 30     # 600 shapes, 1200 primitives
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=4096 python cache_probe.py 100
"""

import resource
import sys
import time

import torch

torch.set_num_threads(2)
lengths = range(100, 100 + int(sys.argv[1]))
shapes = [(n, q, c) for n in (1, 2, 4, 8) for q in (1, 2, 3, 4, 6) for c in lengths]


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def one_pass() -> tuple[int, float, float, float]:
    before, start, resident = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), resident_mib()
    for n, q, c in shapes:
        rows = torch.randn(n, 3, 3 * q, 64, dtype=torch.bfloat16)
        keys = torch.randn(n, 3, c, 64, dtype=torch.bfloat16)
        torch.matmul(torch.matmul(rows, keys.transpose(-1, -2)), keys)
    after = resource.getrusage(resource.RUSAGE_SELF)
    seconds = time.perf_counter() - start
    return (
        after.ru_minflt - before.ru_minflt,
        seconds,
        after.ru_stime - before.ru_stime,
        resident_mib() - resident,
    )


print(len(shapes), "shapes")
for number in range(3):
    faults, seconds, system, grew = one_pass()
    print(f"pass {number} faults {faults} time {seconds:.3f} s stime {system:.3f} resident +{grew:.1f} MiB")
