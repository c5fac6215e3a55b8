#!/bin/bash
# One probed server process (ARM=default or retained, serve_arm.py) and the 8-client bench against it.
#   ./ab_arms.sh OUT_DIR PORT ARM [REPEATS]
D=$(realpath -m $1); PORT=$2; ARM=$3; REPEATS=${4:-6}; mkdir -p $D
cd "$(dirname "$0")/../../.."
ARM=$ARM PROBE=$D/probe.jsonl python docs/bench/issue20-malloc-heaps-s32/serve_arm.py serve --port $PORT --max-kv-cache-tokens 131072 --num-threads 2 --log-stats-interval 0 --step-log $D/steps.jsonl 2>$D/server.err &
SP=$!
sleep 25; for t in $(seq 60); do curl -s 127.0.0.1:$PORT/health >/dev/null && break; sleep 3; done
timeout 1800 specserve bench serve --concurrency 8 --max-tokens 32 --categories all --modes off,adaptive --repeats $REPEATS --requests-per-client 6 --max-total-requests 4000 --output-dir $D --no-progress --base-url http://127.0.0.1:$PORT > $D/bench.out 2>&1
grep -E 'VmRSS|VmHWM' /proc/$SP/status > $D/rss.txt
kill $SP; wait
