"""The benchmark suite (issue 12): the end-to-end figure and the other targets, in one run.

- **End to end**: N messages (1 KiB incompressible bodies, 4 queues) sent with
  ``send_dataframe``, dispatched, and delivered to a trivial listener
  (``consume_message_batch_max_size`` 1000) — msgs/s over the three steps, each timed.
- **Parquet floor**: pyarrow writing the same commit_log rows as Parquet on the same
  disk, the fastest of three writes; the end-to-end and send rates as a share of it.
- **Idle tick**: every job, nothing new — median and p95 of 20 ticks on that warehouse.
- **Peak memory** of the driver process (RSS).
- **Tick cost vs history** (``--history``): one warehouse grown to 1M and then 10M
  retained messages (1M-message steps, each sent, dispatched and consumed by a tick);
  at both sizes the median of ticks that each carry 1 000 new messages (send + tick:
  dispatch, promote, deliver, check, retain) and of idle ticks. The ratio is the
  10M / 1M cost.
- **Through the loop** (``--loop``, issue 23; ``bench_loop.py``): the same N sent with one
  ``send_dataframe`` and consumed by ``broker.tick()`` with **default group settings**
  (the RocketMQ-shaped listener and the columnar one), and 60 s of two producer
  processes (the Spark-free one and ``Broker.producer``, ``send_batch`` of 1 000) while
  ``deltamq tick --loop`` runs.
- **Delay lateness** (``--lateness``): 10 000 timers due across one minute,
  ``deltamq tick --loop`` on the real clock, measured at the listener: p50/p99 of (call −
  due), waking at due times and the old interval-only loop (``bench_promote.lateness_both``).
- **Pull** (``--pull``): pull + ack of 100 000 1 KiB messages at batch 1 000 by one and by
  four client processes, each ack a commit, each message handed out once: the Spark-free
  client and the broker's (``bench_pull.measure``), beside PGMQ's read + delete in the
  same run (``bench_pgmq.measure``, when PostgreSQL is installed).

Targets (2 cores): end to end ≥ 200k msgs/s and ≥ 30 % of the Parquet floor (one pass
and through the loop); idle tick ≤ 0.3 s; 10M / 1M tick cost ≤ 1.2; lateness p99 ≤ 0.6 s;
pull with one client ≥ PGMQ's in the same run, more with four. Writes
``bench/results/run-<timestamp>.json`` and the table between the ``run.py`` markers in
bench/README.md, each figure beside its target and their ratio. A benchmark, not a test.

``--warehouse s3://bucket/prefix`` puts the warehouses on object storage (credentials
from the standard AWS_* variables); ``--s3-emulator`` starts moto's S3 server on
127.0.0.1 for it first (the bucket is created). The table then goes between the
``run.py s3`` markers, with the time spent in the storage seam's own requests (Delta log
reads, size checks, listings) beside the engine's. The emulator is not S3: the figures
show the overhead of the object-store path, not S3's speed.

``--engine spark`` measures the suite's rows at N on both engines, first the embedded
Sail server, then Apache Spark's own Spark Connect server with Delta (local[2],
deltamq.spark_setup): one pass with either listener, idle and busy ticks (10 000
messages) with the statements each runs, through the loop, the sustained loop, pull +
ack (at most 5 000 messages) and, with ``--lateness``, 1 000 timers across 20 s; the two
columns go between the ``run.py spark`` markers. On Apache Spark with a local warehouse
the producers and pull clients are the broker's: the Spark-free ones must not write a
local warehouse Apache Spark writes (docs/engines.md).

    python bench/run.py [--messages 1000000] [--loop] [--lateness] [--pull] [--history]
    python bench/run.py --engine spark --messages 20000 --lateness
    python bench/run.py --messages 1000000 --warehouse s3://deltamq-bench/run --s3-emulator
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from deltamq import Broker, FakeClock, Message
from deltamq.jobs import deliver, dispatch
from deltamq.storage import Storage

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from bench_send_dispatch import body_expr  # noqa: E402

BEGIN, END = "<!-- run.py:begin -->", "<!-- run.py:end -->"
S3_BEGIN, S3_END = "<!-- run.py s3:begin -->", "<!-- run.py s3:end -->"
SPARK_BEGIN, SPARK_END = "<!-- run.py spark:begin -->", "<!-- run.py spark:end -->"
# where warehouses go: None (under --root) or an object-store URI prefix (--warehouse)
WAREHOUSE_ROOT: str | None = None
# time and calls spent in the storage seam's own requests, by method
SEAM: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])


def _time_the_seam() -> None:
    for name in ("list", "read_text", "sizes", "delete"):
        original = getattr(Storage, name)

        def timed(self, *a, _original=original, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _original(self, *a, **kw)
            finally:
                SEAM[_name][0] += 1
                SEAM[_name][1] += time.perf_counter() - t

        setattr(Storage, name, timed)


def _seam_spent() -> dict:
    out = {k: {"calls": int(v[0]), "s": round(v[1], 2)} for k, v in SEAM.items()}
    SEAM.clear()
    return out


def _remove(wh) -> None:
    if WAREHOUSE_ROOT is None:
        shutil.rmtree(wh, ignore_errors=True)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3_emulator(uri: str) -> subprocess.Popen:
    """moto's S3 server on a free 127.0.0.1 port, the URI's bucket created, and the AWS_*
    variables of this process (and so of the embedded server it starts) pointing at it."""
    port = free_port()
    # moto's server with its conditional writes atomic, as on S3 (tests/support/s3_server.py)
    server = Path(__file__).resolve().parent.parent / "tests" / "support" / "s3_server.py"
    proc = subprocess.Popen(
        [sys.executable, str(server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    bucket = uri.split("://", 1)[1].split("/", 1)[0]
    for _ in range(150):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=2)
            break
        except OSError:
            time.sleep(0.2)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_ALLOW_HTTP="true",
    )
    return proc


def _setup(
    root: Path, name: str, n: int, listener: str = "ok", *, stage: bool = True
) -> tuple[str | Path, FakeClock, Broker, Path]:
    """A warehouse with topic ``bench`` (4 queues) and group ``g`` (a trivial listener, batch
    1000, taking up to ``n`` per queue), and (``stage``) ``n`` rows of 1 KiB bodies staged
    as Parquet."""
    if WAREHOUSE_ROOT is None:
        wh: str | Path = root / name
        shutil.rmtree(wh, ignore_errors=True)
    else:
        wh = f"{WAREHOUSE_ROOT}/{name}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}"
    clock = FakeClock()
    b = Broker.init(wh, clock=clock)
    b.create_topic("bench", queues=4)
    b.create_group(
        "g",
        f"bench_listeners:{listener}",
        consume_from="FIRST_OFFSET",
        pull_batch_size=n,
        consume_message_batch_max_size=1000,
    )
    b.subscribe("g", "bench")
    staging = root / f"{name}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    if stage:
        rows = b.engine.spark.range(n).selectExpr("'bench' AS topic", f"{body_expr()} AS body")
        rows.write.parquet(str(staging))
    return wh, clock, b, staging


FLOOR_WRITES = 3
"""Times the floor is written; its figure is the fastest, the least a write of those rows
takes. One write after a pass of 1 GB ranged 0.45-1.12 s within one run on these
machines (the first touch of freed memory, bench/README.md), so a single write made a
pass's share of it swing as much as the pass; the second and third writes of a round
came within 0.43-0.49 s (`results/arrow-pass-20261129T062926Z.json`)."""


def _floor(b: Broker, root: Path, n: int) -> list[float]:
    """Seconds for pyarrow to write the commit_log rows as one Parquet file, to the same
    store (a local file, or an object next to the warehouse), :data:`FLOOR_WRITES` times."""
    wh = b.warehouse
    if wh.is_local:
        table = pq.read_table(wh.uri("commit_log"))
        floor_path = root / f"floor-{n}.parquet"
        took = []
        for _ in range(FLOOR_WRITES):
            f0 = time.perf_counter()
            pq.write_table(table, str(floor_path), compression="snappy")
            took.append(time.perf_counter() - f0)
            floor_path.unlink(missing_ok=True)
        return took
    from pyarrow import fs

    table = wh.delta_rs("commit_log").to_pyarrow_table()
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    s3 = fs.S3FileSystem(
        region=os.environ.get("AWS_REGION"),
        endpoint_override=endpoint.split("://", 1)[1] if endpoint else None,
        scheme=endpoint.split("://", 1)[0] if endpoint else "https",
    )
    key = wh.uri("commit_log").split("://", 1)[1] + f"-floor-{n}.parquet"
    took = []
    for _ in range(FLOOR_WRITES):
        f0 = time.perf_counter()
        pq.write_table(table, key, filesystem=s3, compression="snappy")
        took.append(time.perf_counter() - f0)
        s3.delete_file(key)
    return took


def end_to_end(
    root: Path, n: int, listener: str = "ok", idle_ticks: int = 20, send: str = "dataframe"
) -> dict:
    wh, clock, b, staging = _setup(root, f"run-{n}", n, listener)
    # send_arrow starts from the rows in memory, as the Parquet floor does (the read of
    # the staged file is timed apart); send_dataframe's send includes Sail's read of it
    r0 = time.perf_counter()
    table = pq.read_table(str(staging)) if send == "arrow" else None
    read_s = time.perf_counter() - r0
    _seam_spent()
    t0 = time.perf_counter()
    if table is not None:
        b.producer("bench").send_arrow(table)
    else:
        b.producer("bench").send_dataframe(b.engine.spark.read.parquet(str(staging)))
    t1 = time.perf_counter()
    del table
    seam_send = _seam_spent()
    d = dispatch.run(b.context, clock.now_ms())
    t2 = time.perf_counter()
    seam_dispatch = _seam_spent()
    r = deliver.run(b.context, clock.now_ms())
    t3 = time.perf_counter()
    seam_deliver = _seam_spent()
    assert d.rows_out == n and r.consumed == n, (d, r)
    floor_writes = _floor(b, root, n)
    floor_s = min(floor_writes)
    # idle ticks, nothing new (the first tick after the pass warms the runner): as they
    # run (a quiet runner skips their jobs), then with every job run (skip_idle_ticks off)
    clock.advance(seconds=1)
    b.tick(clock.now_ms())
    _seam_spent()
    idle = _idle_ticks(b, clock, idle_ticks)
    seam_idle = _seam_spent()
    b.reconfigure(skip_idle_ticks=False)
    idle_full = _idle_ticks(b, clock, idle_ticks)
    b.reconfigure(skip_idle_ticks=True)
    shutil.rmtree(staging, ignore_errors=True)
    _remove(wh)
    total = t3 - t0
    return {
        "messages": n,
        "send_s": round(t1 - t0, 2),
        "dispatch_s": round(t2 - t1, 2),
        "deliver_s": round(t3 - t2, 2),
        "end_to_end_s": round(total, 2),
        "end_to_end_msgs_per_s": round(n / total),
        "parquet_floor_s": round(floor_s, 2),
        "parquet_floor_writes_s": [round(x, 2) for x in floor_writes],
        "parquet_floor_msgs_per_s": round(n / floor_s),
        "end_to_end_vs_floor": round(floor_s / total, 3),
        "send_vs_floor": round(floor_s / (t1 - t0), 3),
        "listener": listener,
        "send": send,
        "arrow_read_s": round(read_s, 2) if send == "arrow" else None,
        "idle_tick_median_s": round(statistics.median(idle), 5) if idle else None,
        "idle_tick_p95_s": round(sorted(idle)[int(len(idle) * 0.95) - 1], 5) if idle else None,
        "idle_full_tick_median_s": round(statistics.median(idle_full), 3) if idle_full else None,
        "idle_full_tick_p95_s": round(sorted(idle_full)[int(len(idle_full) * 0.95) - 1], 3)
        if idle_full
        else None,
        "warehouse": str(wh),
        # the storage seam's own requests (Delta log reads, sizes, listings) in each step
        "seam": {
            "send": seam_send,
            "dispatch": seam_dispatch,
            "deliver": seam_deliver,
            "idle_20_ticks": seam_idle,
        },
    }


def _idle_ticks(b: Broker, clock: FakeClock, n: int) -> list[float]:
    """Seconds each of ``n`` ticks takes, a second apart on ``clock``, with nothing sent."""
    out = []
    for _ in range(n):
        clock.advance(seconds=1)
        s0 = time.perf_counter()
        b.tick(clock.now_ms())
        out.append(time.perf_counter() - s0)
    return out


def _tick_costs(b: Broker, clock: FakeClock, body: bytes, samples: int, busy: int) -> dict:
    p = b.producer("bench")
    busy_s, idle_s = [], []
    for _ in range(samples):
        p.send_batch([Message("bench", body)] * busy)
        clock.advance(seconds=1)
        t = time.perf_counter()
        r = b.tick(clock.now_ms())
        busy_s.append(time.perf_counter() - t)
        assert r.job("deliver").details["consumed"] == busy, r
    for _ in range(samples):
        clock.advance(seconds=1)
        t = time.perf_counter()
        b.tick(clock.now_ms())
        idle_s.append(time.perf_counter() - t)
    return {
        "busy_tick_s": [round(x, 3) for x in busy_s],
        "idle_tick_s": [round(x, 3) for x in idle_s],
        "busy_median_s": round(statistics.median(busy_s), 3),
        "idle_median_s": round(statistics.median(idle_s), 3),
    }


def history(root: Path, step: int, steps: int, busy: int = 1000, samples: int = 7) -> dict:
    """Tick cost (``busy`` new messages per tick, and idle) at ``step`` and at
    ``step * steps`` retained messages, on one warehouse."""
    wh, clock, b, staging = _setup(root, "history", step)
    spark = b.engine.spark
    body = bytes(range(256)) * 4
    points = []
    for k in range(1, steps + 1):
        t = time.perf_counter()
        b.producer("bench").send_dataframe(spark.read.parquet(str(staging)))
        clock.advance(seconds=1)
        r = b.tick(clock.now_ms())
        assert r.job("deliver").details["consumed"] == step, r
        grow_s = time.perf_counter() - t
        retained = b.sql("SELECT count(*) AS n FROM commit_log").collect()[0]["n"]
        print(json.dumps({"retained": retained, "grow_s": round(grow_s, 1)}), flush=True)
        if k in (1, steps):
            points.append({"retained": retained, **_tick_costs(b, clock, body, samples, busy)})
            print(json.dumps(points[-1]), flush=True)
    shutil.rmtree(staging, ignore_errors=True)
    _remove(wh)
    small, big = points[0], points[-1]
    return {
        "busy_messages_per_tick": busy,
        "points": points,
        "busy_ratio": round(big["busy_median_s"] / small["busy_median_s"], 3),
        "idle_ratio": round(big["idle_median_s"] / small["idle_median_s"], 3),
    }


def _x(value: float, target: float) -> str:
    """A figure as a share of its target, 1 × or more when met (an at-most target is
    given the other way round: target first)."""
    return f"{value / target:.2f} ×"


def _arrow_rows(result: dict) -> list[tuple[str, str, str, str]]:
    """The rows of the passes whose send was ``send_arrow`` (``--arrow``)."""
    rows = []
    for key, label, target in (
        ("end_to_end_arrow", "RocketMQ-shaped listener", 200_000),
        ("end_to_end_columnar_arrow", "columnar listener", 250_000),
    ):
        a = result.get(key)
        if a:
            rows += [
                (
                    f"end to end, one pass, send_arrow of the rows in memory, {label}",
                    f"{a['end_to_end_msgs_per_s']:,} msgs/s",
                    f"≥ {target:,}".replace(",", " "),
                    _x(a["end_to_end_msgs_per_s"], target),
                ),
                (
                    "  send / dispatch / deliver (the staged file's pyarrow read, apart)",
                    f"{a['send_s']} / {a['dispatch_s']} / {a['deliver_s']} s ({a['arrow_read_s']} s)",
                    "",
                    "",
                ),
                (
                    "  ... vs its Parquet floor",
                    f"{a['end_to_end_vs_floor'] * 100:.0f} %",
                    "≥ 30 %",
                    _x(a["end_to_end_vs_floor"], 0.3),
                ),
            ]
    for key, label in (("loop_bulk_arrow", "RocketMQ-shaped"), ("loop_bulk_columnar_arrow", "columnar")):
        lb = result.get(key)
        if lb:
            rows.append(
                (
                    f"through the loop: 1 send_arrow, then tick(), {label} listener",
                    f"{lb['msgs_per_s']:,} msgs/s ({lb['tick_count']} ticks)",
                    "≥ 200 000",
                    _x(lb["msgs_per_s"], 200_000),
                )
            )
    return rows


def _table(result: dict) -> str:
    e = result["end_to_end"]
    rows = [
        (
            "end to end, one pass (send + dispatch + deliver, batch 1000)",
            f"{e['end_to_end_msgs_per_s']:,} msgs/s",
            "≥ 200 000",
            _x(e["end_to_end_msgs_per_s"], 200_000),
        ),
        ("  send / dispatch / deliver", f"{e['send_s']} / {e['dispatch_s']} / {e['deliver_s']} s", "", ""),
    ]
    c = result.get("end_to_end_columnar")
    if c:
        rows += [
            (
                "end to end, one pass, columnar listener",
                f"{c['end_to_end_msgs_per_s']:,} msgs/s",
                "≥ 250 000",
                _x(c["end_to_end_msgs_per_s"], 250_000),
            ),
            (
                "  send / dispatch / deliver",
                f"{c['send_s']} / {c['dispatch_s']} / {c['deliver_s']} s",
                "",
                "",
            ),
        ]
    rows += [
        ("pyarrow Parquet floor, same rows", f"{e['parquet_floor_msgs_per_s']:,} msgs/s", "", ""),
        (
            "end to end vs floor",
            f"{e['end_to_end_vs_floor'] * 100:.0f} %",
            "≥ 30 %",
            _x(e["end_to_end_vs_floor"], 0.3),
        ),
        ("send vs floor", f"{e['send_vs_floor'] * 100:.0f} %", "", ""),
    ]
    for key, label in (
        ("loop_bulk", "RocketMQ-shaped listener"),
        ("loop_bulk_columnar", "columnar listener"),
    ):
        lb = result.get(key)
        if lb:
            vs_floor = e["parquet_floor_s"] / lb["total_s"]
            rows += [
                (
                    f"through the loop: 1 send_dataframe, then tick() with default group settings, {label}",
                    f"{lb['msgs_per_s']:,} msgs/s ({lb['tick_count']} ticks)",
                    "≥ 200 000",
                    _x(lb["msgs_per_s"], 200_000),
                ),
                ("  ... vs the Parquet floor", f"{vs_floor * 100:.0f} %", "≥ 30 %", _x(vs_floor, 0.3)),
            ]
    rows += _arrow_rows(result)
    su = result.get("sustained")
    if su:
        kinds = " + ".join(f"{p['kind']} {p['sent'] / p['seconds']:,.0f}" for p in su["producers"])
        rows += [
            (
                f"sustained {su['seconds']:.0f} s: {len(su['producers'])} producer processes "
                f"({' + '.join(su.get('kinds', ['lite', 'spark']))}, send_batch 1 000) + "
                "`tick --loop`, consumed",
                f"{su['consumed_msgs_per_s_in_window']:,} msgs/s",
                "≥ 60 000",
                _x(su["consumed_msgs_per_s_in_window"], 60_000),
            ),
            (
                "  produced (msgs/s per producer)",
                f"{su['produced_msgs_per_s']:,} msgs/s ({kinds})",
                "",
                "",
            ),
            (
                "  backlog when the producers stopped / drained in",
                f"{su['backlog_when_producers_stopped']:,} / {su['drain_s']} s",
                "",
                "",
            ),
            ("  busy tick, median / max", f"{su['busy_tick_median_s']} / {su['busy_tick_max_s']} s", "", ""),
        ]
    rows.append(
        (
            "idle tick (a quiet runner skips its jobs), median / p95",
            f"{e['idle_tick_median_s'] * 1000:.2f} / {e['idle_tick_p95_s'] * 1000:.2f} ms",
            "≤ 0.3 s",
            _x(0.3, max(e["idle_tick_median_s"], 1e-6)),
        )
    )
    if e.get("idle_full_tick_median_s") is not None:
        rows.append(
            (
                "  idle tick running every job (`skip_idle_ticks=False`)",
                f"{e['idle_full_tick_median_s']} / {e['idle_full_tick_p95_s']} s",
                "",
                "",
            )
        )
    lt = result.get("lateness")
    if lt and lt["wake_at_due"]["lateness_ms_p99"] is None:
        rows.append(
            ("timer lateness at the listener", "none reached the listener in the run", "p99 ≤ 0.6 s", "")
        )
    elif lt:
        w, o = lt["wake_at_due"], lt["interval_only"]
        rows += [
            (
                f"timer lateness at the listener p50 / p99, {w['messages']:,} due across a minute, "
                "`tick --loop`",
                f"{w['lateness_ms_p50'] / 1000:.2f} / {w['lateness_ms_p99'] / 1000:.2f} s",
                "p99 ≤ 0.6 s",
                _x(600, w["lateness_ms_p99"]),
            ),
            (
                "  the same, interval-only loop (`--no-wake`, 1 s)",
                f"{o['lateness_ms_p50'] / 1000:.2f} / {o['lateness_ms_p99'] / 1000:.2f} s",
                "",
                "",
            ),
        ]
    rows += _pull_rows(result.get("pull", []), result.get("pgmq") or [])
    rows.append(("peak driver RSS", f"{result['peak_rss_mib']:,} MiB", "", ""))
    if result.get("peak_server_rss_mib"):
        rows.append(
            (
                "peak RSS of the driver's Sail server (its own process)",
                f"{result['peak_server_rss_mib']:,} MiB",
                "",
                "",
            )
        )
    if "history" in result:
        h = result["history"]
        small, big = h["points"][0], h["points"][-1]
        rows.append(
            (
                f"tick with {h['busy_messages_per_tick']:,} new messages at {small['retained']:,} / "
                f"{big['retained']:,} retained",
                f"{small['busy_median_s']} / {big['busy_median_s']} s (× {h['busy_ratio']})",
                "≤ 1.2 ×",
                "",
            )
        )
        rows.append(
            (
                f"idle tick at {small['retained']:,} / {big['retained']:,} retained",
                f"{small['idle_median_s']} / {big['idle_median_s']} s (× {h['idle_ratio']})",
                "≤ 1.2 ×",
                "",
            )
        )
    if "seam" in e and any(e["seam"].values()):
        for step in ("send", "dispatch", "deliver", "idle_20_ticks"):
            spent = e["seam"][step]
            calls = sum(v["calls"] for v in spent.values())
            secs = sum(v["s"] for v in spent.values())
            rows.append(
                (
                    f"  storage seam requests in {step.replace('_', ' ')}",
                    f"{calls} calls, {secs:.2f} s",
                    "",
                    "",
                )
            )
    args = result.get("args") or f"--messages {e['messages']}"
    lines = [
        f"`python bench/run.py {args}` — {result['at'][:10]}, `results/{result['file']}`",
        "",
        "| measure | result | target | share of target (≥ 1 × met) |",
        "|---|---:|---:|---:|",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
    ]
    return "\n".join(lines)


_CLIENTS = {"lite": "Spark-free client (`deltamq.lite`)", "spark": "the broker's client"}


def pulls(root: Path) -> tuple[list[dict], list[dict]]:
    """Pull + ack of 100 000 at batch 1 000 with 1 and 4 client processes, each ack a
    commit: PGMQ's read + delete first (bench_pgmq.py; [] when PostgreSQL is not
    installed), then the Spark-free client, then the broker's."""
    import bench_pgmq
    import bench_pull

    pull, pgmq = [], []
    for clients in (1, 4):
        try:
            pgmq.append(bench_pgmq.measure(root, 100_000, 1000, clients))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - no PostgreSQL, psycopg or pgmq: said in the row
            why = f"{type(e).__name__}: {e}"[:200]
            print(f"PGMQ not run with {clients} client(s): {why}", file=sys.stderr)
            pgmq.append({"clients": clients, "batch": 1000, "error": why})
        pull += [bench_pull.measure(root, 100_000, 1000, clients, kind) for kind in _CLIENTS]
    return pull, pgmq


