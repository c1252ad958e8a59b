"""Benchmark: the schedule service and timers.

(a) Tick cost when nothing is due, with 1M held messages (half level-18 delays, half
    timers due in 1..30 days) vs. with 10k held. Flat is the goal.
(b) Lateness with the real clock: 100k timer messages due across one minute, the
    broker running ``deltamq tick --loop --interval 1`` in another process. Lateness =
    end of the tick that made a message visible in its real topic − its due time.

Writes bench/results/promote-<timestamp>.json. A benchmark, not a test.

    python bench/bench_promote.py [--held 1000000] [--lateness 100000]
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
DAY = 86_400_000


def held_tick_cost(root: Path, held: int) -> dict:
    wh = root / f"held-{held}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    b = Broker.open(wh, clock=clock)
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


def lateness(root: Path, n: int, wake: bool = True) -> dict:
    """Delayed messages due across a minute, `deltamq tick --loop --interval 1` (waking at
    due times unless ``wake`` is False): how late each became visible."""
    wh = root / "lateness"
    shutil.rmtree(wh, ignore_errors=True)
    b = Broker.open(wh)
    b.create_topic("t")
    spark = b.engine.spark
    start = int(time.time() * 1000) + 20_000  # due from 20 s from now, across one minute
    b.producer("p").send_dataframe(
        spark.range(n).selectExpr(
            "'t' AS topic",
            "CAST(id AS STRING) AS body",
            f"CAST({start} + (id * 60000) DIV {n} AS BIGINT) AS deliver_at_ms",
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    loop = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltamq.cli",
            "tick",
            "--loop",
            "--interval",
            "1",
            "--for",
            "95",
            *([] if wake else ["--no-wake"]),
            "--warehouse",
            str(wh),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert loop.returncode == 0, loop.stderr[-2000:]
    runs = b.sql("SELECT tick_id, now_ts, job, rows_out, end_ts FROM job_runs ORDER BY now_ts").collect()
    ticks: dict[str, dict] = {}
    for r in runs:
        t = ticks.setdefault(r["tick_id"], {"now": r["now_ts"], "visible": r["end_ts"], "promoted": 0})
        t["visible"] = max(t["visible"], r["end_ts"])
        if r["job"] == "promote":
            t["promoted"] = r["rows_out"]
    ordered = sorted(ticks.values(), key=lambda t: t["now"])
    promoted = sum(t["promoted"] for t in ordered)
    dues = [start + (i * 60000) // n for i in range(n)]
    late = []
    j = 0
    for d in dues:  # the first tick whose now reached d made it visible
        while ordered[j]["now"] < d:
            j += 1
        late.append(ordered[j]["visible"] - d)
    late.sort()
    tick_s = [(t["visible"] - t["now"]) / 1000 for t in ordered if t["promoted"]]
    shutil.rmtree(wh, ignore_errors=True)
    return {
        "messages": n,
        "promoted": promoted,
        "ticks": len(ordered),
        "lateness_ms_p50": late[len(late) // 2],
        "lateness_ms_p99": late[int(len(late) * 0.99)],
        "lateness_ms_max": late[-1],
        "busy_tick_s_median": statistics.median(tick_s) if tick_s else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", type=int, default=1_000_000)
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--lateness", type=int, default=100_000)
    ap.add_argument("--dir", default="/tmp/deltamq-bench-promote")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
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
