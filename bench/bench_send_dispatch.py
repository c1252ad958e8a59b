"""Benchmark: bulk send (send_dataframe) and dispatch throughput, against pyarrow's floor.

For N in (100k, 1M) 1 KiB incompressible messages over 4 queues:
  1. generate the rows with Spark into a staging Parquet file (not timed);
  2. time ``producer.send_dataframe`` reading that file (one commit_log append);
  3. time one ``dispatch`` run indexing them into consume_queue;
  4. time pyarrow writing the same commit_log rows as one Parquet file on the same
     disk (the physical floor: no engine, no Delta log).
Writes bench/results/send_dispatch-<timestamp>.json. A benchmark, not a test.

    python bench/bench_send_dispatch.py [--sizes 100000 1000000] [--dir /tmp/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from deltamq import Broker
from deltamq.jobs import dispatch

HERE = Path(__file__).parent


def body_expr(n_digests: int = 32) -> str:
    """1 KiB of incompressible bytes per row: 32 SHA-256 digests of (id, i)."""
    parts = ", ".join(f"sha2(concat(CAST(id AS STRING), '-{i}'), 256)" for i in range(n_digests))
    return f"unhex(concat({parts}))"


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_size(root: Path, n: int) -> dict:
    wh_dir = root / f"wh-{n}"
    shutil.rmtree(wh_dir, ignore_errors=True)
    broker = Broker.init(wh_dir)
    broker.create_topic("bench", queues=4)
    spark = broker.engine.spark
    staging = root / f"staging-{n}"
    shutil.rmtree(staging, ignore_errors=True)
    spark.range(n).selectExpr("'bench' AS topic", f"{body_expr()} AS body").write.parquet(str(staging))

    t0 = time.perf_counter()
    broker.producer("bench").send_dataframe(spark.read.parquet(str(staging)))
    send_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = dispatch.run(broker.context, broker.clock.now_ms())
    dispatch_s = time.perf_counter() - t0
    assert result.rows_out == n, result

    # the floor: pyarrow writing the same commit_log rows as Parquet on the same disk
    table = pq.read_table(str(wh_dir / "commit_log"))
    assert table.num_rows == n
    floor_path = root / f"floor-{n}.parquet"
    t0 = time.perf_counter()
    pq.write_table(table, str(floor_path), compression="snappy")
    floor_s = time.perf_counter() - t0
    out = {
        "messages": n,
        "body_bytes": 1024,
        "send_s": round(send_s, 3),
        "send_msgs_per_s": round(n / send_s),
        "dispatch_s": round(dispatch_s, 3),
        "dispatch_msgs_per_s": round(n / dispatch_s),
        "send_plus_dispatch_msgs_per_s": round(n / (send_s + dispatch_s)),
        "pyarrow_parquet_s": round(floor_s, 3),
        "pyarrow_msgs_per_s": round(n / floor_s),
        "send_vs_pyarrow": round(floor_s / send_s, 3),
        "commit_log_bytes": du(wh_dir / "commit_log"),
        "consume_queue_bytes": du(wh_dir / "consume_queue"),
    }
    shutil.rmtree(staging, ignore_errors=True)
    floor_path.unlink(missing_ok=True)
    shutil.rmtree(wh_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--dir", default="/tmp/deltamq-bench")
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for n in args.sizes:
        r = run_size(root, n)
        print(json.dumps(r), flush=True)
        results.append(r)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {
        "benchmark": "send_dispatch",
        "when": stamp,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "results": results,
    }
    path = HERE / "results" / f"send_dispatch-{stamp}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
