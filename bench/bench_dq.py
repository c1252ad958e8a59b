"""Benchmark: the data-quality run (every Great Expectations suite plus the conservation
check) on a warehouse of N messages.

N messages (1 KiB bodies) in 4 queues, sent with ``send_dataframe`` and dispatched, plus
1 % of N delayed (level 3) and 1 % as timers an hour out, held. Two push-less groups
subscribe: ``audit`` with its offsets moved to the end (everything passed: consumed) and
``billing`` at the start (everything pending). Then ``broker.check_quality()`` runs once
to warm up (Great Expectations import, first plans) and again, timed per part: the
table suites (``commit_log``, ``consume_queue`` with its derived frames, the rest) and
the conservation check.

Writes bench/results/dq-<timestamp>.json. A benchmark, not a test.

    python bench/bench_dq.py [--messages 1000000]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

from run import peak_server_rss_mib, watch_server

from deltamq import Broker, FakeClock
from deltamq.dq import suites

HERE = Path(__file__).parent


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return round(time.perf_counter() - t0, 2), out


def run(root: Path, n: int) -> dict:
    watch_server()  # this run's peak (peak_server_rss_mib below ends it)
    wh = root / f"dq-{n}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    b = Broker.init(wh, clock=clock)
    b.create_topic("orders", queues=4)
    spark = b.engine.spark
    body = "CAST(repeat(sha2(CAST(id AS STRING), 256), 16) AS BINARY) AS body"
    p = b.producer("shop")
    p.send_dataframe(spark.range(n).selectExpr("'orders' AS topic", body))
    p.send_dataframe(spark.range(n // 100).selectExpr("'orders' AS topic", body, "3 AS delay_level"))
    p.send_dataframe(
        spark.range(n // 100).selectExpr(
            "'orders' AS topic", body, f"CAST({clock.now_ms() + 3_600_000} AS BIGINT) AS deliver_at_ms"
        )
    )
    b.tick(clock.now_ms())
    b.create_group("audit")  # LAST_OFFSET: starts at the end, everything passed
    b.subscribe("audit", "orders")
    b.create_group("billing", consume_from="FIRST_OFFSET")
    b.subscribe("billing", "orders")
    warm_s, _ = _timed(lambda: suites.run(b.context, record=False))
    parts = {}
    for name, tables in (
        ("commit_log", ["commit_log"]),
        ("consume_queue", ["consume_queue"]),
        ("other tables", [t for t in suites.KEYS if t not in ("commit_log", "consume_queue")]),
        ("conservation", ["conservation"]),
    ):
        parts[name], _ = _timed(lambda t=tables: suites.run(b.context, tables=t, record=False))
    total_s, result = _timed(lambda: b.check_quality())
    out = {
        "messages": n,
        "held": 2 * (n // 100),
        "expectations": len(result.results),
        "success": result.success,
        "first_run_s": warm_s,
        "run_s": total_s,
        "parts_s": parts,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "peak_server_rss_mib": peak_server_rss_mib(),
    }
    shutil.rmtree(wh, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--root", default="/tmp/deltamq-bench")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    runs = [run(root, n) for n in args.messages]
    result = {"bench": "dq", "at": datetime.now(UTC).isoformat(), "runs": runs}
    out = HERE / "results" / f"dq-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
