"""``send_arrow``: a table of messages stored in one commit, checked and built a column at
a time, on the Spark-free producer and the broker's; the same rows a send of ``Message``
objects stores, and nothing stored when a row breaks a rule."""

from __future__ import annotations

import pyarrow as pa
import pytest
from conftest import table_versions
from support.listeners import Recorder, read_log

from deltamq import Message
from deltamq.errors import (
    BodyTooLarge,
    InvalidDelayLevel,
    InvalidMessage,
    InvalidProperties,
    InvalidTimer,
    TopicNotWritable,
    UnknownTopic,
)
from deltamq.ids import msg_id_array, msg_ids
from deltamq.lite import Producer
from deltamq.sending import queue_for_key


@pytest.mark.unit
def test_msg_ids_built_with_numpy_are_the_ids_of_every_send():
    for batch, n in [(0, 0), (1, 1), (0x0123456789ABCDEF, 17), (7 << 40, 70_000)]:
        assert msg_id_array(batch, n).to_pylist() == msg_ids(batch, n)


@pytest.mark.unit
def test_rows_go_to_the_queues_in_runs_in_queue_order_the_remainder_round_robin():
    from deltamq.sending_arrow import _runs_of

    assert _runs_of(10, 4, start=1).tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert _runs_of(10, 4, start=3).tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    assert _runs_of(1, 4, start=2).tolist() == [2]


