"""Benchmark: pull + ack throughput, one client process and four.

N messages (1 KiB bodies) in a topic of 4 queues, dispatched; then client processes of
one pull group each loop ``pull(batch)`` → ``ack(all)`` until the topic is drained (5
empty pulls in a row). Four clients start together: they rebalance the queues among
themselves through the access lock (a client only gets a queue from its first owner
once that owner's deliveries are acked). Throughput = N / (last ack − first pull).

Writes bench/results/pull-<timestamp>.json. A benchmark, not a test.

    python bench/bench_pull.py [--messages 100000] [--batch 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from deltamq import Broker

HERE = Path(__file__).parent

CLIENT = """
import json, sys, time
from deltamq import Broker
wh, me, batch, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
broker = Broker.open(wh)
consumer = broker.pull_consumer("workers", me)
broker.engine.rows("SELECT 1")
time.sleep(max(0.0, go - time.time()))
first = time.time()
got = empty = pulls = unacked = 0
last = first
while empty < 5:
    msgs = consumer.pull(batch)
    pulls += 1
    if not msgs:
        empty += 1
        continue
    empty = 0
    unacked += len(msgs) - consumer.ack([m.receipt_handle for m in msgs])
    got += len(msgs)
    last = time.time()
report = {"client": me, "messages": got, "pulls": pulls, "unacked": unacked, "first": first, "last": last}
report["stale_dml_repeats"] = broker.engine.stats.stale_dml_repeats
print(json.dumps(report), flush=True)
"""


def run(root: Path, n: int, clients: int, batch: int) -> dict:
    wh = root / f"pull-{n}-{clients}"
    shutil.rmtree(wh, ignore_errors=True)
    b = Broker.open(wh)
    b.create_topic("orders", queues=4)
    b.create_group("workers", consume_from="FIRST_OFFSET")
    b.subscribe("workers", "orders")
    spark = b.engine.spark
    b.producer("p").send_dataframe(
        spark.range(n).selectExpr(
            "'orders' AS topic", "CAST(repeat(sha2(CAST(id AS STRING), 256), 16) AS BINARY) AS body"
        )
    )
    b.tick()
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    env["RUST_LOG"] = "error"
    go = time.time() + 8.0  # every client's engine is up before the start
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(wh), f"client-{i}", str(batch), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(clients)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=3600)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    total = sum(r["messages"] for r in reports)
    start = min(r["first"] for r in reports)
    end = max(r["last"] for r in reports)
    acked = b.sql(
        "SELECT sum(next_offset) AS n FROM offsets WHERE consumer_group = 'workers' AND topic = 'orders'"
    ).collect()[0]["n"]
    shutil.rmtree(wh, ignore_errors=True)
    return {
        "messages": n,
        "clients": clients,
        "batch": batch,
        "handed_out": total,
        "acked_offsets": acked,
        "seconds": round(end - start, 2),
        "msgs_per_s": round(n / (end - start)),
        "per_client": [
            {k: r[k] for k in ("client", "messages", "pulls", "unacked", "stale_dml_repeats")}
            for r in reports
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--root", default="/tmp/deltamq-bench")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    runs = [run(root, args.messages, c, args.batch) for c in args.clients]
    result = {"bench": "pull", "at": datetime.now(UTC).isoformat(), "runs": runs}
    out = HERE / "results" / f"pull-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
