"""BROADCASTING: every instance gets every message with its own offset; failures are
logged and dropped, never retried (docs/behaviour.md §3)."""

from __future__ import annotations

import pytest
from support.listeners import Recorder, read_log

from deltamq import Message
from deltamq.errors import ConfigError


def test_two_instances_each_get_every_message_and_failures_are_dropped(broker, clock, tmp_path):
    broker.create_topic("news", queues=2)
    log = tmp_path / "b.jsonl"
    broker.create_group(
        "fanout",
        Recorder(log, "fail_on_b"),
        mode="BROADCASTING",
        instances=["a", "b"],
        consume_from="FIRST_OFFSET",
    )
    broker.subscribe("fanout", "news")
    broker.producer("p").send_batch([Message("news", f"n{i}") for i in range(4)])
    t = clock.now_ms()
    result = broker.tick(t).job("deliver").result
    calls = read_log(log)
    by_instance = {i: sorted(c["body"] for c in calls if c["instance"] == i) for i in ("a", "b")}
    assert by_instance == {"a": ["n0", "n1", "n2", "n3"], "b": ["n0", "n1", "n2", "n3"]}
    assert (result.consumed, result.dropped, result.retried, result.dead_lettered) == (4, 4, 0, 0)
    offsets = broker.sql(
        "SELECT client_id, sum(next_offset) AS n FROM offsets WHERE consumer_group = 'fanout' "
        "GROUP BY client_id"
    ).collect()
    assert {r["client_id"]: r["n"] for r in offsets} == {"a": 4, "b": 4}
    broker.tick(t + 3_600_000)  # nothing is retried
    assert len(read_log(log)) == 8
    assert (
        broker.sql("SELECT count(*) AS n FROM commit_log WHERE topic LIKE '%fanout'").collect()[0]["n"] == 0
    )


def test_broadcast_push_group_must_declare_instances(broker):
    with pytest.raises(ConfigError, match="instances="):
        broker.create_group("fanout", Recorder("/dev/null"), mode="BROADCASTING")
    assert "fanout" not in broker.groups()


def _positions(broker, group):
    rows = broker.sql(
        f"SELECT client_id, queue_id, next_offset FROM offsets WHERE consumer_group = '{group}' "
        "AND topic = 'news'"
    ).collect()
    return {(r["client_id"], r["queue_id"]): r["next_offset"] for r in rows}


def test_every_instance_starts_where_consume_from_says_even_one_left_unplaced(broker, clock, tmp_path):
    """All instances are placed in one commit. An instance left unplaced (as a release that
    placed them one commit each left it when killed between two) is placed where
    ``consume_from`` says when the group subscribes again, not read from offset 0."""
    from deltamq.tables.offsets import start_positions

    broker.create_topic("news", queues=1)
    broker.producer("p").send_batch([Message("news", f"old{i}") for i in range(3)])
    broker.tick(clock.now_ms())  # dispatched: the head is 3
    log = tmp_path / "b.jsonl"
    broker.create_group("fanout", Recorder(log), mode="BROADCASTING", instances=["a", "b", "c"])
    broker.subscribe("fanout", "news")
    assert _positions(broker, "fanout") == {("a", 0): 3, ("b", 0): 3, ("c", 0): 3}

    broker.create_group("later", Recorder(log), mode="BROADCASTING", instances=["a", "b"])
    start_positions(broker.warehouse, "later", ["a"], "news", {0: 3}, clock.now_ms())  # b unplaced
    broker.subscribe("later", "news")
    assert _positions(broker, "later") == {("a", 0): 3, ("b", 0): 3}
    broker.tick(clock.now_ms())
    assert read_log(log) == []  # LAST_OFFSET: nothing old, for any instance


def test_an_offset_reset_moves_every_instance(broker, clock, tmp_path):
    broker.create_topic("news", queues=1)
    log = tmp_path / "b.jsonl"
    broker.create_group("fanout", Recorder(log), mode="BROADCASTING", instances=["a", "b"])
    broker.subscribe("fanout", "news")
    broker.producer("p").send_batch([Message("news", f"n{i}") for i in range(3)])
    broker.tick(clock.now_ms())
    assert _positions(broker, "fanout") == {("a", 0): 3, ("b", 0): 3}
    new = broker.reset_offsets("fanout", 0)
    assert new == {("news", 0): 0}
    assert _positions(broker, "fanout") == {("a", 0): 0, ("b", 0): 0}
    clock.advance(ms=1_000)
    broker.tick(clock.now_ms())
    calls = read_log(log)
    assert sorted((c["instance"], c["body"]) for c in calls) == sorted(
        [(i, f"n{n}") for i in ("a", "b") for n in range(3)] * 2
    )
