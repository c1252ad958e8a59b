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
