"""Deliver's small passes from the tables' files (deltamq/jobs/deliver_files.py): the same
outcomes as through the engine, and the engine for what the files' way does not do."""

from __future__ import annotations

import pytest
from support.listeners import read_log

from deltamq import Message
from deltamq.jobs import deliver_files, deliver_plan


@pytest.fixture
def spied(monkeypatch):
    """Counts the passes delivered from the files."""
    calls = []
    real = deliver_files.consume

    def consume(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(deliver_files, "consume", consume)
    return calls


def _scenario(broker, clock, warehouse_with, topic, log):
    """Tags filtered, messages failing (sent back), an ack index, an orderly group;
    returns each group's outcomes, what the listeners saw and where offsets are."""
    setup = warehouse_with(topic, queues=2, group=f"{topic}-tags", expression="a || b", log=log)
    setup.add_group("fail_on_b", name=f"{topic}-fail")
    setup.add_group("ack_first", name=f"{topic}-ack", consume_message_batch_max_size=4)
    setup.add_group("ok", name=f"{topic}-orderly", orderly=True)
    p = broker.producer("p")
    p.send_batch(
        [Message(topic, f"{t}{i}", tags=t) for i, t in enumerate("aabcab")], selector=lambda n, m, a: 0
    )
    p.send_batch([Message(topic, f"x{i}", tags="c") for i in range(3)], selector=lambda n, m, a: 1)
    r = broker.tick(clock.now_ms()).delivered
    seen = sorted((c["body"], c["batch"]) for c in read_log(log))
    offsets = broker.sql(
        "SELECT consumer_group, queue_id, next_offset, attempts FROM offsets "
        f"WHERE topic = '{topic}' AND consumer_group LIKE '{topic}-%'"
    ).collect()
    retries = broker.sql(f"SELECT count(*) FROM commit_log WHERE topic LIKE '%RETRY%{topic}-%'").collect()[0][
        0
    ]
    groups = {g.split("-", 1)[1]: counts for g, counts in r.by_group.items() if g.startswith(topic)}
    return (
        groups,
        seen,
        sorted(
            (o["consumer_group"].split("-", 1)[1], o["queue_id"], o["next_offset"], o["attempts"])
            for o in offsets
        ),
        retries,
    )


def test_a_small_pass_from_the_files_gives_the_engines_outcomes(
    broker, clock, warehouse_with, monkeypatch, spied
):
    by_files = _scenario(broker, clock, warehouse_with, "viaFiles", "files.jsonl")
    assert spied  # the files' way delivered
    monkeypatch.setattr(deliver_files, "eligible", lambda *a: False)
    spied.clear()
    by_engine = _scenario(broker, clock, warehouse_with, "viaEngine", "engine.jsonl")
    assert not spied
    assert by_files == by_engine
    assert (
        by_files[0]["tags"] == {"consumed": 5, "filtered": 4} and by_files[3] == 6
    )  # b2, b5; 4 after ack_index


def test_an_sql92_subscription_goes_through_the_engine(broker, clock, warehouse_with, spied):
    setup = warehouse_with("orders", queues=1, group="sql", expression="*")
    broker.subscribe("sql", "orders", "a IS NULL", type="SQL92")
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(3)])
    broker.tick(clock.now_ms())
    assert not spied and len(read_log(setup.log)) == 3


@pytest.mark.unit
def test_which_passes_the_files_way_takes():
    """The embedded engine, no SQL92 take, no de-duplicating group, at most MAX_MESSAGES."""
    from deltamq.config import GroupConfig

    def take(lo=0, hi=10, sql92=None):
        return deliver_plan.QueueTake("g", "orders", 0, lo, hi, None, 0, 0, sql92)

    plain = {"g": GroupConfig("g")}
    assert deliver_files.eligible(plain, [take()], embedded=True)
    assert not deliver_files.eligible(plain, [take()], embedded=False)
    assert not deliver_files.eligible(plain, [], embedded=True)
    assert not deliver_files.eligible(plain, [take(sql92="a > 1")], embedded=True)
    assert not deliver_files.eligible({"g": GroupConfig("g", dedup_key="keys")}, [take()], embedded=True)
    limit = deliver_files.MAX_MESSAGES
    assert deliver_files.eligible(plain, [take(0, limit // 2), take(5, 5 + limit // 2)], embedded=True)
    assert not deliver_files.eligible(plain, [take(0, limit), take(0, 1)], embedded=True)


@pytest.mark.unit
def test_a_pass_is_split_into_whole_queues_for_the_cores():
    import pyarrow as pa

    queues = [0] * 5 + [1] * 3 + [2] * 3 + [3] * 1
    rows = pa.table(
        {
            "consumer_group": ["g"] * len(queues),
            "client_id": [""] * len(queues),
            "topic": ["orders"] * len(queues),
            "queue_id": queues,
            "queue_offset": list(range(len(queues))),
        }
    )
    parts = deliver_files.partitions(rows, 2)
    assert [sorted(set(p.column("queue_id").to_pylist())) for p in parts] == [[0, 3], [1, 2]]
    assert sorted(o for p in parts for o in p.column("queue_offset").to_pylist()) == list(range(len(queues)))
    assert deliver_files.partitions(rows, 1) == [rows]
    assert len(deliver_files.partitions(rows, 8)) == 4  # never more than the queues


def test_queues_interleaved_and_several_groups_and_instances_are_split_whole():
    """Rows of queues interleaved row by row (an engine's send), two groups, an instance
    and none (null): each (group, instance, topic, queue) lands whole in one part, every
    row once, in its order within the part."""
    import pyarrow as pa

    n = 300
    rows = pa.table(
        {
            "consumer_group": ["a" if i % 3 else "b" for i in range(n)],
            "client_id": [None if (i // 4) % 2 else "c1" for i in range(n)],
            "topic": ["t"] * n,
            "queue_id": [i % 4 for i in range(n)],
            "queue_offset": list(range(n)),
        }
    )
    parts = deliver_files.partitions(rows, 3)
    assert len(parts) == 3
    homes: dict[tuple, int] = {}
    for k, p in enumerate(parts):
        offsets = p.column("queue_offset").to_pylist()
        assert offsets == sorted(offsets)
        for r in p.select(["consumer_group", "client_id", "topic", "queue_id"]).to_pylist():
            assert homes.setdefault(tuple(r.values()), k) == k
    assert len(homes) == 2 * 2 * 4
    assert sorted(o for p in parts for o in p.column("queue_offset").to_pylist()) == list(range(n))


def test_groups_taking_overlapping_ranges_of_a_queue_get_each_message_once(
    broker, clock, warehouse_with, spied
):
    """One group is ahead of another on the same queue: their takes overlap, and each
    group's listener gets each message of its take once (the two listeners share a log:
    every body twice in all, once per group)."""
    from collections import Counter

    setup = warehouse_with("overlap", queues=1, group="ahead")
    p = broker.producer("p")
    p.send_batch([Message("overlap", f"m{i}") for i in range(3)])
    broker.tick(clock.now_ms())
    setup.add_group("ok", name="behind")
    p.send_batch([Message("overlap", f"m{i}") for i in range(3, 6)])
    r = broker.tick(clock.now_ms()).delivered
    assert spied  # the files' way
    assert r.by_group["behind"]["consumed"] == 6 and r.by_group["ahead"]["consumed"] == 3
    assert Counter(c["body"] for c in read_log(setup.log)) == {f"m{i}": 2 for i in range(6)}
