"""oneDNN's primitive cache against a working set of bf16 attention-like matmul shapes: three passes over
4 x 5 x N shapes (two matmuls each), printing each pass's page faults, time and system time. Run with
and without ONEDNN_PRIMITIVE_CACHE_CAPACITY=65536 (the default holds 1024 primitives).

    python cache_probe.py 30     # 600 shapes, 1200 primitives
"""

import resource
import sys
import time

import torch

torch.set_num_threads(2)
lengths = range(100, 100 + int(sys.argv[1]))
shapes = [(n, q, c) for n in (1, 2, 4, 8) for q in (1, 2, 3, 4, 6) for c in lengths]


def one_pass() -> tuple[int, float, float]:
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for n, q, c in shapes:
        rows = torch.randn(n, 3, 3 * q, 64, dtype=torch.bfloat16)
        keys = torch.randn(n, 3, c, 64, dtype=torch.bfloat16)
        torch.matmul(torch.matmul(rows, keys.transpose(-1, -2)), keys)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return after.ru_minflt - before.ru_minflt, time.perf_counter() - start, after.ru_stime - before.ru_stime


print(len(shapes), "shapes")
for number in range(3):
    faults, seconds, system = one_pass()
    print(f"pass {number} faults {faults} time {seconds:.3f} s stime {system:.3f}")
