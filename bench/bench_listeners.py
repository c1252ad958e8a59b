"""Trivial listeners for the benchmarks (importable by the listener workers)."""

import os
import time

from deltamq.consumer import ConsumeStatus, columnar

DUE_LOG_ENV = "DELTAMQ_BENCH_DUE_LOG"
DUE_PROP = "due_ms"


def ok(messages, context):
    return ConsumeStatus.CONSUME_SUCCESS


def fail_ten_percent(messages, context):
    """Fails one call in ten (chunk number ending in 7, counted by the first message's
    offset): 10 % of the messages with one per call, ~10 % of the chunks with 32."""
    if (messages[0].queue_offset // len(messages)) % 10 == 7:
        return ConsumeStatus.RECONSUME_LATER
    return ConsumeStatus.CONSUME_SUCCESS


def record_due(messages, context):
    """Records, per message, the wall time of this call and the message's due time: one
    line ``<wall ms> <due ms> <msg id>`` in ``$DELTAMQ_BENCH_DUE_LOG.<pid>`` (one file per
    listener worker). The due time is the ``due_ms`` property the sender set, else the
    store time (a copy promoted ahead is stored at its due time)."""
    wall = time.time() * 1000.0
    lines = "".join(f"{wall:.1f} {m.properties.get(DUE_PROP, m.store_ts)} {m.msg_id}\n" for m in messages)
    with open(f"{os.environ[DUE_LOG_ENV]}.{os.getpid()}", "a", encoding="utf-8") as fh:
        fh.write(lines)
    return ConsumeStatus.CONSUME_SUCCESS


@columnar
def ok_columnar(batch, context):
    """The trivial listener, columnar: gets each chunk as one pyarrow RecordBatch."""
    return ConsumeStatus.CONSUME_SUCCESS


def hang(messages, context):
    """A dependency that is down: every call hangs (past any consume timeout)."""
    time.sleep(3600)
