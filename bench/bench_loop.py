"""Benchmark: throughput through the loop users run, with default group settings.

- **Bulk** (:func:`bulk`): N messages (1 KiB incompressible, 4 queues) sent with one
  ``send_dataframe``, then ``broker.tick()`` until a trivial listener
  (``consume_message_batch_max_size`` 1000, every other group setting at its default) has
  consumed them all — msgs/s from the send to the last tick, and the ticks it took.
- **Sustained** (:func:`sustained`): ``deltamq tick --loop`` in its own process while two
  producer processes send ``send_batch`` of 1 000 (1 KiB random bodies) for a fixed time —
  one the Spark-free producer (``deltamq.lite``), one ``Broker.producer``. Then the loop
  works off what is left. Reported: produced and consumed msgs/s in the window, the
  backlog when the producers stopped, the time to drain, and the loop's tick durations
  (from ``job_runs``).

Writes ``bench/results/loop-<timestamp>.json``; ``bench/run.py`` calls both. A benchmark,
not a test.

    python bench/bench_loop.py [--messages 1000000] [--seconds 60] [--sustained-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from deltamq import Broker, FakeClock

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from bench_send_dispatch import body_expr  # noqa: E402

LISTENER = "bench_listeners:ok"

PRODUCER = """
import json, os, statistics, sys, time
kind, wh, seconds, go = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
from deltamq.message import Message
if kind == "lite":
    from deltamq.lite import Producer
    producer = Producer(wh, "lite-producer")
else:
    from deltamq import Broker
    producer = Broker.init(wh).producer("spark-producer")
producer.send(Message("bench", b"warm-up"))
time.sleep(max(0.0, go - time.time()))
sent, spent = 1, []
t0 = time.time()
while time.time() - t0 < seconds:
    batch = [Message("bench", os.urandom(1024)) for _ in range(1000)]
    s = time.time()
    producer.send_batch(batch)
    spent.append(time.time() - s)
    sent += len(batch)
print(json.dumps({"kind": kind, "sent": sent, "seconds": round(time.time() - t0, 2),
                  "batches": len(spent), "batch_median_s": round(statistics.median(spent), 3)}))
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _group(b: Broker, listener: str = LISTENER) -> None:
    b.create_topic("bench", queues=4)
    b.create_group("g", listener, consume_from="FIRST_OFFSET", consume_message_batch_max_size=1000)
    b.subscribe("g", "bench")


def bulk(root: Path, n: int, listener: str = LISTENER, send: str = "dataframe") -> dict:
    """One ``send_dataframe`` (or ``send_arrow``: ``send``) of ``n`` rows, then ticks until
    all are consumed."""
    wh = root / "loop-bulk"
    shutil.rmtree(wh, ignore_errors=True)
    staging = root / f"loop-staging-{n}"
    clock = FakeClock()
    b = Broker.init(wh, clock=clock)
    _group(b, listener)
    if not staging.exists():
        b.spark.range(n).selectExpr("'bench' AS topic", f"{body_expr()} AS body").write.parquet(str(staging))
    b.tick(clock.now_ms())  # the runner's first tick (leases, catalog) is not the work's
    table = pq.read_table(str(staging)) if send == "arrow" else None  # in memory, as the floor's
    t0 = time.perf_counter()
    if table is not None:
        b.producer("bench").send_arrow(table)
        del table
    else:
        b.producer("bench").send_dataframe(b.spark.read.parquet(str(staging)))
    sent_s = time.perf_counter() - t0
    consumed, ticks = 0, []
    while consumed < n and len(ticks) < 100:
        clock.advance(seconds=1)
        s = time.perf_counter()
        r = b.tick(clock.now_ms())
        got = r.delivered.consumed if r.delivered else 0
        ticks.append({"s": round(time.perf_counter() - s, 3), "consumed": got})
        consumed += got
    total = time.perf_counter() - t0
    b.close()
    shutil.rmtree(wh, ignore_errors=True)
    assert consumed == n, (consumed, n)
    return {
        "messages": n,
        "listener": listener,
        "send": send,
        "send_s": round(sent_s, 2),
        "ticks": ticks,
        "tick_count": len(ticks),
        "total_s": round(total, 2),
        "msgs_per_s": round(n / total),
    }


