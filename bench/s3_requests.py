"""What a tick costs on object storage: requests counted by method and by what they touch.

Starts an S3 API server (moto) and, in front of it, the counting proxy of the tests
(tests/support/fault_proxy.py, with no faults); every client of deltamq goes through it
(the engine, delta-rs, the storage seam). On an s3:// warehouse with one topic (4 queues)
and one push group it counts

- an idle tick (``--idle`` ticks, per tick), after two warm-up ticks;
- a send of 100 messages (one ``send_batch``) and the tick that dispatches and
  delivers them.

Writes bench/results/s3-requests-<timestamp>.json and prints the tables.

    python bench/s3_requests.py [--idle 10] [--root /tmp/dmq-s3-requests]
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


def measure(root: Path, idle: int) -> dict:
    from conftest import S3_BUCKET
    from s3_emulator import s3_behind_proxy

    with s3_behind_proxy(root) as (options, counter):
        clock = FakeClock()
        location = f"s3://{S3_BUCKET}/requests-{int(time.time())}/wh"
        broker = Broker.init(location, clock=clock, config=BrokerConfig(storage_options=options))
        try:
            broker.create_topic("orders", queues=4)
            broker.create_group("billing", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
            broker.subscribe("billing", "orders")
            os.environ["DELTAMQ_TEST_LOG"] = str(root / "billing.jsonl")
            for _ in range(2):  # warm up: the first ticks create progress rows
                clock.advance(seconds=1)
                broker.tick()
            counter.set(reset_counters=True)
            started = time.perf_counter()
            for _ in range(idle):
                clock.advance(seconds=1)
                broker.tick()
            idle_s = (time.perf_counter() - started) / idle
            idle_counts = counter.state()["counts"]
            counter.set(reset_counters=True)
            broker.producer("shop").send_batch([Message("orders", f"m{i}".encode()) for i in range(100)])
            sent_counts = counter.state()["counts"]
            counter.set(reset_counters=True)
            clock.advance(seconds=1)
            result = broker.tick()
            tick_counts = counter.state()["counts"]
            delivered = result.delivered.consumed if result.delivered else 0
        finally:
            broker.close()
    per_tick = {k: round(v / idle, 1) for k, v in sorted(idle_counts.items())}
    return {
        "idle_ticks": idle,
        "idle_tick_s": round(idle_s, 3),
        "idle_per_tick": per_tick,
        "idle_per_tick_total": round(sum(idle_counts.values()) / idle, 1),
        "send_100": dict(sorted(sent_counts.items())),
        "send_100_total": sum(sent_counts.values()),
        "tick_after_100": dict(sorted(tick_counts.items())),
        "tick_after_100_total": sum(tick_counts.values()),
        "delivered_in_that_tick": delivered,
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
    ap.add_argument("--root", default="/tmp/dmq-s3-requests", help="scratch folder")
    args = ap.parse_args()
    figures = measure(Path(args.root), args.idle)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = HERE / "results" / f"s3-requests-{stamp}.json"
    out.write_text(json.dumps({"when": stamp, **figures}, indent=2) + "\n")
    print(f"idle tick: {figures['idle_per_tick_total']} requests ({_by_method(figures['idle_per_tick'])})")
    for what, n in figures["idle_per_tick"].items():
        print(f"  {what:<28} {n}")
    print(f"send of 100: {figures['send_100_total']} requests ({_by_method(figures['send_100'])})")
    print(
        f"tick after it ({figures['delivered_in_that_tick']} delivered): {figures['tick_after_100_total']} "
        f"requests ({_by_method(figures['tick_after_100'])})"
    )
    for what, n in figures["tick_after_100"].items():
        print(f"  {what:<28} {n}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