def _pull_checks(row: dict) -> str:
    """What a pull row's checks found wrong ('' when all held): a run that handed a
    message out twice, missed one or left one in flight gives no figure to compare."""
    n = row.get("messages")
    bad = [
        name
        for name, ok in (
            ("NOT handed out once", row.get("handed_out_once", True)),
            ("PGMQ did NOT read each once", row.get("read_once", True)),
            ("acked offsets short", row.get("acked_offsets", n) == n),
            ("left in flight", not row.get("in_flight")),
        )
        if not ok
    ]
    return f" ({'; '.join(bad)})" if bad else ""


def _pull_rows(pull: list[dict], pgmq: list[dict]) -> list[tuple[str, str, str, str]]:
    """Issue 33's pull targets: one client at least PGMQ's read + delete in the same run,
    four clients faster than one. A row whose checks failed gets no ratio."""
    good = [r for r in pgmq if r.get("msgs_per_s") and not _pull_checks(r)]
    vs = {r["clients"]: r["msgs_per_s"] for r in good}
    one = {
        r.get("kind", "spark"): r["msgs_per_s"]
        for r in pull
        if r["clients"] == 1 and r.get("msgs_per_s") and not _pull_checks(r)
    }
    rows = []
    for r in pgmq:
        name = f"PGMQ {r.get('pgmq', '')} read + delete, batch {r['batch']:,}, {r['clients']} client(s)"
        if r.get("error"):
            rows.append((name, f"not run: {r['error']}", "", ""))
        else:
            rows.append((name, f"{r['msgs_per_s'] or 0:,} msgs/s{_pull_checks(r)}", "", ""))
    for pr in pull:
        kind, n = pr.get("kind", "spark"), pr["clients"]
        name = (
            f"pull + ack, batch {pr['batch']:,}, {_CLIENTS[kind]}, {n} client process{'es' if n > 1 else ''}"
        )
        wrong = _pull_checks(pr)
        base = vs.get(1) if n == 1 else one.get(kind)
        target = ("≥ PGMQ, 1 client" if 1 in vs else "≥ PGMQ (not run here)") if n == 1 else "> 1 client"
        ratio = _x(pr["msgs_per_s"], base) if base and pr.get("msgs_per_s") and not wrong else ""
        rows.append((name, f"{pr['msgs_per_s'] or 0:,} msgs/s{wrong}", target, ratio))
    return rows


