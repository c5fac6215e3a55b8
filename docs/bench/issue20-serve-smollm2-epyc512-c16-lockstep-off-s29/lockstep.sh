#!/bin/bash
# Speculation off in both arms: one output length (lockstep) against lengths mixed over 16-48, alternated, one server.
D=${OUT:-/tmp/lockstep}
mkdir -p $D
specserve serve --host 127.0.0.1 --port 8013 --num-threads 2 --max-kv-cache-tokens 131072 --log-stats-interval 0 --step-log $D/steps.jsonl > $D/server.log 2>&1 &
SERVER=$!
for i in $(seq 1 120); do curl -s http://127.0.0.1:8013/v1/models >/dev/null && break; sleep 1; done
run() { # $1 name $2 ratio $3 repeat
  specserve bench serve --base-url http://127.0.0.1:8013 --concurrency 16 --max-tokens 32 --categories all --modes off --repeats 1 --warmup $4 --requests-per-client 6 --max-tokens-range-ratio $2 --output-dir $D/$1-r$3 --no-progress --no-plots > $D/$1-r$3.log 2>&1
}
run one 0 warm 16
for r in $(seq 0 11); do
  if [ $((r % 2)) -eq 0 ]; then run one 0 $r 0; run mixed 0.5 $r 0; else run mixed 0.5 $r 0; run one 0 $r 0; fi
done
kill $SERVER
echo done
