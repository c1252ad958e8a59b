"""The deliveries log summed up per queue (``pull_log.summarise``, in Arrow) agrees with the
rule written out row by row, and with the engine's statement over the same rows."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from deltamq.constants import ACKED, EXPIRED, INFLIGHT, NACK_REQUESTED, NACKED, PASSED, REVOKED, TAKEN
from deltamq.pull_log import LogRow, QueueLog, log_table, sum_up, summarise

STATES = (
    INFLIGHT,
    INFLIGHT,
    INFLIGHT,
    ACKED,
    ACKED,
    NACKED,
    EXPIRED,
    REVOKED,
    NACK_REQUESTED,
    TAKEN,
    PASSED,
    None,
)


def random_log(seed: int, handles: int = 300) -> list[LogRow]:
    """Rows of ``handles`` deliveries over two groups and three queues, each handle 1-3
    rows in random states (a TAKEN mark, revocations, nacks requested among them)."""
    rnd = random.Random(seed)
    rows = []
    for h in range(handles):
        group, queue = rnd.choice(("g1", "g2")), rnd.choice((("t", 0), ("t", 1), ("u", 0)))
        offset, ts = rnd.randrange(0, 500), rnd.randrange(1_000, 2_000)
        for k in range(rnd.randint(1, 3)):
            state = rnd.choice(STATES)
            invisible = ts + rnd.randrange(100, 5_000) if state == INFLIGHT and rnd.random() < 0.9 else None
            at = offset + (k if rnd.random() < 0.1 else 0)  # now and then a row of another offset
            rows.append((group, f"c{h % 3}", *queue, at, f"m{h}", f"h{h}", ts + k, invisible, state))
    rnd.shuffle(rows)
    return rows


def by_rule(rows: list[LogRow]) -> dict[tuple[str, str, int], QueueLog]:
    """The rule written out a handle at a time (what the engine's statement groups)."""
    handles: dict[tuple, list[LogRow]] = defaultdict(list)
    for r in rows:
        handles[(r[0], r[2], r[3], r[6])].append(r)
    out = []
    for (group, topic, qid, _), rs in handles.items():
        states = {r[9] for r in rs}
        dues = [r[8] if r[9] == INFLIGHT else r[7] for r in rs if r[9] in (INFLIGHT, NACK_REQUESTED)]
        dues = [d for d in dues if d is not None]
        if TAKEN in states:
            cls = "T"
        elif REVOKED in states:
            cls = "R"
        elif states <= {ACKED, NACKED, EXPIRED}:
            cls = "O"  # an orphan: an end of a handout the log does not hold
        elif states & {ACKED, NACKED, EXPIRED, REVOKED}:
            cls = "D"
        elif NACK_REQUESTED in states:
            cls = "N"
        elif INFLIGHT in states:
            cls = "I"
        else:
            cls = "D"
        off = min(r[4] for r in rs)
        out.append(
            {"consumer_group": group, "topic": topic, "queue_id": qid, "ts": min(r[7] for r in rs),
             "cls": cls, "lo": off, "hi": off, "due": min(dues) if dues else None}
        )  # fmt: skip
    return sum_up(out)


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(40))
def test_summarise_agrees_with_the_rule(seed):
    rows = random_log(seed)
    assert summarise(log_table(rows)) == by_rule(rows)


@pytest.mark.unit
def test_orphan_acks_beside_a_takeover_count_for_nothing_on_their_own_queue():
    """A TAKEN mark on one queue (its summary joins the takeovers back per handle) and acks
    of handouts the log does not hold on another: the orphans stay on their queue and move
    nothing there, as the rule says (the join's row order once mixed the two up)."""
    rows = [("g", "c", "t", 0, 0, "mt", "ht", 1_000, None, TAKEN)]
    for h in range(50):
        rows.append(("g", "c", "t", 0, h, f"m{h}", f"a{h}", 1_001 + h, 9_000, INFLIGHT))
        rows.append(("g", "c", "t", 0, h, f"m{h}", f"a{h}", 1_001 + h, None, ACKED))
        rows.append(("g", "c", "t", 1, h, f"n{h}", f"o{h}", 900 + h, None, ACKED))  # orphans
    random.Random(3).shuffle(rows)
    got = summarise(log_table(rows))
    assert got == by_rule(rows)
    assert got[("g", "t", 1)].last is None and got[("g", "t", 0)].last == 49