class ServerPeak:
    """The embedded Sail server's peak resident memory (``VmHWM``), read every half second
    from its own process while the run goes on (the server may be replaced mid-run; the
    children's ``getrusage`` figure is not it: a child started by fork carries the
    parent's peak)."""

    def __init__(self) -> None:
        import threading

        self.mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from deltamq.sail import EmbeddedServer

        while not self._stop.wait(0.5):
            self.mib = max(self.mib, EmbeddedServer.peak_rss_mb() or 0.0)

    def stop(self) -> int:
        from deltamq.sail import EmbeddedServer

        self._stop.set()
        self._thread.join()
        return round(max(self.mib, EmbeddedServer.peak_rss_mb() or 0.0))


_SERVER_PEAK: ServerPeak | None = None


def peak_server_rss_mib() -> int:
    """The peak resident memory in MiB of this process's embedded Sail server since
    :func:`watch_server` (which it ends), or, without it, the running server's own peak.
    Servers of other processes (the ``tick --loop`` runs) are not counted."""
    global _SERVER_PEAK
    from deltamq.sail import EmbeddedServer

    if _SERVER_PEAK is not None:
        peak, _SERVER_PEAK = _SERVER_PEAK, None
        return peak.stop()
    return round(EmbeddedServer.peak_rss_mb() or 0)


