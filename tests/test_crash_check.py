"""The check-back job killed at every commit point and at random times: every transaction
reaches its real topic at most once, and each one its table says is committed, exactly once."""

from __future__ import annotations

import pytest
from support.crash import CrashRounds

from deltamq.jobs import dispatch

# subprocess-heavy: the slow tier (pytest -m slow)
pytestmark = pytest.mark.slow

POINTS = [
    "check.after_start_commit",
    "check.before_output_commit",
    "check.after_output_commit",
    "check.after_progress_commit",
]
PER_ROUND = 30
STATUS = ["PAID", "CANCELLED", "PENDING"]


def test_check_transactions_survives_kills(broker, clock, tmp_path, spark):
    broker.create_topic("orders", queues=2)
    table = str(tmp_path / "order_state")
    crashes = CrashRounds(
        tmp_path / "wh", POINTS, seed=8, delay=(0.0, 1.5), each=1, random_rounds=4, want=7, most_random=12
    )
    producer = broker.producer("shop")
    orders: dict[str, int] = {}  # order id -> round it was sent in
    expected: set[str] = set()
    state_written = False
    for round_no, (point, _) in enumerate(crashes):
        new = {f"r{round_no}o{i}": round_no for i in range(PER_ROUND)}
        orders |= new
        # the local state: this round's orders by i % 3; last round's PENDING are now PAID
        states = [
            (o, "PAID" if r < round_no and _first(o) == "PENDING" else _first(o)) for o, r in orders.items()
        ]
        spark.createDataFrame(states, "order_id string, status string").write.format("delta").mode(
            "overwrite"
        ).save(table)
        if not state_written:
            broker.check_with_table(
                "shop",
                table,
                "order_id",
                "CASE WHEN status = 'PAID' THEN 'COMMIT' WHEN status = 'CANCELLED' THEN 'ROLLBACK' END",
            )
            state_written = True
        expected |= {o for o, s in states if s == "PAID"}
        df = spark.createDataFrame(
            [("orders", o, {"order_id": o}) for o in new],
            "topic string, body string, properties map<string,string>",
        )
        producer.send_dataframe_in_transaction(df)
        dispatch.run(broker.context, clock.now_ms())
        clock.advance(seconds=61)
        now = clock.now_ms()
        crashes.kill_and_rerun("check_transactions", now, point)
        dispatch.run(broker.context, now)
        real = broker.sql(
            "SELECT CAST(body AS STRING) AS body, count(*) AS n FROM consume_queue c JOIN commit_log l "
            "ON l.msg_id = c.msg_id WHERE c.topic = 'orders' GROUP BY 1"
        ).collect()
        assert all(r["n"] == 1 for r in real), [r for r in real if r["n"] > 1]
        assert {r["body"] for r in real} == expected, (round_no, point)
    assert crashes.kills >= 7


def _first(order: str) -> str:
    """The status an order has in the round it is sent in."""
    return STATUS[int(order.split("o")[1]) % 3]
