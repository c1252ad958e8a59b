"""``deltamq demo``: the order-timeout story on a fresh warehouse, with a fast clock.

An online shop stores every new order in topic ``orders`` and, at the same time,
schedules a payment check 30 minutes later (delay level 16) in topic
``order-timeout``: "cancel unpaid orders after 30 minutes". A fake clock runs the
half hour in a few ticks; the tables show where each message went.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING

from deltamq.cli.format import ms_to_iso, print_table
from deltamq.clock import FakeClock
from deltamq.constants import Prop
from deltamq.errors import ConfigError
from deltamq.message import Message
from deltamq.storage import normalize_location

if TYPE_CHECKING:
    from deltamq.broker import Broker

START = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)


def demo(args: argparse.Namespace) -> int:
    """``deltamq demo`` (no broker to open: the demo makes its own warehouse)."""
    run_demo(args.warehouse)
    return 0


def _say(text: str = "") -> None:
    print(text, flush=True)


def _show(broker: Broker, title: str, query: str) -> None:
    _say(f"\n-- {title}\n   {query}")
    df = broker.sql(query)
    print_table(df.columns, [list(r) for r in df.collect()])


def _said(log_path: str, seen: int) -> int:
    """Print what the listeners did since the last call; returns how many lines were read."""
    try:
        with open(log_path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return seen
    for line in lines[seen:]:
        e = json.loads(line)
        retry = f" (retry {e['reconsume']})" if e["reconsume"] else ""
        _say(f"{'':25}  {e['group']}: {e['order']} — {e['action']}{retry}")
    return len(lines)


def _describe(result) -> str:
    if not any(r.rows_out for r in result.jobs):
        return "idle: nothing new, nothing due (only the job_runs append was committed)"
    parts = []
    for run in result.jobs:
        if run.job == "dispatch" and run.rows_out:
            routes = ", ".join(
                f"{k[6:]}={v}" for k, v in sorted(run.details.items()) if k.startswith("route_")
            )
            parts.append(f"dispatch indexed {run.rows_out} ({routes})")
        elif run.job == "promote" and run.rows_out:
            indexed = " and indexed them" if run.details.get("indexed") else ""
            parts.append(f"promote re-stored {run.rows_out} due message(s) in their real topic{indexed}")
        elif run.job == "redispatch":
            parts.append(f"dispatch indexed those {run.rows_out} in the same tick")
        elif run.job == "check_transactions" and run.details.get("check"):
            d = run.details
            parts.append(
                f"check-back asked about {d['check']} half message(s) older than 6 s: "
                f"{d.get('answer_commit', 0)} COMMIT, {d.get('answer_rollback', 0)} ROLLBACK, "
                f"{d.get('answer_unknown', 0)} UNKNOWN"
            )
        elif run.job in ("deliver", "redeliver") and run.rows_in:
            d = run.details
            parts.append(
                f"deliver handed {d['taken'] - d['filtered']} to listeners ({d['consumed']} consumed, "
                f"{d['retried']} sent back to %RETRY%, {d['filtered']} skipped by tag)"
            )
    return "; ".join(parts)


def _refunds(broker: Broker, clock: FakeClock, location: str, log_path: str, seen: int) -> int:
    """Transactional messages: a refund notice becomes visible only if the refund was
    recorded; a table check answers for the refunds the producer could not confirm."""
    state = os.path.join(location, "refund_state")
    broker.engine.spark.createDataFrame(
        [("order-1", "DONE"), ("order-4", "REJECTED")], "order_id string, status string"
    ).write.format("delta").mode("overwrite").save(state)
    broker.check_with_table(
        "refunds",
        state,
        "order_id",
        "CASE WHEN status = 'DONE' THEN 'COMMIT' WHEN status = 'REJECTED' THEN 'ROLLBACK' END",
    )
    _say(
        "\nRefunds are transactional: a 'refunded' notice is a half message (invisible) until the "
        "refund is recorded.\nThe producer group 'refunds' answers check-back from the Delta table "
        "refund_state (one join per pass)."
    )
    refunds = broker.producer("refunds")
    for order in ("order-1", "order-4", "order-5"):
        answer = "COMMIT" if order == "order-5" else "UNKNOWN"  # the gateway timed out for 1 and 4
        refunds.send_in_transaction(
            Message(
                "orders",
                json.dumps({"order": order}),
                tags="refunded",
                keys=order,
                properties={"order_id": order},
            ),
            partial(_answer, answer),
        )
        _say(f"{ms_to_iso(clock.now_ms())}  refund of {order}: local transaction answered {answer}")
    for _ in range(3):
        result = broker.tick()
        _say(f"{ms_to_iso(result.now)}  tick: {_describe(result)}")
        seen = _said(log_path, seen)
        clock.advance(minutes=1)
    return seen


def _answer(answer: str, message: object, arg: object) -> str:
    """A local transaction that answers ``answer`` (the demo's payment gateway)."""
    return answer


def run_demo(warehouse: str | None = None) -> None:
    from deltamq.broker import Broker  # lazily: `deltamq --help` does not load the engine

    started = time.monotonic()
    location = warehouse or tempfile.mkdtemp(prefix="deltamq-demo-")
    location = normalize_location(location)  # absolute: the check table is a path under it
    clock = FakeClock(START)
    _say(f"deltamq demo — warehouse {location}")
    _say(
        "Story: every new order is stored in 'orders' and a payment check is scheduled "
        "30 minutes later\nin 'order-timeout' (delay level 16 = 30m). The clock is fake: "
        "an hour passes in six ticks.\n"
    )
    broker = Broker.init(location, clock=clock)
    try:  # a failed run gives its job leases back: the warehouse is not blocked after it
        used = sorted([*broker.topics(), *broker.groups()], key=lambda name: (name.startswith("%"), name))
        if used:
            raise ConfigError(
                f"the demo needs a new or empty warehouse; {location} already has topics or "
                f"groups {used[:6]}: give another --warehouse, or none (a new temporary one)"
            )
        log_path = _create_topics_and_groups(broker, location)
        shop = broker.producer("shop")
        _send_orders(shop, clock)
        seen = _the_hour(broker, shop, clock, log_path)
        seen = _refunds(broker, clock, location, log_path, seen)
        for title, query in QUERIES:
            _show(broker, title, query)
    finally:
        broker.close()
    _say(
        f"\ndone in {time.monotonic() - started:.1f}s. Query it yourself:\n"
        f'  deltamq sql "SELECT * FROM consume_queue" --warehouse {location}'
        + ("" if warehouse else f"\n(the warehouse stays until you delete it: rm -r {location})")
    )


def _create_topics_and_groups(broker: Broker, location: str) -> str:
    """The story's topics and groups; returns where the listeners log what they did."""
    broker.create_topic("orders", queues=4, exist_ok=True)
    broker.create_topic("order-timeout", queues=2, exist_ok=True)
    os.environ["DELTAMQ_DEMO_LOG"] = log_path = os.path.join(location, "listeners.jsonl")
    broker.create_group("billing", "deltamq.demo_listeners:billing", exist_ok=True)
    broker.subscribe("billing", "orders", "created || paid || refunded")
    broker.create_group("order-canceller", "deltamq.demo_listeners:cancel_unpaid", exist_ok=True)
    broker.subscribe("order-canceller", "order-timeout", "timeout")
    _say(
        "created topics 'orders' (4 queues) and 'order-timeout' (2 queues); groups 'billing' and "
        "'order-canceller'"
    )
    return log_path


def _send_orders(shop, clock: FakeClock) -> None:
    """Five orders, a payment check 30 minutes after each, and a report timer at 45."""
    orders = [f"order-{i}" for i in range(1, 6)]
    created = [
        Message("orders", json.dumps({"order": o, "amount": 10 * i}), tags="created", keys=o)
        for i, o in enumerate(orders, 1)
    ]
    shop.send_batch(created, queue_keys=orders)
    checks = [
        Message(
            "order-timeout",
            json.dumps({"order": o, "action": "cancel-if-unpaid"}),
            tags="timeout",
            keys=o,
            delay_level=16,
        )
        for o in orders
    ]
    shop.send_batch(checks, queue_keys=orders)
    reminder_at = clock.now_ms() + 45 * 60_000
    shop.send(
        Message(
            "order-timeout",
            json.dumps({"report": "daily unpaid summary"}),
            tags="report",
            properties={Prop.TIMER_DELIVER_MS: str(reminder_at)},
        )
    )
    _say(
        f"{ms_to_iso(clock.now_ms())}  sent 5 'created' orders (queue chosen by order id), 5 payment "
        f"checks at level 16,\n                         and a report timer due at {ms_to_iso(reminder_at)} "
        "(TIMER_DELIVER_MS)"
    )


def _the_hour(broker: Broker, shop, clock: FakeClock, log_path: str) -> int:
    """Six ticks ten minutes apart; order-2 is paid after the second. Returns the listener
    log lines read."""
    seen = 0
    for step in range(6):
        result = broker.tick()
        _say(f"{ms_to_iso(result.now)}  tick: {_describe(result)}")
        seen = _said(log_path, seen)
        clock.advance(minutes=10)
        if step == 1:
            shop.send(
                Message(
                    "orders", json.dumps({"order": "order-2", "paid": True}), tags="paid", keys="order-2"
                ),
                queue_key="order-2",
            )
            _say(f"{ms_to_iso(clock.now_ms())}  order-2 is paid: a 'paid' message joins order-2's queue")
    return seen


QUERIES = [
    (
        "where every message went (consume_queue: dense offsets per topic and queue)",
        "SELECT topic, queue_id, count(*) AS messages, min(queue_offset) AS first, "
        "max(queue_offset) AS last FROM consume_queue GROUP BY topic, queue_id ORDER BY topic, queue_id",
    ),
    (
        "payment checks: held at level 16 in SCHEDULE_TOPIC_XXXX, re-stored in 'order-timeout' when due",
        "SELECT s.keys AS order_id, s.queue_id + 1 AS level, from_unixtime(s.due_ts DIV 1000, 'HH:mm:ss') "
        "AS due, t.queue_id AS real_queue, t.queue_offset AS real_offset, "
        "from_unixtime(t.store_ts DIV 1000, 'HH:mm:ss') AS stored FROM consume_queue s "
        "JOIN consume_queue t ON t.properties['UNIQ_KEY'] = s.properties['UNIQ_KEY'] "
        "AND t.topic = 'order-timeout' WHERE s.topic = 'SCHEDULE_TOPIC_XXXX' AND s.queue_id = 15 "
        "ORDER BY s.queue_offset",
    ),
    (
        "the report timer: indexed by due time (rmq_sys_wheel_timer), due 09:45, stored again by the "
        "09:50 tick that promoted it",
        "SELECT t.tags, from_unixtime(w.due_ts DIV 1000, 'HH:mm:ss') AS due, "
        "from_unixtime(t.store_ts DIV 1000, 'HH:mm:ss') AS stored FROM consume_queue w "
        "JOIN consume_queue t ON t.properties['UNIQ_KEY'] = w.properties['UNIQ_KEY'] "
        "AND t.topic = 'order-timeout' WHERE w.topic = 'rmq_sys_wheel_timer'",
    ),
    (
        "order-3's check failed once: sent back to %RETRY%order-canceller at level 3 (10 s), stored "
        "there by the next tick, ten minutes on (the demo's ticks are ten minutes apart)",
        "SELECT topic, queue_id, queue_offset, reconsume_times, properties['RETRY_TOPIC'] AS retry_topic, "
        "from_unixtime(store_ts DIV 1000, 'HH:mm:ss') AS stored FROM consume_queue "
        "WHERE keys = 'order-3' AND topic LIKE '%order-canceller' ORDER BY store_ts",
    ),
    (
        "refunds: half messages (RMQ_SYS_TRANS_HALF_TOPIC) and how each ended (op log, tag d)",
        "SELECT h.keys AS order_id, h.queue_offset AS half_offset, o.properties['TRAN_STATE'] AS ended, "
        "o.properties['PGROUP'] AS producer_group FROM consume_queue h LEFT JOIN consume_queue o "
        "ON o.topic = 'RMQ_SYS_TRANS_OP_HALF_TOPIC' AND o.properties['TRAN_ID'] = h.properties['TRAN_ID'] "
        "WHERE h.topic = 'RMQ_SYS_TRANS_HALF_TOPIC' ORDER BY h.queue_offset",
    ),
    (
        "group offsets (what each group consumed, per queue)",
        "SELECT consumer_group, topic, queue_id, next_offset FROM offsets "
        "WHERE consumer_group NOT LIKE '\\%%' ORDER BY consumer_group, topic, queue_id",
    ),
    (
        "order-2's messages stay in one queue, in order",
        "SELECT queue_id, queue_offset, tags, keys FROM consume_queue "
        "WHERE topic = 'orders' AND keys = 'order-2' ORDER BY queue_offset",
    ),
    (
        "the ticks (job_runs: one append per tick, a row per job)",
        "SELECT from_unixtime(now_ts DIV 1000, 'HH:mm:ss') AS now, job, status, rows_out "
        "FROM job_runs WHERE rows_out > 0 ORDER BY now_ts, start_ts",
    ),
]
"""The tables the demo ends with: (title, query)."""
