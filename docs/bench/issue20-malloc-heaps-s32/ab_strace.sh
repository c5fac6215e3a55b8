#!/bin/bash
# As ab_env.sh, with the server under strace counting munmaps (64 MiB ones are dropped malloc heaps).
D=$(realpath -m $1); PORT=$2; ENVS=$3; mkdir -p $D
cd "$(dirname "$0")/../../.."
env $ENVS PROBE=$D/probe.jsonl strace -f --seccomp-bpf -tt -e trace=munmap -o $D/munmap.txt python docs/bench/issue20-heap-retention-s31/serve_probe.py serve --port $PORT --max-kv-cache-tokens 131072 --num-threads 2 --log-stats-interval 0 --step-log $D/steps.jsonl 2>$D/server.err &
SP=$!
sleep 25; for t in $(seq 60); do curl -s 127.0.0.1:$PORT/health >/dev/null && break; sleep 3; done
PID=$(pgrep -f "serve_probe.py serve --port $PORT" | grep -v $SP | tail -1)
timeout 1200 specserve bench serve --concurrency 8 --max-tokens 32 --categories all --modes off,adaptive --repeats 6 --requests-per-client 6 --max-total-requests 4000 --output-dir $D --no-progress --base-url http://127.0.0.1:$PORT > $D/bench.out 2>&1
grep -E 'VmRSS|VmHWM' /proc/$PID/status > $D/rss.txt
kill $PID; sleep 3; kill $SP 2>/dev/null; sleep 1
