"""What a tick costs on object storage: requests counted by method and by what they touch.

Starts an S3 API server (moto) and, in front of it, the counting proxy of the tests
(tests/support/fault_proxy.py, with no faults); every client of deltamq goes through it
(the engine, delta-rs, the storage seam). On an s3:// warehouse with one topic (4 queues)
and one push group it counts

- an idle tick (``--idle`` ticks, per tick), once the runner is quiet (its ticks skip
  their jobs: orchestration/tick.py), and the same with ``skip_idle_ticks=False``;
- a send of 100 messages (one ``send_batch``) by the Spark producer and by the
  Spark-free one, and the tick that dispatches and delivers each (``--busy`` rounds of
  each, the ticks' requests averaged);
- a pull + ack of 100 by the Spark-free pull client and by the broker's (each after a
  first cycle that loads its snapshots and takes its locks).

Writes bench/results/s3-requests-<timestamp>.json and prints the tables.

    python bench/s3_requests.py [--idle 10] [--busy 5] [--root /tmp/dmq-s3-requests]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from deltamq import Broker, BrokerConfig, FakeClock, Message  # noqa: E402


def measure(root: Path, idle: int, busy: int = 5) -> dict:
    from conftest import S3_BUCKET
    from s3_emulator import s3_behind_proxy

    from deltamq.lite import Producer, PullConsumer

    with s3_behind_proxy(root) as (options, counter):
        clock = FakeClock()
        location = f"s3://{S3_BUCKET}/requests-{int(time.time())}/wh"
        config = BrokerConfig(storage_options=options)
        broker = Broker.init(location, clock=clock, config=config)

        tables: list[dict[str, int]] = []  # per counted action: requests by method, table, kind

        def counted(action) -> tuple[dict[str, int], float, object]:
            counter.set(reset_counters=True)
            started = time.perf_counter()
            out = action()
            state = counter.state()
            tables.append(state["by_table"])
            return state["counts"], time.perf_counter() - started, out

        def ticks(n: int) -> list:
            out = []
            for _ in range(n):
                clock.advance(seconds=1)
                out.append(broker.tick())
            return out

        try:
            broker.create_topic("orders", queues=4)
            broker.create_group("billing", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
            broker.subscribe("billing", "orders")
            os.environ["DELTAMQ_TEST_LOG"] = str(root / "billing.jsonl")
            ticks(3)  # warm up: the first ticks create progress rows; then the runner is quiet
            quiet, quiet_s, quiet_ticks = counted(lambda: ticks(idle))
            broker.reconfigure(skip_idle_ticks=False)
            full, full_s, _ = counted(lambda: ticks(idle))
            broker.reconfigure(skip_idle_ticks=True)
            ticks(3)

            def rounds(send) -> tuple[dict[str, int], list[dict[str, int]], list]:
                """``busy`` rounds of a send of 100 and the tick after it: the first send's
                requests, each tick's, and the ticks' results. One tick can meet a table's
                checkpoint (every tenth version of a table rewritten by delta-rs MERGEs),
                which reads that table's log since the last one: rounds average it."""
                first_send: dict[str, int] = {}
                each, results, by_table = [], [], []
                for _ in range(busy):
                    sent, _, _ = counted(send)
                    first_send = first_send or sent
                    tick, _, out = counted(lambda: ticks(1))
                    each.append(tick)
                    by_table.append(tables[-1])
                    results += out
                    ticks(2)  # the runner quiet again before the next send
                return first_send, each, results, by_table

            spark_send, spark_ticks, results, spark_tables = rounds(
                lambda: broker.producer("shop").send_batch(
                    [Message("orders", f"m{i}".encode()) for i in range(100)]
                )
            )
            lite = Producer(location, "lite-shop", config=config)
            lite.send(Message("orders", b"warm-up"))  # opens the table once
            ticks(3)
            lite_send, lite_ticks, lite_results, lite_tables = rounds(
                lambda: lite.send_batch([Message("orders", f"l{i}".encode()) for i in range(100)])
            )
            # pull + ack of 100: the Spark-free client and the broker's, each in its group
            for group in ("pullers", "pullers-spark"):
                broker.create_group(group, consume_from="FIRST_OFFSET")
                broker.subscribe(group, "orders")
            ticks(1)
            clients = {
                "lite": PullConsumer(location, "pullers", "p1", config=config, clock=clock),
                "spark": broker.pull_consumer("pullers-spark", "p1"),
            }

            def cycle(client):
                got = client.pull(100)
                client.ack([m.receipt_handle for m in got])
                return len(got)

            pulls = {}
            for kind, client in clients.items():
                cycle(client)  # the first: snapshots loaded, locks taken
                counts, _, n = counted(lambda c=client: cycle(c))
                pulls[kind] = (counts, n)
        finally:
            broker.close()

    def delivered(rs: list) -> int:
        return sum(r.delivered.consumed for r in rs if r.delivered)

    def per_tick(counts: dict[str, int], n: int = idle) -> dict[str, float]:
        return {k: round(v / n, 1) for k, v in sorted(counts.items())}

    def mean(each: list[dict[str, int]]) -> dict[str, float]:
        summed: dict[str, int] = {}
        for counts in each:
            for k, v in counts.items():
                summed[k] = summed.get(k, 0) + v
        return per_tick(summed, len(each))

    return {
        "idle_ticks": idle,
        "idle_skipped": sum(r.idle for r in quiet_ticks),
        "idle_tick_s": round(quiet_s / idle, 4),
        "idle_per_tick": per_tick(quiet),
        "idle_per_tick_total": round(sum(quiet.values()) / idle, 1),
        "idle_full_tick_s": round(full_s / idle, 3),
        "idle_full_per_tick": per_tick(full),
        "idle_full_per_tick_total": round(sum(full.values()) / idle, 1),
        "send_100": dict(sorted(spark_send.items())),
        "send_100_total": sum(spark_send.values()),
        "busy_rounds": busy,
        "tick_after_100": mean(spark_ticks),
        "tick_after_100_total": round(sum(sum(t.values()) for t in spark_ticks) / busy, 1),
        "tick_after_100_each": [sum(t.values()) for t in spark_ticks],
        "tick_after_100_by_table": mean(spark_tables),
        "delivered_in_that_tick": delivered(results) / busy,
        "lite_send_100": dict(sorted(lite_send.items())),
        "lite_send_100_total": sum(lite_send.values()),
        "tick_after_lite_100": mean(lite_ticks),
        "tick_after_lite_100_total": round(sum(sum(t.values()) for t in lite_ticks) / busy, 1),
        "tick_after_lite_100_each": [sum(t.values()) for t in lite_ticks],
        "tick_after_lite_100_by_table": mean(lite_tables),
        "delivered_in_the_lite_tick": delivered(lite_results) / busy,
        **{f"pull_ack_100_{kind}": dict(sorted(counts.items())) for kind, (counts, _) in pulls.items()},
        **{f"pull_ack_100_{kind}_total": sum(counts.values()) for kind, (counts, _) in pulls.items()},
        **{f"pulled_{kind}": n for kind, (_, n) in pulls.items()},
    }


