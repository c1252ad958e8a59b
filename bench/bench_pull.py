"""Benchmark: pull + ack throughput, one client process and four.

N messages (1 KiB bodies) in a topic of 4 queues, dispatched; then client processes of
one pull group each loop ``pull(batch)`` → ``ack(all)`` until the topic is drained
(nothing for 3 s). Four clients start together: they rebalance the queues among
themselves through the access lock (a client only gets a queue from its first owner
once that owner's deliveries are acked). Throughput = N / (last ack − first pull). The
clients are ``Broker.pull_consumer``'s (``spark``: each process with its engine) or
``deltamq.lite.PullConsumer``'s (``lite``: no engine).

Checks: every message handed out exactly once (each client reports the queue positions
it was handed; no position twice, every position of the topic once), and, after a tick
folded the deliveries log into ``offsets``, every acked offset at its queue's end and
nothing in flight. ``--vs-pgmq`` runs PGMQ's read + delete (bench_pgmq.py: a PostgreSQL
server started for it) just before each client count's runs, for ratios from one run.

``measure(root, n, batch, clients, kind)`` runs one configuration and returns its figures
(bench/run.py calls it); ``profile(root, n, batch)`` times each Spark
statement of an in-process pull + ack cycle. Writes bench/results/pull-<timestamp>.json.
A benchmark, not a test.

    python bench/bench_pull.py [--messages 100000] [--batch 1000] [--clients 1 4]
        [--kinds spark lite] [--acks flush next-pull] [--senders spark lite] [--profile]
        [--vs-pgmq]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from deltamq import Broker

HERE = Path(__file__).parent

CLIENT = """
import json, sys, time
wh, me, batch, go, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
flush = sys.argv[6] == "flush"
if kind == "lite":
    from deltamq.lite import PullConsumer
    consumer = PullConsumer(wh, "workers", me)
else:
    from deltamq import Broker
    broker = Broker.init(wh)
    consumer = broker.pull_consumer("workers", me)
    broker.engine.rows("SELECT 1")
consumer.heartbeat()  # every client is live before the start: the queues are shared from the first pull
time.sleep(max(0.0, go - time.time()))
first = time.time()
got = empty = pulls = unacked = 0
last = first
handed = {}
idle = None
while idle is None or time.time() - idle < 3.0:  # drained: nothing for 3 s
    msgs = consumer.pull(batch)
    pulls += 1
    if not msgs:
        idle = idle or time.time()
        empty += 1
        time.sleep(0.05)
        continue
    idle = None
    unacked += len(msgs) - consumer.ack([m.receipt_handle for m in msgs], flush=flush)
    got += len(msgs)
    last = time.time()
    for m in msgs:
        handed.setdefault(m.queue_id, []).append(m.queue_offset)
consumer.close()
commits = broker.engine.stats.commits if kind != "lite" else None
retried = broker.engine.stats.conflicts_retried if kind != "lite" else None
import pyarrow as pa
report = {"client": me, "messages": got, "pulls": pulls, "unacked": unacked, "first": first, "last": last,
          "arrow_pool": pa.default_memory_pool().backend_name,
          "commits": commits, "conflicts_retried": retried, "handed": handed}
