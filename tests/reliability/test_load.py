"""64 concurrent streaming clients in rounds: nothing dropped, no 5xx, everything released.

Three rounds of mixed load (chat and text, lengths, greedy and sampled, speculation on and off per
request) on one server whose waiting queue is short enough that some requests are refused (503) at
admission. Every request must complete with its full usage or be refused; after each round the server
is idle (no running or waiting requests, every KV block free) and its RSS is back near the level it
had after a warm-up round, with no growth from round to round.
"""

from __future__ import annotations

from rel_helpers import assert_clean_log, wait_idle
from server_harness import start_server

from specserve.benchmarks.soak import rss_bytes, run_load, summarize

CLIENTS = 64
# A leak grows RSS with the requests served, not with the seconds, so what the leak bound below sees is
# how many requests lie between the two RSS readings it compares. Each round also drains for ~8 s after
# its deadline (p99 latency: 24 waiting behind 32 running), so short rounds cost drain time, not load.
# Rounds of 21 s (90 s for the test) compared the last round with the higher of the first two: growth
# over at least one round, ~250 completed requests. Rounds of 6 s (55 s) compare the last round with the
# first: growth over rounds 1 and 2, 235-267 completed (and ~670 refused) requests in three runs here,
# so the same leak per request meets the same 8 MiB bound (and rss[2] - rss[0] >= rss[2] - max(rss[:2]):
# the new comparison is never the laxer one).
ROUND_S = 6.0
MiB = 2**20
# glibc's allocator keeps freed memory in per-thread arenas and grows its mmap threshold with every large
# free, so the RSS left after a round moves by ~20 MiB either way with no leak at all (CI runs saw
# 388/411/413, 432/409/431 and 412/411/435 MiB). Two arenas and a fixed 64 KiB mmap threshold (tensors
# above it are mapped and unmapped, not cached) make what stays resident what is actually still held.
STEADY_MALLOC = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}


async def test_load_rounds_no_loss_no_leak(tiny_llama_dir, server_logs):
    srv = start_server(
        tiny_llama_dir,
        server_logs,
        "--served-model-name",
        "tiny",
        "--max-waiting-requests",
        "24",  # 64 clients > 32 running + 24 waiting: some are refused at admission
        env=STEADY_MALLOC,
    )
    pid = srv.process.pid
    try:
        warm = summarize(await run_load(srv.base_url, concurrency=CLIENTS, duration_s=6, seed=99))
        assert warm["failed"] == 0, warm["errors"]
        await wait_idle(srv.base_url)
        baseline = rss_bytes(pid)
        rss, summaries = [], []
        for round_no in range(3):
            result = await run_load(
                srv.base_url, concurrency=CLIENTS, duration_s=ROUND_S, seed=round_no, request_timeout_s=60
            )
            s = summarize(result)
            summaries.append(s)
            print(
                f"round {round_no}: {s['requests']} requests, ok {s['ok']}, refused {s['refused']},"
                f" failed {s['failed']}, p99 {s['latency_s']['p99']:.2f} s, statuses {s['statuses']}"
            )
            assert s["failed"] == 0, s["errors"]
            assert not any(code.startswith("5") and code != "503" for code in s["statuses"]), s["statuses"]
            assert set(s["statuses"]) <= {"200", "429", "503"}, s["statuses"]
            assert s["ok_speculative_on"] > 0 and s["ok_speculative_off"] > 0
            await wait_idle(srv.base_url)
            rss.append(rss_bytes(pid))
        print(f"RSS MiB: baseline {baseline / MiB:.0f}, rounds {[round(r / MiB) for r in rss]}")
        assert sum(s["refused"] for s in summaries) > 0, "the admission limit was never reached"
        # Back near the pre-load level, and no upward trend across the rounds: a leak shows as the last
        # round above the first (two rounds of requests later), not as the middle round above the first.
        # With STEADY_MALLOC three runs here stayed within 2 MiB of the baseline (384/385/385 MiB), so
        # a leak of ~30 KiB per completed request (~250 in rounds 1 and 2) already fails the second bound.
        assert max(rss) <= baseline * 1.05 + 24 * MiB, (baseline, rss)
        assert rss[2] - rss[0] <= 8 * MiB, rss
        assert srv.process.poll() is None
    finally:
        assert srv.stop() == 0
    assert_clean_log(srv.log())
