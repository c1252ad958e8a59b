"""Benchmark: does dispatch cost follow new rows, not history?

Grows consume_queue to 10M indexed messages, 1M at a time, and after each step times
a dispatch of 100 new messages (3 runs). Flat is the goal. Writes
bench/results/dispatch_history-<timestamp>.json. A benchmark, not a test.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from deltamq import Broker, Message
from deltamq.jobs import dispatch

HERE = Path(__file__).parent


def main(steps: int = 10, step_rows: int = 1_000_000, root: str = "/tmp/deltamq-bench-history") -> None:
    shutil.rmtree(root, ignore_errors=True)
    b = Broker.init(root)
    b.create_topic("t")
    p = b.producer("p")
    spark = b.engine.spark

    def small() -> float:
        p.send_batch([Message("t", b"x")] * 100)
        t = time.perf_counter()
        dispatch.run(b.context, 0)
        return time.perf_counter() - t

    points = [{"indexed_rows": 0, "dispatch_100_s": [round(small(), 4) for _ in range(3)]}]
    for k in range(steps):
        p.send_dataframe(spark.range(step_rows).selectExpr("'t' AS topic", "CAST(id AS STRING) AS body"))
        dispatch.run(b.context, 0)
        rows = (k + 1) * step_rows + len(points) * 300
        points.append({"indexed_rows": rows, "dispatch_100_s": [round(small(), 4) for _ in range(3)]})
        print(json.dumps(points[-1]), flush=True)
    first = statistics.median(points[0]["dispatch_100_s"])
    last = statistics.median(points[-1]["dispatch_100_s"])
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {
        "benchmark": "dispatch_history",
        "when": stamp,
        "points": points,
        "median_ratio_last_vs_empty": round(last / first, 3),
    }
    (HERE / "results" / f"dispatch_history-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