print(json.dumps(report), flush=True)
"""


SENDERS = ("spark", "lite")


def prepare(wh: Path, n: int, sender: str = "spark") -> Broker:
    """A warehouse with ``n`` 1 KiB messages dispatched into 4 queues of topic ``orders``
    and a pull group ``workers`` subscribed from the first offset. ``sender``: ``spark``
    (one ``send_dataframe``: the engine writes a few large files, each one row group) or
    ``lite`` (the Spark-free producer's ``send_batch`` of 10 000: files in row groups by
    queue, deltamq/delta_append.py)."""
    shutil.rmtree(wh, ignore_errors=True)
    b = Broker.init(wh)
    b.create_topic("orders", queues=4)
    b.create_group("workers", consume_from="FIRST_OFFSET")
    b.subscribe("workers", "orders")
    if sender == "lite":
        from deltamq import Message
        from deltamq.lite import Producer

        producer = Producer(wh, "p")
        for lo in range(0, n, 10_000):
            bodies = (
                hashlib.sha256(str(i).encode()).hexdigest().encode() * 16
                for i in range(lo, min(n, lo + 10_000))
            )
            producer.send_batch([Message("orders", body) for body in bodies])
    else:
        spark = b.engine.spark
        b.producer("p").send_dataframe(
            spark.range(n).selectExpr(
                "'orders' AS topic", "CAST(repeat(sha2(CAST(id AS STRING), 256), 16) AS BINARY) AS body"
            )
        )
    b.tick()
    return b


def measure(
    root: Path,
    n: int = 100_000,
    batch: int = 1000,
    clients: int = 1,
    kind: str = "spark",
    ack: str = "flush",
    sender: str = "spark",
) -> dict:
    """Pull + ack ``n`` messages with ``clients`` client processes at ``batch``; the
    figures and the checks (``handed_out_once``, ``acked_offsets``, ``in_flight``).
    ``kind``: ``spark`` (``Broker.pull_consumer``, each process with its engine) or
    ``lite`` (``deltamq.lite.PullConsumer``, no engine); ``ack``: ``flush`` (each ack a
    commit) or ``next-pull`` (``ack(flush=False)``: stored with the next pull);
    ``sender``: how the messages were sent (:func:`prepare`)."""
    from deltamq.tables import deliveries
    from deltamq.tables.consume_queue import load_dispatch_state

    wh = Path(root) / f"pull-{n}-{clients}-{kind}-{ack}-{sender}"
    prepare(wh, n, sender).close()  # the clients run alone, as PGMQ's server does in its run
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    env["RUST_LOG"] = "error"
    go = time.time() + 8.0 + 2.0 * clients  # every client's engine is up before the start
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(wh), f"client-{i}", str(batch), str(go), kind, ack],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(clients)
    ]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=3600)
            assert p.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:  # one client failed: the others do not run on into the next measurement
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if len(reports) < len(procs):
            shutil.rmtree(wh, ignore_errors=True)
    total = sum(r["messages"] for r in reports)
    start = min(r["first"] for r in reports)
    end = max(r["last"] for r in reports)
    handed: dict[int, list[int]] = defaultdict(list)
    for r in reports:
        for q, offsets in r.pop("handed").items():
            handed[int(q)] += offsets
    b = Broker.open(wh)
    heads = {q: h for (t, q), h in load_dispatch_state(b.warehouse).heads.items() if t == "orders"}
    once = sum(heads.values()) == n and all(
        sorted(handed.get(q, [])) == list(range(h)) for q, h in heads.items()
    )
    b.tick()  # the pull_expiry step folds the deliveries log into offsets
    acked = b.sql(
        "SELECT sum(next_offset) AS n FROM offsets WHERE consumer_group = 'workers' AND topic = 'orders'"
    ).collect()[0]["n"]
    in_flight = sum(
        d - a for (t, _), (a, d) in deliveries.positions(b.warehouse, "workers").items() if t == "orders"
    )
    b.close()
    shutil.rmtree(wh, ignore_errors=True)
    return {
        "messages": n,
        "kind": kind,
        "ack": ack,
        "sender": sender,
        "clients": clients,
        "batch": batch,
        "handed_out": total,
        "handed_out_once": once,
        "acked_offsets": acked,
        "in_flight": in_flight,
        "seconds": round(end - start, 2),
        "msgs_per_s": round(n / (end - start)),
        "per_client": [
            {
                k: r[k]
                for k in (
                    "client",
                    "messages",
                    "pulls",
                    "unacked",
                    "commits",
                    "conflicts_retried",
                    "arrow_pool",
                )
            }
            for r in reports
        ],
    }


def profile(root: Path, n: int = 20_000, batch: int = 1000) -> dict:
    """One client in this process: the Spark statements of its pull + ack cycles, each
    timed from the client (round trips included) and named by the deltamq function that
    ran it; ms per cycle and statements per cycle, slowest first."""
    from pyspark.sql.connect.client import core

    wh = Path(root) / f"pull-profile-{n}"
    b = prepare(wh, n)
    consumer = b.pull_consumer("workers", "c0")
    consumer.pull(batch)  # the first pull takes the locks
    spent: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    depth = [0]
    originals = {}

    def timed(name):
        original = getattr(core.SparkConnectClient, name)
        originals[name] = original

        def wrapper(self, *args, **kwargs):
            if depth[0]:
                return original(self, *args, **kwargs)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                frames = [
                    f"{Path(f.filename).stem}.{f.name}"
                    for f in traceback.extract_stack()
                    if "/deltamq/" in f.filename and not f.filename.endswith("engine.py")
                ]
                where = " < ".join(reversed(frames[-2:])) if frames else "?"
                s = spent[f"{where} ({'schema' if name == '_analyze' else 'execute'})"]
                s[0] += 1
                s[1] += time.perf_counter() - t0

        setattr(core.SparkConnectClient, name, wrapper)

    for name in ("_execute_and_fetch", "_analyze"):
        timed(name)
    cycles = got = 0
    pull_s = ack_s = 0.0
    try:
        while True:
            t0 = time.perf_counter()
            msgs = consumer.pull(batch)
            pull_s += time.perf_counter() - t0
            if not msgs:
                break
            t0 = time.perf_counter()
            consumer.ack([m.receipt_handle for m in msgs])
            ack_s += time.perf_counter() - t0
            cycles += 1
            got += len(msgs)
    finally:
        for name, original in originals.items():
            setattr(core.SparkConnectClient, name, original)
    b.close()
    shutil.rmtree(wh, ignore_errors=True)
    cycles = max(cycles, 1)
    return {
        "messages": got,
        "batch": batch,
        "cycles": cycles,
        "msgs_per_s": round(got / (pull_s + ack_s)),
        "pull_ms": round(pull_s / cycles * 1000, 1),
        "ack_ms": round(ack_s / cycles * 1000, 1),
        "statements": [
            {"where": k, "ms_per_cycle": round(t / cycles * 1000, 1), "per_cycle": round(c / cycles, 2)}
            for k, (c, t) in sorted(spent.items(), key=lambda kv: -kv[1][1])
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kinds", nargs="+", choices=["spark", "lite"], default=["spark", "lite"])
    ap.add_argument(
        "--acks", nargs="+", choices=["flush", "next-pull"], default=["flush"], help="ack(flush=...) modes"
    )
    ap.add_argument("--profile", action="store_true", help="also time each statement of a cycle")
    ap.add_argument(
        "--senders", nargs="+", choices=SENDERS, default=["spark"], help="how the messages are sent (prepare)"
    )
    ap.add_argument(
        "--vs-pgmq",
        action="store_true",
        help="run PGMQ's read + delete (bench_pgmq.py) just before each client count's runs",
    )
    ap.add_argument("--root", default="/tmp/deltamq-bench")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "pull", "at": datetime.now(UTC).isoformat()}
    if args.profile:
        result["profile"] = profile(root, min(args.messages, 20_000), args.batch)
    result["runs"], pgmq = [], []
    for c in args.clients:
        if args.vs_pgmq:
            import bench_pgmq

            pgmq.append(bench_pgmq.measure(root, args.messages, args.batch, c))
        for k in args.kinds:
            for sender in args.senders:
                result["runs"] += [
                    measure(root, args.messages, args.batch, c, k, a, sender) for a in args.acks
                ]
    if pgmq:
        result["pgmq"] = pgmq
    out = HERE / "results" / f"pull-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    baseline = {r["clients"]: r["msgs_per_s"] for r in pgmq}
    for r in pgmq:
        print(f"PGMQ {r['pgmq']}, {r['clients']} client(s): {r['msgs_per_s']} msgs/s, once: {r['read_once']}")
    for r in result["runs"]:
        vs = baseline.get(r["clients"])
        ratio = f" ({r['msgs_per_s'] / vs:.2f} x PGMQ)" if vs else ""
        print(
            f"{r['kind']} client, acks {r['ack']}, sent by {r['sender']}, {r['clients']} client(s): "
            f"{r['msgs_per_s']} msgs/s"
            f"{ratio}, handed out once: {r['handed_out_once']}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
