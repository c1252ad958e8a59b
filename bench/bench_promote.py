"""Benchmark: the schedule service and timers.

(a) Tick cost when nothing is due, with 1M held messages (half level-18 delays, half
    timers due in 1..30 days) vs. with 10k held. Flat is the goal.
(b) Lateness with the real clock: timers due across one minute, the broker running
    ``deltamq tick --loop --interval 1`` in another process, a push group with default
    settings. Lateness = the wall time the listener was called with a message − its due
    time (:func:`lateness`); with ``--lateness-only``, the default loop and the
    interval-only loop (``--no-wake``) one after the other (:func:`lateness_both`).
(c) With ``--ahead-ms``, lateness for each ``promote_ahead_ms`` given, in turn
    (:func:`ahead`), on Sail or (``--engine spark``) on Apache Spark.

Writes bench/results/promote-<timestamp>.json (lateness-<timestamp>.json with
``--lateness-only``, promote-ahead-<timestamp>.json with ``--ahead-ms``). A benchmark,
not a test.

    python bench/bench_promote.py [--held 1000000] [--lateness 100000]
    python bench/bench_promote.py --lateness-only [--lateness 10000]
    python bench/bench_promote.py --ahead-ms 1000 8000 --lateness 1000 --engine spark
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

from deltamq import Broker, FakeClock

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
DAY = 86_400_000

import bench_listeners  # noqa: E402


def held_tick_cost(root: Path, held: int) -> dict:
    wh = root / f"held-{held}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    b = Broker.init(wh, clock=clock)
    b.create_topic("t")
    spark = b.engine.spark
    t0 = clock.now_ms()
    half = held // 2
    p = b.producer("p")
    p.send_dataframe(
        spark.range(half).selectExpr("'t' AS topic", "CAST(id AS STRING) AS body", "18 AS delay_level")
    )
    p.send_dataframe(
        spark.range(held - half).selectExpr(
            "'t' AS topic",
            "CAST(id AS STRING) AS body",
            f"CAST({t0 + DAY} + (id * 2591) % {29 * DAY} AS BIGINT) AS deliver_at_ms",
        )
    )
    b.tick(t0)  # dispatch everything into the schedule queue and the timer index
    times = []
    for i in range(1, 6):
        start = time.perf_counter()
        r = b.tick(t0 + i * 1000)
        times.append(round(time.perf_counter() - start, 4))
        assert r.job("promote").rows_out == 0
    shutil.rmtree(wh, ignore_errors=True)
    return {"held": held, "idle_tick_s": times, "median_s": statistics.median(times)}


def _percentiles(values: list[float]) -> tuple[int | None, int | None, int | None]:
    """p50, p99 and max (None for no values: nothing reached the listener in the run)."""
    v = sorted(values)
    if not v:
        return None, None, None
    return round(v[len(v) // 2]), round(v[int(len(v) * 0.99)]), round(v[-1])


def lateness(
    root: Path,
    n: int = 10_000,
    wake: bool = True,
    *,
    spread_s: float = 60.0,
    interval_s: float = 1.0,
    run_s: float = 95.0,
    keep: bool = False,
) -> dict:
    """Timers due evenly across ``spread_s`` (from 20 s after sending), consumed by a push
    group with default settings while ``deltamq tick --loop --interval <interval_s>``
    runs in another process for ``run_s`` (waking at due times unless ``wake`` is
    False). Lateness is measured at the listener: the wall time it was called with a
    message minus the message's due time (``bench_listeners.record_due``). Also given:
    ``visible_*``, from the due time to the end of the tick that promoted it (the figure
    measured before the listener was).

    Returns ``lateness_ms_p50`` / ``_p99`` / ``_max`` (at the listener), ``visible_ms_*``,
    messages, delivered (distinct), duplicates, ticks and the median busy tick. ``keep``:
    leave the warehouse (``<root>/lateness``) and the listener's log for a look."""
    wh = root / "lateness"
    shutil.rmtree(wh, ignore_errors=True)
    log = root / "lateness-listener.log"
    for old in root.glob(f"{log.name}.*"):
        old.unlink()
    b = Broker.init(wh)
    b.create_topic("t")
    b.create_group("g", "bench_listeners:record_due", consume_from="FIRST_OFFSET")
    b.subscribe("g", "t")
    spark = b.engine.spark
    start = int(time.time() * 1000) + 20_000  # due from 20 s from now
    spread_ms = int(spread_s * 1000)
    due = f"CAST({start} + (id * {spread_ms}) DIV {n} AS BIGINT)"
    b.producer("p").send_dataframe(
        spark.range(n).selectExpr(
            "'t' AS topic",
            "CAST(id AS STRING) AS body",
            f"{due} AS deliver_at_ms",
            f"map('{bench_listeners.DUE_PROP}', CAST({due} AS STRING)) AS properties",
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env[bench_listeners.DUE_LOG_ENV] = str(log)  # (a Spark server's workers: set when it started)
    loop = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltamq.cli",
            "tick",
            "--loop",
            "--interval",
            str(interval_s),
            "--for",
            str(run_s),
            *([] if wake else ["--no-wake"]),
            "--warehouse",
            str(wh),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert loop.returncode == 0, loop.stderr[-2000:]
    calls: dict[str, float] = {}
    late: list[float] = []
    for part in root.glob(f"{log.name}.*"):
        for line in part.read_text().splitlines():
            wall, due_ms, msg_id = line.split()
            late.append(float(wall) - int(due_ms))
            calls[msg_id] = calls.get(msg_id, 0) + 1
    runs = b.sql("SELECT tick_id, now_ts, job, rows_out, end_ts FROM job_runs ORDER BY now_ts").collect()
    ticks: dict[str, dict] = {}
    for r in runs:
        t = ticks.setdefault(r["tick_id"], {"now": r["now_ts"], "visible": r["end_ts"], "promoted": 0})
        t["visible"] = max(t["visible"], r["end_ts"])
        if r["job"] == "promote":
            t["promoted"] = r["rows_out"]
    ordered = sorted(ticks.values(), key=lambda t: t["now"])
    visible = []
    j = 0
    for d in (start + (i * spread_ms) // n for i in range(n)):  # the first tick whose now reached d
        while j < len(ordered) and ordered[j]["now"] < d:
            j += 1
        if j < len(ordered):
            visible.append(ordered[j]["visible"] - d)
    tick_s = [(t["visible"] - t["now"]) / 1000 for t in ordered if t["promoted"]]
    if not keep:
        shutil.rmtree(wh, ignore_errors=True)
    p50, p99, worst = _percentiles(late)
    v50, v99, vmax = _percentiles(visible)
    return {
        "messages": n,
        "wake_at_due": wake,
        "delivered": len(calls),
        "duplicates": sum(c - 1 for c in calls.values()),
        "promoted": sum(t["promoted"] for t in ordered),
        "ticks": len(ordered),
        "lateness_ms_p50": p50,
        "lateness_ms_p99": p99,
        "lateness_ms_max": worst,
        "visible_ms_p50": v50,
        "visible_ms_p99": v99,
        "visible_ms_max": vmax,
        "visible_missing": n - len(visible),  # due after the run's last tick: not in visible_*
        "busy_tick_s_median": round(statistics.median(tick_s), 3) if tick_s else None,
    }


def lateness_both(root: Path, n: int = 10_000) -> dict:
    """:func:`lateness` of the default loop (waking at due times) and of the interval-only
    loop (``--no-wake``), one after the other."""
    return {"wake_at_due": lateness(root, n, wake=True), "interval_only": lateness(root, n, wake=False)}


def ahead(root: Path, values: list[int], n: int, spread_s: float, rounds: int, engine: str) -> None:
    """Timer lateness at the listener for each ``promote_ahead_ms`` in ``values``
    (``DELTAMQ_PROMOTE_AHEAD_MS`` for the tick loop), alternated for ``rounds``; on
    ``engine="spark"`` against Apache Spark's Connect server with Delta (bench/run.py
    starts it, local[2]). Writes ``results/promote-ahead-<stamp>.json``."""
    import run

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc: dict = {
        "bench": "bench_promote.ahead",
        "engine": engine,
        "messages": n,
        "spread_s": spread_s,
        "runs": [],
    }
    server = None
    if engine == "spark":
        # the listener runs in the server's Python workers: where it writes is set first
        os.environ[bench_listeners.DUE_LOG_ENV] = str(root / "lateness-listener.log")
        server = run._start_spark_server(root)
    try:
        for r in range(rounds):
            for ms in values:
                os.environ["DELTAMQ_PROMOTE_AHEAD_MS"] = str(ms)
                row = {"round": r, "promote_ahead_ms": ms} | lateness(root, n, spread_s=spread_s)
                print(json.dumps(row), flush=True)
                doc["runs"].append(row)
    finally:
        os.environ.pop("DELTAMQ_PROMOTE_AHEAD_MS", None)
        if server is not None:
            server.terminate()
            server.wait()
        (HERE / "results" / f"promote-ahead-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--lateness", type=int, default=100_000)
    ap.add_argument("--lateness-only", action="store_true", help="only lateness, waking and interval-only")
    ap.add_argument(
        "--ahead-ms",
        type=int,
        nargs="+",
        help="only lateness (--lateness timers across --spread-s), once per promote_ahead_ms given, in turn",
    )
    ap.add_argument("--spread-s", type=float, default=20.0, help="with --ahead-ms: seconds the timers span")
    ap.add_argument("--rounds", type=int, default=2, help="with --ahead-ms: rounds of the values in turn")
    ap.add_argument("--engine", choices=("embedded", "spark"), default="embedded", help="with --ahead-ms")
    ap.add_argument("--dir", default="/tmp/deltamq-bench-promote")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    if args.ahead_ms:
        ahead(root, args.ahead_ms, args.lateness, args.spread_s, args.rounds, args.engine)
        return
    if args.lateness_only:
        both = lateness_both(root, args.lateness)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        doc = {
            "bench": "bench_promote.lateness",
            "measured_at": "listener",
            "messages": args.lateness,
            "spread_s": 60,
            "interval_s": 1,
        } | both
        (HERE / "results" / f"lateness-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(doc, indent=2))
        return
    small = held_tick_cost(root, args.small)
    print(json.dumps(small), flush=True)
    big = held_tick_cost(root, args.held)
    print(json.dumps(big), flush=True)
    late = lateness(root, args.lateness)
    print(json.dumps(late), flush=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {
        "benchmark": "promote",
        "when": stamp,
        "idle_tick": {
            "small": small,
            "big": big,
            "ratio_big_vs_small": round(big["median_s"] / small["median_s"], 3),
        },
        "lateness": late,
    }
    (HERE / "results" / f"promote-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["idle_tick"]["ratio_big_vs_small"]))


if __name__ == "__main__":
    main()
