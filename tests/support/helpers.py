"""Shared test helpers, in the manner of PySpark's ``pyspark.testing`` utilities: a
warehouse with a topic and a recorded consumer group, and the SQL the engine ran inside a
``with`` block. conftest.py builds the ``warehouse_with`` fixture on :class:`WarehouseSetup`;
tests import :func:`recorded_sql` from here. (Crash helpers live in crash.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from deltamq import Broker
from deltamq.engine import SQL_RECORDERS
from support.listeners import Recorder


@dataclass
class WarehouseSetup:
    """A test's warehouse with one topic, as the ``warehouse_with`` fixture gives it.

    ``log`` is where the :class:`listeners.Recorder` listeners of groups added here write
    their calls (JSON lines; read them with ``listeners.read_log``); ``group`` names the
    group the fixture created, if it was asked for one.
    """

    broker: Broker
    topic: str
    log: Path
    group: str | None = None

    def add_group(
        self,
        recorder: str | None = "ok",
        *,
        name: str = "g",
        expression: str = "*",
        consume_from: str = "FIRST_OFFSET",
        **options,
    ) -> Path:
        """Create consumer group ``name`` and subscribe it to the topic (``expression``, a
        tag expression). ``recorder`` is the behaviour of its ``Recorder(log, recorder)``
        listener (``"ok"``, ``"fail"``, ``"fail_twice"``, ...; listeners.py), or None for
        a group without a listener (pulled, or read by a sink). Further ``options`` go to
        ``Broker.create_group``. Returns the log the listener writes to."""
        listener = Recorder(self.log, recorder) if recorder is not None else None
        self.broker.create_group(name, listener, consume_from=consume_from, **options)
        self.broker.subscribe(name, self.topic, expression)
        return self.log


@contextmanager
def recorded_sql() -> Iterator[list[str]]:
    """The SQL statements the engine of this process runs inside the block, in order.

    Built on the hook the Spark guard's session-wide recorder uses
    (``deltamq.engine.SQL_RECORDERS``: every statement passes ``Engine.sql``); statements
    run in other processes (subprocess jobs, listener workers) are not seen::

        with recorded_sql() as statements:
            broker.tick()
        assert any(s.startswith("MERGE INTO") for s in statements)
    """
    statements: list[str] = []
    hook = statements.append
    SQL_RECORDERS.append(hook)
    try:
        yield statements
    finally:
        SQL_RECORDERS.remove(hook)


def hint_matches_the_index(broker: Broker, why: object = None) -> None:
    """Dispatch's hint (``%DISPATCH%`` rows) names every queue's next offset as the index
    has it (``why``: what the assertion message says, e.g. a crash round)."""
    heads = {
        (r["topic"], r["queue_id"]): r["next_offset"]
        for r in broker.sql(
            "SELECT topic, queue_id, next_offset FROM offsets WHERE consumer_group = '%DISPATCH%' "
            "AND queue_id >= 0"
        ).collect()
    }
    counts = {
        (r["topic"], r["queue_id"]): r["n"]
        for r in broker.sql(
            "SELECT topic, queue_id, count(*) AS n FROM consume_queue GROUP BY 1, 2"
        ).collect()
    }
    assert heads == counts, why


def append_half_with_delay(broker: Broker, t0: int) -> None:
    """Append a half message carrying DELAY (as no producer would: its schedule entry's
    real topic is the half topic, which promote skips, as RocketMQ does)."""
    from deltamq import ids
    from deltamq.constants import TRANS_HALF_TOPIC, Prop
    from deltamq.sending import rows_to_arrow

    batch = ids.new_batch_id(t0)
    row = {
        "msg_id": ids.msg_id(batch, 0),
        "topic": TRANS_HALF_TOPIC,
        "queue_id": 0,
        "tags": None,
        "keys": None,
        "body": b"h",
        "flag": 0,
        "properties": {Prop.DELAY: "1"},
        "born_ts": t0,
        "store_ts": t0,
        "reconsume_times": 0,
        "sys_flag": 0,
        "producer_group": "p",
        "batch_id": batch,
        "batch_pos": 0,
        "store_date": ids.store_date(t0),
    }
    broker.append_commit_log(rows_to_arrow([row]), what="test")
