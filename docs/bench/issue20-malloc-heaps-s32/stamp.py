"""Filter a server's ONEDNN_VERBOSE=profile_create output to its cache misses, each prefixed with the
time it was read: `... 2>err | python stamp.py miss.txt`."""

import sys
import time

with open(sys.argv[1], "w", buffering=1) as out:
    for line in sys.stdin:
        if "cache_miss" in line:
            out.write(f"{time.time():.4f},{line}")
