"""Benchmark: deliver throughput (one deliver pass that takes everything).

1 KiB incompressible bodies, 4 queues, a trivial listener (import path, run in listener
worker processes), ``consume_message_batch_max_size`` 1 and 32, at 100k and 1M messages,
all acknowledged and with one listener call in ten failing (10 % of the messages with
batch 1, ~10 % with batch 32). Sending and dispatch are not timed. Writes
bench/results/deliver-<timestamp>.json. A benchmark, not a test.

    python bench/bench_deliver.py [--sizes 100000 1000000] [--batches 1 32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from deltamq import Broker, FakeClock
from deltamq.jobs import deliver, dispatch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from bench_send_dispatch import body_expr  # noqa: E402


def one(root: Path, n: int, batch: int, listener: str, sql92: str | None = None) -> dict:
    wh = root / f"wh-{n}-{batch}-{listener}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    b = Broker.init(wh, clock=clock)
    b.create_topic("bench", queues=4)
    b.create_group(
        "g",
        f"bench_listeners:{listener}",
        consume_from="FIRST_OFFSET",
        pull_batch_size=n,
        consume_message_batch_max_size=batch,
    )
    if sql92:
        b.subscribe("g", "bench", sql92, type="SQL92")
    else:
        b.subscribe("g", "bench")
    spark = b.engine.spark
    b.producer("p").send_dataframe(
        spark.range(n).selectExpr(
            "'bench' AS topic", f"{body_expr()} AS body", "map('n', CAST(id % 10 AS STRING)) AS properties"
        )
    )
    dispatch.run(b.context, clock.now_ms())
    t0 = time.perf_counter()
    r = deliver.run(b.context, clock.now_ms())
    secs = time.perf_counter() - t0
    assert r.taken == n, r
    shutil.rmtree(wh, ignore_errors=True)
    return {
        "messages": n,
        "batch": batch,
        "listener": listener,
        "seconds": round(secs, 3),
        "msgs_per_s": round(n / secs),
        "consumed": r.consumed,
        "retried": r.retried,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dir", default="/tmp/deltamq-bench-deliver")
    ap.add_argument("--sql92", help="only run this SQL92 filter (e.g. \"n = '7'\" matches 10 %%)")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    if args.sql92:
        for n in args.sizes:
            for batch in args.batches:
                r = one(root, n, batch, "ok", args.sql92)
                print(json.dumps(r), flush=True)
                results.append(r)
        args.sizes = []
    for n in args.sizes:
        for batch in args.batches:
            for listener in ("ok", "fail_ten_percent"):
                r = one(root, n, batch, listener)
                print(json.dumps(r), flush=True)
                results.append(r)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    (HERE / "results" / f"deliver-{stamp}.json").write_text(
        json.dumps({"benchmark": "deliver", "when": stamp, "results": results}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