def watch_server() -> None:
    """Start sampling this process's embedded server's peak memory (:class:`ServerPeak`)."""
    global _SERVER_PEAK
    _SERVER_PEAK = ServerPeak()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--history", action="store_true", help="also tick cost at 1M vs 10M retained (slow)")
    ap.add_argument("--history-step", type=int, default=1_000_000, help="messages per growth step")
    ap.add_argument("--history-steps", type=int, default=10, help="growth steps (10: 1M → 10M)")
    ap.add_argument("--lateness", action="store_true", help="also timer lateness under the real clock")
    ap.add_argument("--loop", action="store_true", help="also throughput through tick() and a sustained loop")
    ap.add_argument("--sustained-s", type=float, default=60.0, help="seconds the producers send for")
    ap.add_argument("--pull", action="store_true", help="also pull + ack with 1 and 4 client processes")
    ap.add_argument(
        "--arrow", action="store_true", help="also one pass and the loop with the send by send_arrow"
    )
    ap.add_argument("--root", default="/tmp/deltamq-bench-run")
    ap.add_argument("--warehouse", help="put the warehouses under this object-store URI (s3://bucket/prefix)")
    ap.add_argument("--s3-emulator", action="store_true", help="start moto's S3 server for --warehouse first")
    ap.add_argument("--engine", choices=("embedded", "spark"), default="embedded")
    args = ap.parse_args()
    if args.engine == "spark":
        spark_run(Path(args.root), args.messages, args.lateness, args.sustained_s)
        return
    global WAREHOUSE_ROOT
    emulator = None
    if args.warehouse:
        WAREHOUSE_ROOT = args.warehouse.rstrip("/")
        if args.s3_emulator:
            emulator = start_s3_emulator(WAREHOUSE_ROOT)
    _time_the_seam()
    watch_server()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result: dict = {
        "bench": "run",
        "at": datetime.now(UTC).isoformat(),
        "file": f"run-{stamp}.json",
        "args": " ".join(sys.argv[1:]),
    }
    result["end_to_end"] = end_to_end(root, args.messages)
    if args.loop:
        import bench_loop

        result["end_to_end_columnar"] = end_to_end(root, args.messages, "ok_columnar", idle_ticks=0)
        result["loop_bulk"] = bench_loop.bulk(root, args.messages)
        result["loop_bulk_columnar"] = bench_loop.bulk(root, args.messages, "bench_listeners:ok_columnar")
        result["sustained"] = bench_loop.sustained(root, args.sustained_s)
    if args.arrow:
        import bench_loop

        result["end_to_end_arrow"] = end_to_end(root, args.messages, idle_ticks=0, send="arrow")
        result["end_to_end_columnar_arrow"] = end_to_end(
            root, args.messages, "ok_columnar", idle_ticks=0, send="arrow"
        )
        result["loop_bulk_arrow"] = bench_loop.bulk(root, args.messages, send="arrow")
        result["loop_bulk_columnar_arrow"] = bench_loop.bulk(
            root, args.messages, "bench_listeners:ok_columnar", send="arrow"
        )
    if args.lateness:
        import bench_promote

        result["lateness"] = bench_promote.lateness_both(root, 10_000)
    if args.pull:
        result["pull"], result["pgmq"] = pulls(root)
    if args.history:
        result["history"] = history(root, args.history_step, args.history_steps)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result["peak_server_rss_mib"] = peak_server_rss_mib()
    if emulator is not None:
        result["s3_emulator"] = "moto_server on 127.0.0.1"
        emulator.terminate()
    (HERE / "results" / result["file"]).write_text(json.dumps(result, indent=2) + "\n")
    begin, end = (S3_BEGIN, S3_END) if WAREHOUSE_ROOT else (BEGIN, END)
    heading = "On object storage — `run.py --warehouse s3://…`" if WAREHOUSE_ROOT else "The suite — `run.py`"
    _write_block(begin, end, heading, _table(result))
    print(json.dumps(result, indent=2))


