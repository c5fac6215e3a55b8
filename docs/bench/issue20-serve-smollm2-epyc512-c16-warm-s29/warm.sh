#!/bin/bash
# 16 SmolLM2 clients, one output length: two untimed repeats at 16 first (the controller's state at 16
# sequences learned), then eight measured repeats against the same server.
D=${OUT:-/tmp/warm}
mkdir -p $D
specserve serve --host 127.0.0.1 --port 8014 --num-threads 2 --max-kv-cache-tokens 131072 --log-stats-interval 0 --step-log $D/steps.jsonl > $D/server.log 2>&1 &
SERVER=$!
for i in $(seq 1 120); do curl -s http://127.0.0.1:8014/v1/models >/dev/null && break; sleep 1; done
COMMON="--base-url http://127.0.0.1:8014 --concurrency 16 --max-tokens 32 --categories all --modes off,adaptive --requests-per-client 6 --max-total-requests 4000 --no-progress"
specserve bench serve $COMMON --repeats 2 --output-dir $D/warm-up > $D/warm-up.log 2>&1
specserve bench serve $COMMON --repeats 8 --warmup 0 --output-dir $D/measured > $D/measured.log 2>&1
kill $SERVER
echo done