def test_single_messages_move_round_robin_and_chunked_tables_are_sent_as_given(broker):
    broker.create_topic("orders", queues=4)
    p = broker.producer("bulk")
    one = [
        p.send_arrow(pa.table({"topic": ["orders"], "body": [b"x"]}))["queue_id"][0].as_py() for _ in range(4)
    ]
    assert sorted(one) == [0, 1, 2, 3]
    chunks = [
        pa.record_batch({"topic": ["orders"] * 3, "body": [f"{c}{i}".encode() for i in range(3)]})
        for c in "ab"
    ]
    sent = p.send_arrow(pa.Table.from_batches(chunks))
    bodies = broker.sql("SELECT msg_id, CAST(body AS STRING) AS b FROM commit_log").collect()
    by_id = {r["msg_id"]: r["b"] for r in bodies}
    assert [by_id[m] for m in sent["msg_id"].to_pylist()] == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_a_table_of_messages_is_stored_delivered_and_answered_in_order(broker, clock, tmp_path):
    broker.create_topic("orders", queues=4)
    broker.create_topic("audit", queues=2)
    log = tmp_path / "calls.jsonl"
    broker.create_group("g", Recorder(log), consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    broker.subscribe("g", "audit")
    table = pa.table(
        {
            "topic": ["orders"] * 8 + ["audit"] * 2,
            "body": [f"m{i}" for i in range(10)],  # strings are stored UTF-8 encoded
            "tags": ["A", None] * 5,
            "keys": [f"k{i}" for i in range(10)],
        }
    )
    sent = Producer(broker.warehouse.location, "bulk").send_arrow(table)
    assert sent.column_names == ["msg_id", "topic", "queue_id"]
    assert sent["topic"].to_pylist() == table["topic"].to_pylist()
    # each topic's rows in equal runs of consecutive rows, one run per queue
    queues = sent["queue_id"].to_pylist()
    runs = [queues[i : i + 2] for i in range(0, 8, 2)]
    assert all(a == b for a, b in runs) and sorted(r[0] for r in runs) == [0, 1, 2, 3]
    assert sorted(queues[8:]) == [0, 1]
    broker.tick(clock.now_ms())
    calls = {c["id"]: c for c in read_log(log)}
    assert set(calls) == set(sent["msg_id"].to_pylist())
    stored = {
        r["msg_id"]: r for r in broker.sql("SELECT msg_id, tags, keys, queue_id FROM consume_queue").collect()
    }
    for i, mid in enumerate(sent["msg_id"].to_pylist()):
        c, r = calls[mid], stored[mid]
        assert (c["topic"], c["body"], c["queue_id"]) == (table["topic"][i].as_py(), f"m{i}", queues[i])
        assert (r["tags"], r["keys"], r["queue_id"]) == (table["tags"][i].as_py(), f"k{i}", queues[i])


def test_queue_keys_and_queue_ids_pick_the_queues_a_send_of_messages_would(broker, clock):
    broker.create_topic("orders", queues=4)
    p = broker.producer("bulk")
    keys = ["alice", "bob", "carol", "alice"]
    sent = p.send_arrow(
        pa.table({"topic": ["orders"] * 4, "body": [b"x"] * 4, "user": keys}), queue_key="user"
    )
    assert sent["queue_id"].to_pylist() == [queue_for_key(k, 4) for k in keys]
    one = p.send_results([Message("orders", b"y")], queue_keys=["bob"])[0]
    assert one.queue_id == queue_for_key("bob", 4)
    chosen = p.send_arrow(pa.table({"topic": ["orders"] * 3, "body": [b"z"] * 3, "queue_id": [3, 0, 3]}))
    assert chosen["queue_id"].to_pylist() == [3, 0, 3]


def test_properties_delays_and_timers_are_stored_as_a_send_of_messages_stores_them(broker, clock):
    broker.create_topic("orders", queues=2)
    p = broker.producer("bulk")
    now = clock.now_ms()
    rows = [  # (properties, delay_level, deliver_at_ms)
        ({"trace": "t1", "UNIQ_KEY": "mine"}, 0, None),
        (None, 2, None),
        ({"x": "y"}, 0, now + 60_000),
        ({"TIMER_DELIVER_MS": str(now + 5_000)}, 0, None),
        (None, 99, None),  # above the highest level: stored at it, as RocketMQ does
        ({"TIMER_DELIVER_MS": str(now + 7_000), "a": ""}, 1, None),  # a timer beside a level
        ({}, 0, None),
    ]
    messages = [
        Message("orders", f"m{i}", properties=props, delay_level=level, deliver_at=at)
        for i, (props, level, at) in enumerate(rows)
    ]
    by_batch = p.send_batch(messages)
    table = pa.table(
        {
            "topic": ["orders"] * len(rows),
            "body": [f"m{i}" for i in range(len(rows))],
            "properties": _props([props for props, _, _ in rows]),
            "delay_level": [level for _, level, _ in rows],
            "deliver_at_ms": pa.array([at for _, _, at in rows], pa.int64()),
        }
    )
    by_arrow = p.send_arrow(table)["msg_id"].to_pylist()
    stored = {
        r["msg_id"]: r["properties"]
        for r in broker.sql("SELECT msg_id, properties FROM commit_log").collect()
    }
    for a, b in zip(by_batch, by_arrow, strict=True):
        assert stored[a]["UNIQ_KEY"] == a and stored[b]["UNIQ_KEY"] == b
        assert {k: v for k, v in stored[b].items() if k != "UNIQ_KEY"} == {
            k: v for k, v in stored[a].items() if k != "UNIQ_KEY"
        }
    assert stored[by_arrow[4]]["DELAY"] == str(broker.catalog.max_delay_level())
    assert stored[by_arrow[2]]["TIMER_DELIVER_MS"] == str(now + 60_000)


def test_unsigned_columns_are_taken_as_their_values(broker, clock):
    """Levels, timers and queue ids come from NumPy and pandas as unsigned integers too."""
    broker.create_topic("orders", queues=2)
    t = clock.now_ms() + 5_000
    table = pa.table(
        {
            "topic": ["orders"] * 2,
            "body": [b"a", b"b"],
            "queue_id": pa.array([1, 0], pa.uint16()),
            "delay_level": pa.array([2, 0], pa.uint8()),
            "deliver_at_ms": pa.array([None, t], pa.uint64()),
        }
    )
    sent = broker.producer("p").send_arrow(table)
    assert sent["queue_id"].to_pylist() == [1, 0]
    stored = {
        r["msg_id"]: r["properties"]
        for r in broker.sql("SELECT msg_id, properties FROM commit_log").collect()
    }
    first, second = (stored[m] for m in sent["msg_id"].to_pylist())
    assert first["DELAY"] == "2" and second["TIMER_DELIVER_MS"] == str(t)


def test_a_null_row_keeps_no_properties_of_what_lies_under_it(broker, clock):
    """Arrow lets a null map row keep entries in the array; they are not the row's. The
    rows' entries were matched by pyarrow's parent indices, which count them, so a table
    with such a row failed with an IndexError (a review's repro)."""
    broker.create_topic("orders", queues=1)
    props = pa.MapArray.from_arrays(
        pa.array([0, 2, 3], pa.int32()),
        pa.array(["x", "y", "b"]),
        pa.array(["X", "Y", "2"]),
        mask=pa.array([True, False]),
    )
    sent = broker.producer("p").send_arrow(
        pa.table({"topic": ["orders"] * 2, "body": [b"1", b"2"], "properties": props})
    )
    stored = {
        r["msg_id"]: r["properties"]
        for r in broker.sql("SELECT msg_id, properties FROM commit_log").collect()
    }
    first, second = (stored[m] for m in sent["msg_id"].to_pylist())
    assert set(first) == {"UNIQ_KEY"} and {k: v for k, v in second.items() if k != "UNIQ_KEY"} == {"b": "2"}


NOW = 1_800_000_000_000  # the clock fixture's start is earlier: only used beside a bad row
DAY = 86_400_000


def _two() -> dict:
    return {"topic": ["orders", "orders"], "body": [b"x", b"y"]}


_MAP = pa.map_(pa.string(), pa.string())


def _props(rows: list) -> pa.Array:
    return pa.array([None if r is None else list(r.items()) for r in rows], pa.map_(pa.string(), pa.string()))


BAD = [
    (
        lambda: {"topic": ["orders"], "body": [b"x"], "born_ts": [2]},
        InvalidMessage,
        r"\['born_ts'\] are not",
    ),
    (lambda: {**_two(), "delay_level": [0, -1]}, InvalidDelayLevel, "row 1 has delay_level -1"),
    (
        lambda: {**_two(), "queue_id": pa.array([0, 2**40], pa.uint64())},
        InvalidMessage,
        "column 'queue_id' holds a value beyond int32",
    ),
    (
        lambda: {**_two(), "properties": _props([None, {"DELAY": "2"}])},
        InvalidProperties,
        "row 1 has property 'DELAY'",
    ),
    (
        lambda: {**_two(), "properties": _props([{"a": "b"}, {"a": None}])},
        InvalidProperties,
        "row 1's property 'a' is null",
    ),
    (
        lambda: {**_two(), "properties": _props([{}, {"": "b"}])},
        InvalidProperties,
        "row 1 has a property named ''",
    ),
    (lambda: {**_two(), "properties": [1, 2]}, InvalidProperties, "column 'properties' is int64"),
    (
        lambda: {**_two(), "properties": pa.array([[("a", "1")], [("a", "1"), ("a", "2")]], _MAP)},
        InvalidProperties,
        "row 1 has property 'a' twice",
    ),
    (
        # a null row whose entries stay under it in the array (Arrow allows it; they are not its)
        lambda: {
            "topic": ["orders"] * 3,
            "body": [b"x", b"y", b"z"],
            "properties": pa.MapArray.from_arrays(
                pa.array([0, 2, 3, 4], pa.int32()),
                pa.array(["x", "y", "b", ""]),
                pa.array(["X", "Y", "2", "e"]),
                mask=pa.array([True, False, False]),
            ),
        },
        InvalidProperties,
        "row 2 has a property named ''",
    ),
    (
        lambda: {**_two(), "properties": _props([None, {"TIMER_DELIVER_MS": "soon"}])},
        InvalidTimer,
        "row 1's TIMER_DELIVER_MS='soon'",
    ),
    (
        lambda: {**_two(), "delay_level": [0, 3], "deliver_at_ms": [None, NOW]},
        InvalidTimer,
        "row 1 has both delay_level=3 and deliver_at_ms",
    ),
    (
        lambda: {
            **_two(),
            "deliver_at_ms": [NOW, NOW],
            "properties": _props([None, {"TIMER_DELIVER_MS": "5"}]),
        },
        InvalidTimer,
        "row 1 has both deliver_at_ms and a TIMER_DELIVER_MS",
    ),
    (
        lambda: {**_two(), "deliver_at_ms": [None, NOW + 400 * DAY]},
        InvalidTimer,
        "row 1: timer due at .* days ahead",
    ),
    (lambda: {"body": [b"x"]}, InvalidMessage, "needs a 'topic' column"),
    (lambda: {"topic": ["orders", "orders"], "body": [b"x", None]}, InvalidMessage, "row 1 has no body"),
    (lambda: {"topic": ["orders"], "body": [1]}, InvalidMessage, "column 'body' is int64"),
    (lambda: {"topic": ["orders", "nope"], "body": [b"x", b"y"]}, UnknownTopic, "'nope' does not exist"),
    (lambda: {"topic": ["readonly"], "body": [b"x"]}, TopicNotWritable, "perm R"),
    (
        lambda: {"topic": ["orders"] * 2, "body": [b"x", b"y"], "queue_id": [0, 4]},
        InvalidMessage,
        "row 1 asks for queue 4",
    ),
    (lambda: {"topic": ["orders"], "body": [b"x"], "flag": [1 << 40]}, InvalidMessage, "column 'flag'"),
]


@pytest.mark.parametrize("columns, error, text", BAD, ids=[b[2][:20] for b in BAD])
def test_a_table_with_a_bad_row_is_refused_whole_naming_it(broker, tmp_path, columns, error, text):
    broker.create_topic("orders", queues=4)
    broker.create_topic("readonly", perm="R")
    p = Producer(tmp_path / "wh", "bulk")
    before = table_versions(tmp_path / "wh")
    with pytest.raises(error, match=text):
        p.send_arrow(pa.table(columns()))
    with pytest.raises(BodyTooLarge, match="row 1's body is"):
        big = b"x" * (broker.config.max_body_bytes + 1)
        p.send_arrow(pa.table({"topic": ["orders"] * 2, "body": [b"x", big]}))
    with pytest.raises(InvalidMessage, match="pyarrow Table or RecordBatch, got dict"):
        p.send_arrow(columns())
    assert table_versions(tmp_path / "wh") == before