def sustained(
    root: Path,
    seconds: float = 60.0,
    drain_limit_s: float = 180.0,
    listener: str = LISTENER,
    kinds: tuple[str, ...] = ("lite", "lite"),
) -> dict:
    """Producer processes (``kinds``: ``lite`` is the Spark-free producer, ``spark`` the
    broker's) sending for ``seconds`` while ``deltamq tick --loop`` runs."""
    wh = root / "loop-sustained"
    shutil.rmtree(wh, ignore_errors=True)
    b = Broker.init(wh)
    _group(b, listener)
    b.close()
    env = _env()
    loop = subprocess.Popen(
        [sys.executable, "-m", "deltamq.cli", "tick", "--loop", "--warehouse", str(wh)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    go = time.time() + 25  # the producers' and the loop's engines start first
    producers = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, kind, str(wh), str(seconds), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for kind in kinds
    ]
    sent = []
    for p in producers:
        out, err = p.communicate(timeout=seconds + 300)
        assert p.returncode == 0, err[-3000:]
        sent.append(json.loads(out.strip().splitlines()[-1]))
    stopped = time.time()
    total_sent = sum(s["sent"] for s in sent)
    b = Broker.init(wh)
    consumed_sql = "SELECT coalesce(sum(next_offset), 0) AS n FROM offsets WHERE consumer_group = 'g'"
    at_stop = b.sql(consumed_sql).collect()[0]["n"]
    drained = None
    while time.time() - stopped < drain_limit_s:
        if b.sql(consumed_sql).collect()[0]["n"] >= total_sent:
            drained = time.time()
            break
        time.sleep(0.5)
    loop.terminate()
    _, loop_err = loop.communicate(timeout=120)
    runs = b.sql(
        "SELECT tick_id, job, start_ts, end_ts, details['consumed'] AS consumed "
        "FROM job_runs ORDER BY start_ts"
    ).collect()
    b.close()
    ticks: dict[str, dict] = {}
    for r in runs:
        t = ticks.setdefault(r["tick_id"], {"start": r["start_ts"], "end": r["end_ts"], "consumed": 0})
        t["start"], t["end"] = min(t["start"], r["start_ts"]), max(t["end"], r["end_ts"])
        if r["job"] == "deliver":
            t["consumed"] += r["consumed"] or 0
    in_window = [t for t in ticks.values() if go * 1000 <= t["end"] <= (go + seconds) * 1000]
    window_consumed = sum(t["consumed"] for t in in_window)
    busy = [(t["end"] - t["start"]) / 1000 for t in in_window if t["consumed"]]
    shutil.rmtree(wh, ignore_errors=True)
    assert drained is not None, (
        f"not drained {drain_limit_s} s after the producers stopped: {loop_err[-2000:]}"
    )
    return {
        "seconds": seconds,
        "listener": listener,
        "kinds": list(kinds),
        "producers": sent,
        "sent": total_sent,
        "produced_msgs_per_s": round(total_sent / seconds),
        "consumed_in_window": window_consumed,
        "consumed_msgs_per_s_in_window": round(window_consumed / seconds),
        "backlog_when_producers_stopped": total_sent - at_stop,
        "drain_s": round(drained - stopped, 1),
        "end_to_end_msgs_per_s": round(total_sent / (drained - go)),
        "ticks_in_window": len(in_window),
        "busy_tick_median_s": round(statistics.median(busy), 3) if busy else None,
        "busy_tick_max_s": round(max(busy), 3) if busy else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--root", default="/tmp/deltamq-bench-loop")
    ap.add_argument("--sustained-only", action="store_true", help="only the sustained run")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result = {"bench": "loop", "at": datetime.now(UTC).isoformat()}
    if not args.sustained_only:
        result["bulk"] = bulk(root, args.messages)
    result["sustained"] = sustained(root, args.seconds)
    (HERE / "results" / f"loop-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
