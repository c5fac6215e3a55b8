"""Resident memory after one pass over the shapes of cache_probe.py, to price a cached primitive: run with
ONEDNN_PRIMITIVE_CACHE_CAPACITY=0, 1024 (the default), 4096.

    ONEDNN_PRIMITIVE_CACHE_CAPACITY=4096 python rss_probe.py 100
"""

import sys

import torch

torch.set_num_threads(2)


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


lengths = range(100, 100 + int(sys.argv[1]))
shapes = [(n, q, c) for n in (1, 2, 4, 8) for q in (1, 2, 3, 4, 6) for c in lengths]
start = resident_mib()
for n, q, c in shapes:
    rows = torch.randn(n, 3, 3 * q, 64, dtype=torch.bfloat16)
    keys = torch.randn(n, 3, c, 64, dtype=torch.bfloat16)
    torch.matmul(torch.matmul(rows, keys.transpose(-1, -2)), keys)
print(f"{len(shapes)} shapes; resident grew {resident_mib() - start:.1f} MiB, now {resident_mib():.1f}")
