"""In-process: is a plain 16-sequence forward slower right after a forward with verification windows?

python docs/bench/issue20-window-cost-s29/after_a_window.py [ROUNDS]
"""

import random
import statistics as st
import sys
import time

from decoding_step import decoding_step, with_windows

eng, scheduled, rids = decoding_step()
plain = with_windows(eng, scheduled, {})
# Draft lengths for the first requests (zip stops at the shorter list).
shapes = ([1, 2, 4], [8], [1, 2, 3, 5, 7, 8], [3] * 16, [1] * 5)
windows = [with_windows(eng, scheduled, dict(zip(rids, ks, strict=False))) for ks in shapes]
after_plain: list[float] = []
after_window: list[float] = []
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 150):
    eng._forward(plain if i % 2 else random.choice(windows))
    start = time.perf_counter()
    eng._forward(plain)
    (after_plain if i % 2 else after_window).append(time.perf_counter() - start)
print(
    f"plain forward after a plain one: median {1e3 * st.median(after_plain):.1f} ms;"
    f" after one with windows: {1e3 * st.median(after_window):.1f} ms (n={len(after_plain)}, {len(after_window)})"
)
