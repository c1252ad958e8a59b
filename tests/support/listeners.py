"""Listeners for the tests. Importable without PySpark: worker processes load them.

Every listener records what it was handed as JSON lines, so tests can assert on the
calls made in worker processes.
"""

from __future__ import annotations

import json
import os
import time

from deltamq.constants import Prop, TxState
from deltamq.consumer import ConsumeOrderlyStatus, ConsumeStatus, columnar


def read_log(path) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        return []


class Recorder:
    """A picklable listener: records each call, then behaves as ``behavior`` says."""

    def __init__(self, log_path, behavior: str = "ok") -> None:
        self.log_path = str(log_path)
        self.behavior = behavior

    def __call__(self, messages, context):
        with open(self.log_path, "a", encoding="utf-8") as fh:
            for m in messages:
                fh.write(
                    json.dumps(
                        {
                            "id": m.msg_id,
                            "topic": m.topic,
                            "body": m.body.decode("utf-8", "replace"),
                            "reconsume": m.reconsume_times,
                            "batch": len(messages),
                            "queue_id": m.queue_id,
                            "props": m.properties,
                            "run": os.environ.get("DELTAMQ_TEST_RUN"),
                            "instance": context.instance,
                        }
                    )
                    + "\n"
                )
        return getattr(self, "_" + self.behavior)(messages, context)

    def _ok(self, messages, context):
        return ConsumeStatus.CONSUME_SUCCESS

    def _fail(self, messages, context):
        return ConsumeStatus.RECONSUME_LATER

    def _suspend_bad_twice(self, messages, context):
        from deltamq.consumer import ConsumeOrderlyStatus

        if any(m.body.startswith(b"bad") and m.reconsume_times < 2 for m in messages):
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return ConsumeOrderlyStatus.SUCCESS

    def _suspend_bad(self, messages, context):
        from deltamq.consumer import ConsumeOrderlyStatus

        if any(m.body.startswith(b"bad") for m in messages):
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return ConsumeOrderlyStatus.SUCCESS

    def _fail_on_b(self, messages, context):
        if context.instance == "b":
            raise RuntimeError("instance b cannot handle it")
        return ConsumeStatus.CONSUME_SUCCESS

    def _fail_first_try_of_bad(self, messages, context):
        """Fails a batch holding a message whose body starts with ``bad`` on its first try."""
        if any(m.body.startswith(b"bad") and m.reconsume_times == 0 for m in messages):
            return ConsumeStatus.RECONSUME_LATER
        return ConsumeStatus.CONSUME_SUCCESS

    def _fail_twice(self, messages, context):
        return (
            ConsumeStatus.RECONSUME_LATER
            if messages[0].reconsume_times < 2
            else ConsumeStatus.CONSUME_SUCCESS
        )

    def _fail_while_broken(self, messages, context):
        """Fails while ``<log>.broken`` exists (an outage an operator then fixes)."""
        if os.path.exists(self.log_path + ".broken"):
            return ConsumeStatus.RECONSUME_LATER
        return ConsumeStatus.CONSUME_SUCCESS

    def _ack_first(self, messages, context):
        context.ack_index = 0
        return ConsumeStatus.CONSUME_SUCCESS

    def _ack_first_numpy(self, messages, context):
        import numpy as np

        context.ack_index = np.int64(0)  # what a columnar computation hands back
        return ConsumeStatus.CONSUME_SUCCESS

    def _bad_level(self, messages, context):
        context.delay_level_when_next_consume = "3"  # a string: not a level
        return ConsumeStatus.RECONSUME_LATER

    def _ack_first_float(self, messages, context):
        context.ack_index = 0.0
        return ConsumeStatus.CONSUME_SUCCESS

    def _none(self, messages, context):
        return None

    def _raise(self, messages, context):
        raise ValueError(f"cannot handle {messages[0].body!r}")

    def _raise_long(self, messages, context):
        """Fails at once with an error of 4 000 characters of 3 bytes each in UTF-8."""
        raise ValueError("订单" * 2000)

    def _garbage(self, messages, context):
        return {"status": "maybe"}

    def _level_from_body(self, messages, context):
        context.delay_level_when_next_consume = int(messages[0].body)
        return ConsumeStatus.RECONSUME_LATER

    def _exit_on_any(self, messages, context):
        """Its worker dies on a batch holding a message whose body is ``exit``."""
        if any(m.body == b"exit" for m in messages):
            os._exit(3)
        return ConsumeStatus.CONSUME_SUCCESS

    def _unavailable(self, messages, context):
        """As a listener whose code cannot be loaded says so (deltamq.errors)."""
        from deltamq.errors import ListenerUnavailable

        raise ListenerUnavailable("listener 'gone:fn' cannot be imported: No module named 'gone'")

    def _read_stdin(self, messages, context):
        """Reads what it can from stdin (a worker's stdin is empty to its listener)."""
        import sys

        if sys.stdin.buffer.read(1 << 16):
            raise RuntimeError("the listener read bytes from its worker's stdin")
        return ConsumeStatus.CONSUME_SUCCESS

    def _hostile(self, messages, context):
        body = messages[0].body
        if body == b"exit":
            os._exit(3)
        if body == b"sleep":
            time.sleep(30)
        return ConsumeStatus.CONSUME_SUCCESS


