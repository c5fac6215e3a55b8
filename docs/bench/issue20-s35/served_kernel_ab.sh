#!/usr/bin/env bash
# Served SmolLM2 throughput with the paged-decode kernel and without (SPECSERVE_PAGED_DECODE=0, torch
# matmuls), speculation off: one fresh server per run, runs alternated kernel / matmul / matmul / kernel
# so the machine's drift falls on both arms.
#   bash docs/bench/issue20-s35/served_kernel_ab.sh OUT_DIR [CONCURRENCY] [REPEATS]
set -euo pipefail
out=${1:?output dir}; levels=${2:-1,8,32}; repeats=${3:-3}
mkdir -p "$out"
for run in kernel-1 matmul-1 matmul-2 kernel-2; do
  arm=${run%-*}
  flag=1; [ "$arm" = matmul ] && flag=0
  SPECSERVE_PAGED_DECODE=$flag specserve bench serve --concurrency "$levels" --max-tokens 32 --categories all \
    --modes off --repeats "$repeats" --requests-per-client 6 --max-total-requests 5000 \
    --output-dir "$out/$run" --no-progress --no-plots --launch -- --max-kv-cache-tokens 131072 --num-threads 2 \
    --log-stats-interval 0 > "$out/$run.log" 2>&1
  echo "$run done"
done
python - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def tput(run):
    cells = json.load(open(f"{out}/{run}/serve.json"))["cells"]
    by = {}
    for c in cells:
        by.setdefault(c["concurrency"], []).append(c["output_tokens_per_s"])
    return by
k1, m1, m2, k2 = (tput(r) for r in ("kernel-1", "matmul-1", "matmul-2", "kernel-2"))
print("| concurrency | kernel tok/s (runs 1, 4) | matmul tok/s (runs 2, 3) | kernel / matmul (runs 1/2, 4/3) |")
print("|---|---|---|---|")
for c in sorted(k1):
    a, b, x, y = (statistics.median(t[c]) for t in (k1, k2, m1, m2))
    print(f"| {c} | {a:.1f}, {b:.1f} | {x:.1f}, {y:.1f} | {a / x:.3f}, {b / y:.3f} |")
PY
