"""Join a run's stamped oneDNN cache misses (stamp.py) to its probed forwards (serve_probe.py) in 10 s
windows: forwards, misses, engine-thread faults, forwards with over 100 faults, forwards with a miss,
forwards with over 100 faults and no miss, mean system ms a forward.

    python join.py RUN_DIR
"""

import bisect
import collections
import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
miss_times = [float(line.split(",", 1)[0]) for line in (run / "miss.txt").read_text().splitlines()]
forwards = [json.loads(line) for line in (run / "probe.jsonl").read_text().splitlines()]
windows = collections.defaultdict(list)
start = forwards[0]["time"]
for record in forwards:
    begin, end = record["time"] - record["forward"], record["time"]
    misses = bisect.bisect_right(miss_times, end) - bisect.bisect_left(miss_times, begin)
    windows[int((end - start) // 10)].append((misses, record["thread_minflt"], record["system"]))
print("window forwards misses faults faulty with_miss faulty_without_miss system_ms")
for window, rows in sorted(windows.items()):
    print(
        window * 10,
        len(rows),
        sum(m for m, _, _ in rows),
        sum(f for _, f, _ in rows),
        sum(1 for _, f, _ in rows if f > 100),
        sum(1 for m, _, _ in rows if m > 0),
        sum(1 for m, f, _ in rows if f > 100 and m == 0),
        round(1000 * sum(s for _, _, s in rows) / len(rows), 2),
    )
print("total misses", len(miss_times))