def _write_block(begin: str, end: str, heading: str, body: str) -> None:
    """``body`` between the ``begin`` and ``end`` markers of bench/README.md, in place of
    what was there; the first time, in a section of its own (``heading``) before the first."""
    readme = HERE / "README.md"
    text = readme.read_text()
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.replace("\n## ", f"\n## {heading}\n\n{block}\n\n## ", 1)
    readme.write_text(text)


def _start_spark_server(root: Path) -> subprocess.Popen:
    """Apache Spark's Connect server with Delta on a free port; DELTAMQ_SPARK_REMOTE names it."""
    import socket

    from deltamq.spark_setup import child_env, connect_server_command, python_conf

    port = free_port()
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    conf = python_conf(pythonpath=env["PYTHONPATH"]) | {
        "spark.ui.enabled": "false",
        "spark.log.level": "WARN",
        "spark.driver.memory": "6g",
        "spark.sql.shuffle.partitions": "2",
    }
    log = open(root / "spark-server.log", "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(
        connect_server_command(port, master="local[2]", extra_conf=conf), env=env, stdout=log, stderr=log
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        raise SystemExit(f"Spark's Connect server did not start: {root / 'spark-server.log'}")
    os.environ["DELTAMQ_SPARK_REMOTE"] = f"sc://127.0.0.1:{port}"
    return proc


def _statements(b: Broker, run) -> tuple[float, int]:
    s0, t0 = b.engine.stats.statements, time.perf_counter()
    run()
    return time.perf_counter() - t0, b.engine.stats.statements - s0


PULL_MESSAGES = 5_000
"""Messages the pull rows of ``--engine spark`` take, at most."""


def _ticks(root: Path) -> dict:
    """Idle ticks (as they run, then with every job run) and busy ticks of 10 000
    messages, each with the engine statements it ran."""
    wh, clock, b, staging = _setup(root, "ticks", 10_000, stage=False)  # its sends are send_batch
    body = bytes(range(256)) * 4
    idle, busy, idle_full = [], [], []
    b.tick(clock.now_ms())  # warms the runner
    for _ in range(5):
        clock.advance(seconds=1)
        idle.append(_statements(b, lambda: b.tick(clock.now_ms())))
    b.reconfigure(skip_idle_ticks=False)
    for _ in range(3):
        clock.advance(seconds=1)
        idle_full.append(_statements(b, lambda: b.tick(clock.now_ms())))
    b.reconfigure(skip_idle_ticks=True)
    for _ in range(3):
        b.producer("bench").send_batch([Message("bench", body)] * 10_000)
        clock.advance(seconds=1)
        busy.append(_statements(b, lambda: b.tick(clock.now_ms())))
    b.close()
    shutil.rmtree(staging, ignore_errors=True)
    _remove(wh)

    def summed(runs: list[tuple[float, int]], digits: int) -> dict:
        return {"median_s": round(statistics.median(t for t, _ in runs), digits),
                "statements": statistics.median(k for _, k in runs)}  # fmt: skip

    return {
        "idle_tick": summed(idle, 4),
        "idle_full_tick": summed(idle_full, 3),
        "busy_tick_10k": summed(busy, 3),
    }


def engine_rows(root: Path, n: int, engine: str, lateness: bool, sustained_s: float) -> dict:
    """Every row of the suite on the engine now configured (``engine``: ``sail``, the
    embedded server, or ``spark``, Apache Spark's Connect server named by
    DELTAMQ_SPARK_REMOTE), at ``n`` messages. On Apache Spark with a local warehouse the
    producers and pull clients are the broker's (through the engine): the Spark-free ones
    must not write a local warehouse Apache Spark writes (docs/engines.md)."""
    import bench_loop

    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"engine": engine, "messages": n}
    out["end_to_end"] = end_to_end(root, n, idle_ticks=5)
    out["end_to_end_columnar"] = end_to_end(root, n, "ok_columnar", idle_ticks=0)
    out |= _ticks(root)
    out["loop_bulk"] = bench_loop.bulk(root, n)
    out["loop_bulk_columnar"] = bench_loop.bulk(root, n, "bench_listeners:ok_columnar")
    kinds = ("spark", "spark") if engine == "spark" else ("lite", "lite")
    out["sustained"] = bench_loop.sustained(root, sustained_s, drain_limit_s=900, kinds=kinds)
    clients = ["spark"] if engine == "spark" else ["spark", "lite"]
    pulled = min(n, PULL_MESSAGES)  # four of the broker's clients on Apache Spark: ~50 msgs/s
    out["pull"] = [_pulled(root, pulled, c, kind) for kind in clients for c in (1, 4)]
    if lateness:
        import bench_promote

        out["lateness"] = bench_promote.lateness(root, 1_000, spread_s=20.0)
    return out


