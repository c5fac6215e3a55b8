#!/bin/bash
# A probed server and the 8-client bench; when 30 of the last 40 plain forwards took over 100 faults, 6 s of strace -k.
D=$(realpath -m $1); PORT=$2; mkdir -p $D
cd "$(dirname "$0")/../../.."
PROBE=$D/probe.jsonl python docs/bench/issue20-heap-retention-s31/serve_probe.py serve --port $PORT --max-kv-cache-tokens 131072 --num-threads 2 --log-stats-interval 0 --step-log $D/steps.jsonl 2>$D/server.err &
SP=$!
sleep 30; until curl -s 127.0.0.1:$PORT/health >/dev/null; do sleep 3; done
PID=$(pgrep -f "serve_probe.py serve --port $PORT" | head -1)
timeout 1200 specserve bench serve --concurrency 8 --max-tokens 32 --categories all --modes off,adaptive --repeats 6 --requests-per-client 6 --max-total-requests 4000 --output-dir $D --no-progress --base-url http://127.0.0.1:$PORT > $D/bench.out 2>&1 &
BP=$!
while kill -0 $BP 2>/dev/null; do
  sleep 2
  n=$(tail -40 $D/probe.jsonl | python -c "import sys,json; r=[json.loads(l) for l in sys.stdin]; print(sum(1 for x in r if x['thread_minflt']>100))")
  if [ "$n" -ge 30 ] && [ ! -f $D/strace.txt ]; then
    echo "spell at $(date)"; timeout 6 strace -f -tt -k -e trace=mmap,munmap,madvise,mprotect,brk -p $PID -o $D/strace.txt; echo traced
  fi
done
kill $SP; wait