def _by_method(counts: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for what, n in counts.items():
        method = what.split(" ", 1)[0]
        out[method] = round(out.get(method, 0) + n, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=10, help="idle ticks to count (per tick averaged)")
    ap.add_argument("--busy", type=int, default=5, help="rounds of send + tick per producer (averaged)")
    ap.add_argument("--root", default="/tmp/dmq-s3-requests", help="scratch folder")
    args = ap.parse_args()
    figures = measure(Path(args.root), args.idle, args.busy)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = HERE / "results" / f"s3-requests-{stamp}.json"
    out.write_text(json.dumps({"when": stamp, **figures}, indent=2) + "\n")
    print(
        f"idle tick, quiet runner: {figures['idle_per_tick_total']} requests "
        f"({_by_method(figures['idle_per_tick'])}; "
        f"{figures['idle_skipped']} of {figures['idle_ticks']} skipped)"
    )
    print(
        f"idle tick, every job run (skip_idle_ticks=False): {figures['idle_full_per_tick_total']} requests "
        f"({_by_method(figures['idle_full_per_tick'])})"
    )
    for what, n in figures["idle_full_per_tick"].items():
        print(f"  {what:<28} {n}")
    print(
        f"send of 100 (Spark producer): {figures['send_100_total']} requests "
        f"({_by_method(figures['send_100'])})"
    )
    print(
        f"tick after it ({figures['delivered_in_that_tick']} delivered): {figures['tick_after_100_total']} "
        f"requests ({_by_method(figures['tick_after_100'])}; mean of {figures['busy_rounds']}: "
        f"{figures['tick_after_100_each']})"
    )
    for what, n in figures["tick_after_100"].items():
        print(f"  {what:<28} {n}")
    print("  by table:")
    for what, n in sorted(figures["tick_after_100_by_table"].items(), key=lambda kv: -kv[1]):
        print(f"    {what:<44} {n}")
    print(
        f"send of 100 (Spark-free producer): {figures['lite_send_100_total']} requests "
        f"({_by_method(figures['lite_send_100'])}); "
        f"the tick after it: {figures['tick_after_lite_100_total']} "
        f"({figures['delivered_in_the_lite_tick']} delivered; mean of {figures['tick_after_lite_100_each']})"
    )
    for kind in ("lite", "spark"):
        methods = _by_method(figures[f"pull_ack_100_{kind}"])
        total = figures[f"pull_ack_100_{kind}_total"]
        print(f"pull + ack of {figures[f'pulled_{kind}']} ({kind} client): {total} requests ({methods})")
        for what, n in figures[f"pull_ack_100_{kind}"].items():
            print(f"  {what:<28} {n}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
