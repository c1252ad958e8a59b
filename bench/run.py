"""The benchmark suite (issue 12): the end-to-end figure and the other targets, in one run.

- **End to end**: N messages (1 KiB incompressible bodies, 4 queues) sent with
  ``send_dataframe``, dispatched, and delivered to a trivial listener
  (``consume_message_batch_max_size`` 1000) — msgs/s over the three steps, each timed.
- **Parquet floor**: pyarrow writing the same commit_log rows as Parquet on the same
  disk; the end-to-end and send rates as a share of it.
- **Idle tick**: every job, nothing new — median and p95 of 20 ticks on that warehouse.
- **Peak memory** of the driver process (RSS).
- With ``--history``: tick cost with 1M vs 10M retained (``bench_dispatch_history``);
  with ``--lateness``: delay lateness p50/p99 under the real clock (``bench_promote``).

Targets (2 cores): end to end ≥ 200k msgs/s and ≥ 30 % of the Parquet floor; idle tick
≤ 0.3 s; 10M / 1M tick cost ≤ 1.2. Writes ``bench/results/run-<timestamp>.json`` and
the table between the ``run.py`` markers in bench/README.md. A benchmark, not a test.

    python bench/run.py [--messages 1000000] [--history] [--lateness]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from deltamq import Broker, FakeClock
from deltamq.jobs import deliver, dispatch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from bench_send_dispatch import body_expr  # noqa: E402

BEGIN, END = "<!-- run.py:begin -->", "<!-- run.py:end -->"


def end_to_end(root: Path, n: int) -> dict:
    wh = root / f"run-{n}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    b = Broker.open(wh, clock=clock)
    b.create_topic("bench", queues=4)
    b.create_group(
        "g",
        "bench_listeners:ok",
        consume_from="FIRST_OFFSET",
        pull_batch_size=n,
        consume_message_batch_max_size=1000,
    )
    b.subscribe("g", "bench")
    spark = b.engine.spark
    staging = root / f"staging-{n}"
    shutil.rmtree(staging, ignore_errors=True)
    spark.range(n).selectExpr("'bench' AS topic", f"{body_expr()} AS body").write.parquet(str(staging))
    t0 = time.perf_counter()
    b.producer("bench").send_dataframe(spark.read.parquet(str(staging)))
    t1 = time.perf_counter()
    d = dispatch.run(b.warehouse, clock.now_ms())
    t2 = time.perf_counter()
    r = deliver.run(b, clock.now_ms())
    t3 = time.perf_counter()
    assert d.rows_out == n and r.consumed == n, (d, r)
    table = pq.read_table(str(wh / "commit_log"))
    floor_path = root / f"floor-{n}.parquet"
    f0 = time.perf_counter()
    pq.write_table(table, str(floor_path), compression="snappy")
    floor_s = time.perf_counter() - f0
    floor_path.unlink(missing_ok=True)
    del table
    # idle ticks: every job, nothing new (the first tick after the pass warms the runner)
    clock.advance(seconds=1)
    b.tick(clock.now_ms())
    idle = []
    for _ in range(20):
        clock.advance(seconds=1)
        s0 = time.perf_counter()
        b.tick(clock.now_ms())
        idle.append(time.perf_counter() - s0)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(wh, ignore_errors=True)
    total = t3 - t0
    return {
        "messages": n,
        "send_s": round(t1 - t0, 2),
        "dispatch_s": round(t2 - t1, 2),
        "deliver_s": round(t3 - t2, 2),
        "end_to_end_s": round(total, 2),
        "end_to_end_msgs_per_s": round(n / total),
        "parquet_floor_s": round(floor_s, 2),
        "parquet_floor_msgs_per_s": round(n / floor_s),
        "end_to_end_vs_floor": round(floor_s / total, 3),
        "send_vs_floor": round(floor_s / (t1 - t0), 3),
        "idle_tick_median_s": round(statistics.median(idle), 3),
        "idle_tick_p95_s": round(sorted(idle)[int(len(idle) * 0.95) - 1], 3),
    }


def _table(result: dict) -> str:
    e = result["end_to_end"]
    rows = [
        (
            "end to end (send + dispatch + deliver, batch 1000)",
            f"{e['end_to_end_msgs_per_s']:,} msgs/s",
            "≥ 200 000",
        ),
        ("  send / dispatch / deliver", f"{e['send_s']} / {e['dispatch_s']} / {e['deliver_s']} s", ""),
        ("pyarrow Parquet floor, same rows", f"{e['parquet_floor_msgs_per_s']:,} msgs/s", ""),
        ("end to end vs floor", f"{e['end_to_end_vs_floor'] * 100:.0f} %", "≥ 30 %"),
        ("send vs floor", f"{e['send_vs_floor'] * 100:.0f} %", ""),
        ("idle tick, median / p95", f"{e['idle_tick_median_s']} / {e['idle_tick_p95_s']} s", "≤ 0.3 s"),
        ("peak driver RSS", f"{result['peak_rss_mib']:,} MiB", ""),
    ]
    if "history" in result:
        rows.append(("tick cost 10M / 1M retained", str(result["history"]), "≤ 1.2"))
    if "lateness" in result:
        lt = result["lateness"]
        rows.append(("delay lateness p50 / p99", f"{lt.get('p50_s')} / {lt.get('p99_s')} s", ""))
    lines = [
        f"`python bench/run.py --messages {e['messages']}` — {result['at'][:10]}, `results/{result['file']}`",
        "",
        "| measure | result | target |",
        "|---|---:|---:|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--history", action="store_true", help="also tick cost at 1M vs 10M retained (slow)")
    ap.add_argument("--lateness", action="store_true", help="also delay lateness under the real clock")
    ap.add_argument("--root", default="/tmp/deltamq-bench-run")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    result: dict = {"bench": "run", "at": datetime.now(UTC).isoformat(), "file": f"run-{stamp}.json"}
    result["end_to_end"] = end_to_end(root, args.messages)
    if args.lateness:
        import bench_promote

        result["lateness"] = bench_promote.lateness(root, 100_000)
    if args.history:
        import bench_dispatch_history

        bench_dispatch_history.main()  # writes results/dispatch_history-*.json
        result["history"] = "see the newest results/dispatch_history-*.json"
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    (HERE / "results" / result["file"]).write_text(json.dumps(result, indent=2) + "\n")
    readme = HERE / "README.md"
    text = readme.read_text()
    block = f"{BEGIN}\n{_table(result)}\n{END}"
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.replace("\n## ", f"\n## The suite — `run.py`\n\n{block}\n\n## ", 1)
    readme.write_text(text)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
