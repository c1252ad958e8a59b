"""Benchmark: transaction check-back resolved by a table check.

N pending half messages (1 KiB bodies, one ``send_dataframe_in_transaction`` commit,
never ended by the producer) and a Delta table of N local transaction states
(40 % PAID → COMMIT, 30 % CANCELLED → ROLLBACK, 30 % PENDING → UNKNOWN). One check
pass (``check_transactions.run``) must settle all of them: COMMITs stored in the real
topic with their op records, ROLLBACKs as op records, UNKNOWNs written again at the end
of the half queue. Then dispatch, and a second pass one interval later over what is
left (only the UNKNOWN copies).

Writes bench/results/check-<timestamp>.json. A benchmark, not a test.

    python bench/bench_check.py [--messages 100000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

from deltamq import Broker, FakeClock
from deltamq.jobs import check_transactions, dispatch

HERE = Path(__file__).parent


def run(root: Path, n: int) -> dict:
    wh = root / f"check-{n}"
    shutil.rmtree(wh, ignore_errors=True)
    clock = FakeClock()
    b = Broker.init(wh, clock=clock)
    b.create_topic("orders", queues=4)
    spark = b.engine.spark
    state_path = str(root / f"check-state-{n}")
    shutil.rmtree(state_path, ignore_errors=True)
    spark.range(n).selectExpr(
        "concat('o', CAST(id AS STRING)) AS order_id",
        "CASE WHEN id % 10 < 4 THEN 'PAID' WHEN id % 10 < 7 THEN 'CANCELLED' ELSE 'PENDING' END AS status",
    ).write.format("delta").save(state_path)
    b.check_with_table(
        "shop",
        state_path,
        "order_id",
        "CASE WHEN status = 'PAID' THEN 'COMMIT' WHEN status = 'CANCELLED' THEN 'ROLLBACK' END",
    )
    t0 = time.perf_counter()
    b.producer("shop").send_dataframe_in_transaction(
        spark.range(n).selectExpr(
            "'orders' AS topic",
            "CAST(repeat(sha2(CAST(id AS STRING), 256), 16) AS BINARY) AS body",
            "map('order_id', concat('o', CAST(id AS STRING))) AS properties",
        )
    )
    send_s = time.perf_counter() - t0
    now = clock.now_ms() + 10_000
    t0 = time.perf_counter()
    dispatch.run(b.context, now)
    dispatch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = check_transactions.run(b.context, now)
    pass_s = time.perf_counter() - t0
    assert first.ran and first.counts["check"] == n, first
    t0 = time.perf_counter()
    dispatch.run(b.context, now)
    redispatch_s = time.perf_counter() - t0
    visible = b.sql("SELECT count(*) AS n FROM consume_queue WHERE topic = 'orders'").collect()[0]["n"]
    t0 = time.perf_counter()
    second = check_transactions.run(b.context, now + 60_000)
    second_s = time.perf_counter() - t0
    shutil.rmtree(wh, ignore_errors=True)
    shutil.rmtree(state_path, ignore_errors=True)
    return {
        "messages": n,
        "send_half_s": round(send_s, 3),
        "dispatch_s": round(dispatch_s, 3),
        "first_pass_s": round(pass_s, 3),
        "first_pass_msgs_per_s": round(n / pass_s),
        "first_pass_answers": first.answers,
        "first_pass_rows_written": first.written,
        "redispatch_s": round(redispatch_s, 3),
        "committed_visible": visible,
        "second_pass_s": round(second_s, 3),
        "second_pass_counts": second.counts,
        "second_pass_answers": second.answers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--root", default="/tmp/deltamq-bench")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    result = {"bench": "check", "at": datetime.now(UTC).isoformat(), "runs": [run(root, args.messages)]}
    out = HERE / "results" / f"check-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