def _pulled(root: Path, n: int, clients: int, kind: str) -> dict:
    """``bench_pull.measure`` of ``clients`` client processes, or the error that ended
    one of them (the row says so rather than the run ending there)."""
    import bench_pull

    try:
        return bench_pull.measure(root, n, 1000, clients, kind)
    except AssertionError as e:  # a client process failed: its stderr's last line
        lines = [line for line in str(e).splitlines() if line.strip()]
        return {"kind": kind, "clients": clients, "error": lines[-1] if lines else "a client failed"}


def spark_run(root: Path, n: int, lateness: bool, sustained_s: float) -> None:
    """``--engine spark``: every row of the suite at ``n`` messages, first on the embedded
    Sail server, then on Apache Spark's Connect server (local[2]); both side by side in
    bench/README.md."""
    import bench_listeners

    from deltamq.engine import Engine

    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result: dict = {"bench": "run --engine spark", "at": datetime.now(UTC).isoformat(),
                    "file": f"run-spark-{stamp}.json", "args": " ".join(sys.argv[1:])}  # fmt: skip
    for name in ("DELTAMQ_ENGINE", "DELTAMQ_REMOTE", "DELTAMQ_SPARK_REMOTE"):  # each half picks its own
        os.environ.pop(name, None)
    saved = HERE / "results" / result["file"]
    try:
        result["sail"] = engine_rows(root / "sail", n, "sail", lateness, sustained_s)
        saved.write_text(json.dumps(result, indent=2) + "\n")  # kept if the Spark half fails
        Engine.shutdown_embedded()  # its memory is not Apache Spark's to share
        # the lateness listener runs in the server's Python workers, which have the
        # server's environment: where it writes must be set before the server starts
        os.environ[bench_listeners.DUE_LOG_ENV] = str(root / "spark" / "lateness-listener.log")
        server = _start_spark_server(root)
        try:
            result["spark"] = engine_rows(root / "spark", n, "spark", lateness, sustained_s)
        finally:
            server.terminate()
            server.wait()
            os.environ.pop("DELTAMQ_SPARK_REMOTE", None)
            os.environ.pop(bench_listeners.DUE_LOG_ENV, None)
    finally:
        saved.write_text(json.dumps(result, indent=2) + "\n")
    body = f"`python bench/run.py {result['args']}` — {result['at'][:10]}, `results/{result['file']}`\n\n"
    _write_block(
        SPARK_BEGIN,
        SPARK_END,
        "On Apache Spark — `run.py --engine spark`",
        body + "\n".join(_spark_table(result)),
    )
    print(json.dumps(result, indent=2))


