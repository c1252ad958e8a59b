"""The benchmark suite (issue 12): the end-to-end figure and the other targets, in one run.

- **End to end**: N messages (1 KiB incompressible bodies, 4 queues) sent with
  ``send_dataframe``, dispatched, and delivered to a trivial listener
  (``consume_message_batch_max_size`` 1000) — msgs/s over the three steps, each timed.
- **Parquet floor**: pyarrow writing the same commit_log rows as Parquet on the same
  disk; the end-to-end and send rates as a share of it.
- **Idle tick**: every job, nothing new — median and p95 of 20 ticks on that warehouse.
- **Peak memory** of the driver process (RSS).
- **Tick cost vs history** (``--history``): one warehouse grown to 1M and then 10M
  retained messages (1M-message steps, each sent, dispatched and consumed by a tick);
  at both sizes the median of ticks that each carry 1 000 new messages (send + tick:
  dispatch, promote, deliver, check, retain) and of idle ticks. The ratio is the
  10M / 1M cost.
- **Delay lateness** (``--lateness``): 100k delayed messages due across one minute,
  ``deltamq tick --loop --interval 1`` on the real clock; p50/p99 of (visible − due)
  (``bench_promote.lateness``).

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

from deltamq import Broker, FakeClock, Message
from deltamq.jobs import deliver, dispatch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from bench_send_dispatch import body_expr  # noqa: E402

BEGIN, END = "<!-- run.py:begin -->", "<!-- run.py:end -->"


def _setup(root: Path, name: str, n: int) -> tuple[Path, FakeClock, Broker, Path]:
    """A warehouse with topic ``bench`` (4 queues) and group ``g`` (a trivial listener, batch
    1000, taking up to ``n`` per queue), and ``n`` rows of 1 KiB bodies staged as Parquet."""
    wh = root / name
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
    staging = root / f"{name}-staging"
    shutil.rmtree(staging, ignore_errors=True)
    b.engine.spark.range(n).selectExpr("'bench' AS topic", f"{body_expr()} AS body").write.parquet(
        str(staging)
    )
    return wh, clock, b, staging


def end_to_end(root: Path, n: int) -> dict:
    wh, clock, b, staging = _setup(root, f"run-{n}", n)
    spark = b.engine.spark
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
    shutil.rmtree(wh, ignore_errors=True)
    small, big = points[0], points[-1]
    return {
        "busy_messages_per_tick": busy,
        "points": points,
        "busy_ratio": round(big["busy_median_s"] / small["busy_median_s"], 3),
        "idle_ratio": round(big["idle_median_s"] / small["idle_median_s"], 3),
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
        *(
            [("peak Sail server RSS (its own process)", f"{result['peak_server_rss_mib']:,} MiB", "")]
            if result.get("peak_server_rss_mib")
            else []
        ),
    ]
    if "history" in result:
        h = result["history"]
        small, big = h["points"][0], h["points"][-1]
        rows.append(
            (
                f"tick with {h['busy_messages_per_tick']:,} new messages at {small['retained']:,} / "
                f"{big['retained']:,} retained",
                f"{small['busy_median_s']} / {big['busy_median_s']} s (× {h['busy_ratio']})",
                "≤ 1.2 ×",
            )
        )
        rows.append(
            (
                f"idle tick at {small['retained']:,} / {big['retained']:,} retained",
                f"{small['idle_median_s']} / {big['idle_median_s']} s (× {h['idle_ratio']})",
                "≤ 1.2 ×",
            )
        )
    if "lateness" in result:
        lt = result["lateness"]
        rows.append(
            (
                f"delay lateness p50 / p99 ({lt['messages']:,} due across a minute, 1 s ticks)",
                f"{lt['lateness_ms_p50'] / 1000:.2f} / {lt['lateness_ms_p99'] / 1000:.2f} s",
                "",
            )
        )
    args = result.get("args") or f"--messages {e['messages']}"
    lines = [
        f"`python bench/run.py {args}` — {result['at'][:10]}, `results/{result['file']}`",
        "",
        "| measure | result | target |",
        "|---|---:|---:|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
    ]
    return "\n".join(lines)


def peak_server_rss_mib() -> int:
    """The embedded Sail server's peak resident memory: it runs in a child process, so
    stop it and read the children's peak (getrusage counts waited-for children)."""
    from deltamq.engine import Engine

    Engine.shutdown_embedded()
    return round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--history", action="store_true", help="also tick cost at 1M vs 10M retained (slow)")
    ap.add_argument("--history-step", type=int, default=1_000_000, help="messages per growth step")
    ap.add_argument("--history-steps", type=int, default=10, help="growth steps (10: 1M → 10M)")
    ap.add_argument("--lateness", action="store_true", help="also delay lateness under the real clock")
    ap.add_argument("--root", default="/tmp/deltamq-bench-run")
    args = ap.parse_args()
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
    if args.lateness:
        import bench_promote

        result["lateness"] = bench_promote.lateness(root, 100_000)
    if args.history:
        result["history"] = history(root, args.history_step, args.history_steps)
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result["peak_server_rss_mib"] = peak_server_rss_mib()
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
