"""The partition function's output rows (deltamq/jobs/consume_partition.py) and their sum
(``deliver_outcomes.outcomes``): a listener that cannot be loaded leaves one row per
queue, not one per message."""

from __future__ import annotations

import pyarrow as pa
import pytest

from deltamq.constants import FailReason
from deltamq.jobs.consume_partition import outputs
from deltamq.jobs.deliver_outcomes import outcomes
from deltamq.jobs.listener_worker import Outcome
from deltamq.tables.offsets import QueueKey


def _taken(queues: list[int]) -> pa.Table:
    n = len(queues)
    return pa.table(
        {
            "consumer_group": ["g"] * n,
            "client_id": [""] * n,
            "topic": ["orders"] * n,
            "queue_id": pa.array(queues, pa.int32()),
            "queue_offset": pa.array([10 + i for i in range(n)], pa.int64()),
            "msg_id": [f"m{i}" for i in range(n)],
            "cl_date": pa.array([0] * n, pa.date32()),
            "cl_batch_id": pa.array([1] * n, pa.int64()),
            "cl_batch_pos": pa.array(range(n), pa.int64()),
            "reconsume_times": pa.array([0] * n, pa.int32()),
            "dkey": pa.nulls(n, pa.string()),
            "body": pa.array([b"x"] * n, pa.binary()),
        }
    )


@pytest.mark.unit
def test_a_listener_that_cannot_load_leaves_a_row_per_queue_held_with_why():
    table = _taken([0, 1, 0, 1, 0, 0])
    spans = [
        (0, 1, Outcome(True)),
        (1, 5, Outcome(False, reason=FailReason.SETUP, error="ListenerUnavailable: gone")),
    ]
    rows = pa.concat_tables(outputs(table, table, spans, 0, 6)).to_pylist()
    setup = [r for r in rows if r["kind"] == "setup"]
    assert sorted((r["queue_id"], r["queue_offset"], r["n"]) for r in setup) == [(0, 12, 3), (1, 11, 2)]
    assert {r["error"] for r in setup} == {"ListenerUnavailable: gone"}
    assert not [r for r in rows if r["kind"] == "fail"]
    consumed = outcomes(rows, 6)
    assert consumed.consumed == {"g": 1} and consumed.failures == ()
    assert dict(consumed.setup) == {
        QueueKey("g", "", "orders", 0): (12, 3, "ListenerUnavailable: gone"),
        QueueKey("g", "", "orders", 1): (11, 2, "ListenerUnavailable: gone"),
    }
    assert consumed.handed_over == 1 and consumed.body_bytes == 1  # what a listener dealt with
    with pytest.raises(RuntimeError, match="6 messages taken but 5 outcomes"):
        outcomes([r for r in rows if r["kind"] != "count"], 6)  # the consumed one missing
    with pytest.raises(RuntimeError, match="unknown kind 'later'"):
        outcomes([*rows, {**rows[0], "kind": "later"}], 6)
    # a SETUP failure row per message (an older partition function's way) sums up the same
    fail = pa.concat_tables(outputs(table, table, [(0, 6, Outcome(False, level=0, error="e"))], 0, 6))
    per_message = [{**r, "reason": FailReason.SETUP.value, "error": "gone"} for r in fail.to_pylist()]
    folded = outcomes(per_message, 6)
    assert folded.failures == () and folded.handed_over == 0
    assert dict(folded.setup) == {
        QueueKey("g", "", "orders", 0): (10, 4, "gone"),
        QueueKey("g", "", "orders", 1): (11, 2, "gone"),
    }