def _spark_table(result: dict) -> list[str]:
    """The rows of both engines side by side (the Sail column at the same size)."""
    sail, spark = result["sail"], result["spark"]

    def both(label: str, cell, target: str = "") -> str:
        return f"| {label} | {cell(sail)} | {cell(spark)} | {target} |"

    def rate(key: str):
        return lambda r: f"{r[key]['end_to_end_msgs_per_s']:,} msgs/s"

    def steps(key: str):
        return lambda r: f"{r[key]['send_s']} / {r[key]['dispatch_s']} / {r[key]['deliver_s']} s"

    def tick(key: str):
        return lambda r: f"{r[key]['median_s']} s ({r[key]['statements']:.0f} statements)"

    def loop(key: str):
        return lambda r: f"{r[key]['msgs_per_s']:,} msgs/s ({r[key]['tick_count']} ticks)"

    def sustained(r: dict) -> str:
        s = r["sustained"]
        return (f"{s['consumed_msgs_per_s_in_window']:,}/s consumed by ticks ending in the window "
                f"({s['end_to_end_msgs_per_s']:,}/s sent to drained), "
                f"{s['produced_msgs_per_s']:,} produced/s ({' + '.join(s['kinds'])}), "
                f"drained in {s['drain_s']} s")  # fmt: skip

    def pull(kind: str, clients: int):
        def cell(r: dict) -> str:
            found = [p for p in r["pull"] if p["kind"] == kind and p["clients"] == clients]
            if not found:
                return (
                    "not run (Spark-free writers on a local warehouse Apache Spark writes: docs/engines.md)"
                )
            p = found[0]
            if "error" in p:
                return f"failed: {p['error'][:200]}"
            return f"{p['msgs_per_s']:,} msgs/s" + ("" if p["handed_out_once"] else " (NOT handed out once)")

        return cell

    n = sail["messages"]
    rows = [
        "| measure | Sail 0.7.2 (embedded) | Apache Spark 4.0.5 + Delta 4.0.1 (Connect server, local[2]) "
        "| target (issue 33: at 1M, Sail) |",
        "|---|---:|---:|---:|",
        both(f"one pass of {n:,}, RocketMQ-shaped listener", rate("end_to_end"), "≥ 200 000"),
        both("  send / dispatch / deliver", steps("end_to_end")),
        both(f"one pass of {n:,}, columnar listener", rate("end_to_end_columnar"), "≥ 250 000"),
        both("  send / dispatch / deliver", steps("end_to_end_columnar")),
        both(
            "end to end vs the Parquet floor",
            lambda r: f"{r['end_to_end']['end_to_end_vs_floor']:.1%}",
            "≥ 30 %",
        ),
        both(
            f"through the loop ({n:,}, one send_dataframe), RocketMQ-shaped", loop("loop_bulk"), "≥ 200 000"
        ),
        both("through the loop, columnar", loop("loop_bulk_columnar"), "≥ 200 000"),
        both("sustained: 2 producer processes + `tick --loop`", sustained, "≥ 60 000 consumed/s"),
        both("idle tick (a quiet runner skips its jobs), median", tick("idle_tick"), "≤ 2 s (Spark)"),
        both("idle tick running every job, median", tick("idle_full_tick")),
        both("busy tick, 10 000 messages, median", tick("busy_tick_10k"), "≤ 5 s (Spark)"),
    ]
    for kind, label in (("spark", "the broker's client"), ("lite", "Spark-free client")):
        for clients in (1, 4):
            rows.append(
                both(
                    f"pull + ack of {min(n, PULL_MESSAGES):,}, batch 1 000, {label}, {clients} process(es)",
                    pull(kind, clients),
                )
            )
    if "lateness" in sail:

        def late(r: dict) -> str:
            ms = r["lateness"]
            if ms["lateness_ms_p99"] is None:
                return f"none of {ms['messages']:,} reached the listener in the run ({ms['ticks']} ticks)"
            return (
                f"p50 {ms['lateness_ms_p50'] / 1000:.2f} / p99 {ms['lateness_ms_p99'] / 1000:.2f} s "
                f"({ms['delivered']:,} of {ms['messages']:,} delivered, {ms['duplicates']} twice)"
            )

        rows.append(both("timer lateness at the listener, 1 000 across 20 s", late, "p99 ≤ 0.6 s"))
    rows.append(
        "| requests per tick on S3 | see the object-storage section | refused: Delta-Spark's S3 log store "
        "is not atomic between writers (docs/engines.md) | |"
    )
    return rows


if __name__ == "__main__":
    main()