@pytest.mark.unit
def test_summarise_of_no_rows_and_of_one_handle():
    assert summarise(log_table([])) == {}
    row = ("g", "c", "t", 0, 7, "m", "h", 1_000, 5_000, INFLIGHT)
    assert summarise(log_table([row])) == {("g", "t", 0): QueueLog(None, 7, 5_000, 7, None, 7, 1_000)}
    ended = (*row[:8], None, ACKED)
    assert summarise(log_table([row, ended])) == {
        ("g", "t", 0): QueueLog(None, None, None, 7, None, 7, 1_000)
    }
    orphan = (*ended[:4], 9, "m9", "h9", 1_001, None, ACKED)  # an ack of a handout not in the log
    assert summarise(log_table([row, ended, orphan])) == {
        ("g", "t", 0): QueueLog(None, None, None, 7, None, 7, 1_001)
    }


def test_summarise_agrees_with_the_engine(broker):
    from deltamq.tables import deliveries

    rows = random_log(7, handles=400)
    wh = broker.warehouse
    wh.append_arrow("deliveries", log_table(rows))
    for group in ("g1", "g2"):
        mine = [r for r in rows if r[0] == group]
        assert deliveries._summary_by_engine(wh, group, None) == summarise(log_table(mine)), group


@pytest.mark.unit
def test_map_dicts_reads_every_kind_of_map_row():
    """A map column as dicts (``message.map_dicts``): nulls, empty maps, one entry, several,
    sliced arrays and several chunks, as ``to_pylist`` would give them."""
    import pyarrow as pa

    from deltamq.message import map_dicts

    arr = pa.array(
        [[("a", "1")], None, [], [("b", "2"), ("c", "3")], [("d", None)]], pa.map_(pa.string(), pa.string())
    )
    column = pa.chunked_array([arr, arr.slice(1, 3), arr.slice(0, 0), arr.slice(3)])
    assert map_dicts(column) == [dict(x or ()) for x in column.to_pylist()]
    assert map_dicts(arr.slice(2)) == [{}, {"b": "2", "c": "3"}, {"d": None}]
    # as many entries as rows, but not one each (an empty map beside a pair): not the
    # one-entry-each way; and that way itself, whole and sliced
    two = pa.array([[("a", "1"), ("b", "2")], []], pa.map_(pa.string(), pa.string()))
    assert map_dicts(two) == [{"a": "1", "b": "2"}, {}]
    ones = pa.array([[("UNIQ_KEY", f"id{i}")] for i in range(5)], pa.map_(pa.string(), pa.string()))
    assert map_dicts(pa.chunked_array([ones, ones.slice(2), two])) == [
        *({"UNIQ_KEY": f"id{i}"} for i in range(5)),
        *({"UNIQ_KEY": f"id{i}"} for i in range(2, 5)),
        {"a": "1", "b": "2"},
        {},
    ]
    with_null = pa.array([[("a", "1")], None], pa.map_(pa.string(), pa.string()))
    assert map_dicts(with_null) == [{"a": "1"}, {}]


@pytest.mark.unit
def test_messages_of_a_column_of_nulls_reads_none():
    """A column that is all null (``keys``, often) reads as None without converting it, and
    one with values keeps them."""
    import pyarrow as pa

    from deltamq.message import StoredMessage, messages_of

    rows = pa.table(
        {
            "topic": ["t", "t"],
            "queue_id": pa.array([0, 0], pa.int32()),
            "queue_offset": pa.array([0, 1], pa.int64()),
            "msg_id": ["m0", "m1"],
            "body": [b"a", b"b"],
            "tags": pa.array([None, "x"], pa.string()),
            "keys": pa.array([None, None], pa.string()),
            "properties": pa.array(
                [[("UNIQ_KEY", "u0")], [("UNIQ_KEY", "u1")]], pa.map_(pa.string(), pa.string())
            ),
        }
    )
    got = messages_of(rows, StoredMessage)
    assert [(m.msg_id, m.keys, m.tags, m.body) for m in got] == [
        ("u0", None, None, b"a"),
        ("u1", None, "x", b"b"),
    ]
