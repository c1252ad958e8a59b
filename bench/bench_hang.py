"""A deliver pass whose listener hangs on every call, through the engine: the pass's
time and how much the driver's memory grew (what comes back of the messages the
timed-out listener left untried). Writes ``bench/results/hang-<timestamp>.json``. A
benchmark, not a test."""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # bench_listeners, for the listener workers

from deltamq import Broker  # noqa: E402
from deltamq.clock import FakeClock  # noqa: E402
from deltamq.jobs import deliver, dispatch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--root", default="/tmp/deltamq-bench-hang")
    ap.add_argument("--orderly", action="store_true", help="an orderly group (the rest waits in order)")
    args = ap.parse_args()
    wh = Path(args.root) / f"wh-{args.messages}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock(1_767_225_600_000)
    b = Broker.init(str(wh), clock=clock)
    b.create_topic("orders", queues=4)
    b.create_group(
        "g",
        "bench_listeners:hang",
        consume_from="FIRST_OFFSET",
        consume_timeout_ms=1000,
        consume_message_batch_max_size=32,
        orderly=args.orderly,
    )
    b.subscribe("g", "orders", "a IS NULL", "SQL92")  # a SQL92 filter: the engine's pass
    n = args.messages
    b.producer("p").send_arrow(pa.table({"topic": ["orders"] * n, "body": [b"x" * 100] * n}))
    dispatch.run(b.context, clock.now_ms())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    r = deliver.run(b.context, clock.now_ms())
    seconds = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {
        "bench": "hang",
        "at": datetime.now(UTC).isoformat(),
        "messages": n,
        "orderly": args.orderly,
        "taken": r.taken,
        "handed_over": r.handed_over,
        "retried": r.retried,
        "deliver_s": round(seconds, 2),
        "driver_peak_rss_growth_mb": round((rss1 - rss0) / 1024),
    }
    print(json.dumps(row))
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    (HERE / "results" / f"hang-{stamp}.json").write_text(json.dumps(row, indent=2) + "\n")
    shutil.rmtree(wh, ignore_errors=True)


if __name__ == "__main__":
    main()