def env_recorder(messages, context):
    """Import-path listener for subprocess jobs: logs to $DELTAMQ_TEST_LOG, always succeeds."""
    return Recorder(os.environ["DELTAMQ_TEST_LOG"], "ok")(messages, context)


def env_fail_odd(messages, context):
    """Fails messages whose body ends in an odd digit on their first delivery."""
    Recorder(os.environ["DELTAMQ_TEST_LOG"], "ok")(messages, context)
    m = messages[0]
    if m.reconsume_times == 0 and m.body[-1:] in b"13579":
        return ConsumeStatus.RECONSUME_LATER
    return ConsumeStatus.CONSUME_SUCCESS


def check_by_body(message):
    """A transaction check listener (import path ``support.listeners:check_by_body``): the body
    names the state."""
    return message.body.decode()


def order_rows(df):
    """Sink transform: the message key is the order id, the body its amount."""
    from pyspark.sql import functions as F

    return df.select(
        F.col("keys").alias("order_id"),
        F.col("body").cast("string").cast("long").alias("amount"),
        "msg_id",
        "_deltamq_order",
    )


def order_rows_refusing_poison(df):
    """Sink transform: :func:`order_rows`, failing when it runs over an order keyed
    ``poison`` (an error the engine raises while the sink's MERGE runs)."""
    from pyspark.sql import functions as F

    rows = order_rows(df)
    poison = F.raise_error(F.lit("order 'poison' cannot be written"))
    return rows.withColumn("amount", F.when(F.col("order_id") == "poison", poison).otherwise(F.col("amount")))


def order_rows_without_guard(df):
    return order_rows(df).drop("_deltamq_order")


def always_fail(messages, context):
    """Import-path listener: never succeeds (dead letters on demand)."""
    return ConsumeStatus.RECONSUME_LATER


class Checks:
    """A check listener that records each call and answers from a script."""

    def __init__(self, answers=None, default=TxState.UNKNOWN):
        self.calls: list[tuple[str, str]] = []  # (tran id, TRANSACTION_CHECK_TIMES)
        self.answers = dict(answers or {})
        self.default = default

    def __call__(self, message):
        tran = message.properties[Prop.TRAN_ID]
        self.calls.append((tran, message.properties.get(Prop.TRANSACTION_CHECK_TIMES)))
        answer = self.answers.get(message.body.decode(), self.default)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def count(self, tran: str) -> int:
        return sum(1 for t, _ in self.calls if t == tran)


def _odd_first_time(messages) -> bool:
    return any(m.reconsume_times == 0 and m.body[-1:] in b"13579" for m in messages)


def fail_odd_once(messages, context):
    """Import-path listener: a batch holding a message whose body ends in an odd digit
    fails on its first delivery, then succeeds."""
    return ConsumeStatus.RECONSUME_LATER if _odd_first_time(messages) else ConsumeStatus.CONSUME_SUCCESS


def suspend_marked_once(messages, context):
    """Orderly import-path listener: suspends the queue once for a body ending in
    ``-suspend`` (a suspended queue waits for the next tick: such bodies are rare)."""
    if any(m.reconsume_times == 0 and m.body.endswith(b"-suspend") for m in messages):
        return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
    return ConsumeOrderlyStatus.SUCCESS


def check_by_prefix(message):
    """Check listener: the body starts with the state (``COMMIT:...``)."""
    return message.body.decode().split(":", 1)[0]


class EnvEcho:
    """Records the value of one environment variable as the listener's process sees it."""

    def __init__(self, log_path, name: str) -> None:
        self.log_path, self.name = str(log_path), name

    def __call__(self, messages, context):
        with open(self.log_path, "a", encoding="utf-8") as fh:
            for m in messages:
                fh.write(json.dumps({"body": m.body.decode(), "value": os.environ.get(self.name)}) + "\n")
        return ConsumeStatus.CONSUME_SUCCESS


@columnar
def columnar_fail_from_marker(batch, context):
    """A columnar listener: logs what it got to $DELTAMQ_TEST_LOG; on a first delivery
    acknowledges the rows before the first body ``fail`` (``ack_index``), later all."""
    bodies = [b.decode() for b in batch.column("body").to_pylist()]
    retries = batch.column("reconsume_times").to_pylist()
    with open(os.environ["DELTAMQ_TEST_LOG"], "a", encoding="utf-8") as fh:
        fh.write(
            json.dumps({"type": type(batch).__name__, "columns": batch.schema.names, "bodies": bodies}) + "\n"
        )
    if "fail" in bodies and retries[bodies.index("fail")] == 0:
        context.ack_index = bodies.index("fail") - 1
    return ConsumeStatus.CONSUME_SUCCESS


def consume_all(messages, context):
    """Import-path listener that consumes everything (the tick results count it)."""
    return ConsumeStatus.CONSUME_SUCCESS


def ledger_rows(df):
    """Sink transform (``support.listeners:ledger_rows``): one row per entry, keyed by the
    message key; the body is the amount. A replayed entry must not add a row."""
    from pyspark.sql import functions as F

    return df.select(
        F.col("keys").alias("entry"),
        F.col("body").cast("string").cast("long").alias("amount"),
        "_deltamq_order",
    )
