"""Idempotent consumption (docs/behaviour.md §7): keys consumed within the window are skipped."""

from __future__ import annotations

import pytest
from support.listeners import read_log

from deltamq import Message
from deltamq.errors import ConfigError

HOUR = 3_600_000


@pytest.fixture
def orders(warehouse_with):
    return warehouse_with("orders", queues=2).broker


def test_a_key_consumed_within_the_window_skips_the_listener(warehouse_with, clock):
    wh = warehouse_with("orders", queues=2, group="g", dedup_key="KEYS", dedup_window_ms=HOUR)
    orders, log = wh.broker, wh.log
    p = orders.producer("p")
    p.send(Message("orders", b"first", keys="order-1"))
    t = clock.now_ms()
    orders.tick(t)
    p.send(Message("orders", b"again", keys="order-1"))
    p.send(Message("orders", b"other", keys="order-2"))
    run = orders.tick(t + 1).job("deliver")
    assert run.details["deduplicated"] == 1 and run.details["consumed"] == 1
    assert sorted(c["body"] for c in read_log(log)) == ["first", "other"]
    clock.set(t + HOUR + 1)  # the window has passed: the key is new again
    p.send(Message("orders", b"late", keys="order-1"))
    orders.tick(t + HOUR + 1)
    assert sorted(c["body"] for c in read_log(log)) == ["first", "late", "other"]
    # keys older than the window were deleted when the newer ones were recorded
    keys = orders.sql("SELECT dedup_key, first_ts FROM consumed_keys ORDER BY first_ts").collect()
    assert [(r["dedup_key"], r["first_ts"] >= t + 1) for r in keys] == [("order-2", True), ("order-1", True)]


def test_a_replay_after_an_offset_reset_is_not_consumed_twice(warehouse_with, clock):
    wh = warehouse_with("orders", queues=2, group="g", dedup_key="UNIQ_KEY")
    orders, log = wh.broker, wh.log
    p = orders.producer("p")
    p.send_batch([Message("orders", f"m{i}") for i in range(4)])
    t = clock.now_ms()
    orders.tick(t)
    assert len(read_log(log)) == 4
    orders.reset_offsets("g", to_time=t - 1)  # replay everything
    run = orders.tick(t + 1).job("deliver")
    assert run.details["deduplicated"] == 4 and len(read_log(log)) == 4


def test_a_failed_message_keeps_no_key_and_its_retry_is_delivered(warehouse_with, clock):
    wh = warehouse_with("orders", queues=2, group="g", recorder="fail_twice", dedup_key="UNIQ_KEY")
    orders, log = wh.broker, wh.log
    orders.producer("p").send(Message("orders", b"flaky"))
    t = clock.now_ms()
    orders.tick(t)
    for k in range(1, 8):  # level 3 (10 s), then level 4 (30 s)
        orders.tick(t + k * 10_000 + 1)
    calls = read_log(log)
    assert [c["reconsume"] for c in calls] == [0, 1, 2]  # failed twice, then its retry consumed once
    assert orders.sql("SELECT count(*) AS n FROM consumed_keys").collect()[0]["n"] == 1


def test_copies_of_a_key_in_one_pass_reach_the_listener_once(warehouse_with, clock):
    """Copies of one key taken by the same pass were each delivered (keys counted once the
    pass ended). The first now goes to the listener; the later ones are sent back (level 1)
    and, its key consumed by then, acknowledged unseen."""
    wh = warehouse_with("orders", queues=2, group="g", dedup_key="KEYS")
    orders, log = wh.broker, wh.log
    p = orders.producer("p")
    p.send(Message("orders", b"first", keys="order-1"), queue_key="a")
    p.send(Message("orders", b"copy", keys="order-1"), queue_key="b")  # another queue, maybe
    p.send(Message("orders", b"copy2", keys="order-1"), queue_key="a")
    p.send(Message("orders", b"other", keys="order-2"), queue_key="b")
    t = clock.now_ms()
    run = orders.tick(t).job("deliver")
    assert run.details["later_copies"] == 2 and run.details["consumed"] == 2
    assert sorted(c["body"] for c in read_log(log)) == ["first", "other"]
    # the copies come back after level 1 (1 s): their key was consumed
    again = orders.tick(t + 1_001).job("redeliver")
    assert again.details["deduplicated"] == 2 and again.details["later_copies"] == 0
    for k in range(2, 4):
        orders.tick(t + k * 1_000 + 1)
    assert sorted(c["body"] for c in read_log(log)) == ["first", "other"]
    sent_back = orders.sql(
        "SELECT count(*) AS n FROM commit_log WHERE topic = '%RETRY%g' AND properties['DELAY'] = '1'"
    ).first()["n"]
    assert sent_back == 2


def test_a_later_copy_is_delivered_when_the_first_fails(warehouse_with, clock):
    """The first copy fails: the later copy, sent back at level 1, is delivered and its key
    consumed; the first copy's retry (level 3, 10 s) is then acknowledged unseen."""
    wh = warehouse_with("orders", queues=1, group="g", recorder="fail_first_try_of_bad", dedup_key="KEYS")
    orders, log = wh.broker, wh.log
    p = orders.producer("p")
    p.send(Message("orders", b"bad-first", keys="order-1"))
    p.send(Message("orders", b"good-copy", keys="order-1"))
    t = clock.now_ms()
    orders.tick(t)
    for k in range(1, 30):
        orders.tick(t + k * 1_000 + 1)
    calls = [(c["body"], c["reconsume"]) for c in read_log(log)]
    assert calls == [("bad-first", 0), ("good-copy", 1)]  # once consumed, never again
    dead = orders.sql("SELECT count(*) AS n FROM commit_log WHERE topic = '%DLQ%g'").first()["n"]
    assert dead == 0


def test_later_copies_wait_with_their_queue_while_the_listener_cannot_load(
    broker, clock, tmp_path, monkeypatch
):
    """A group whose listener cannot be loaded consumes nothing and keeps its queues where
    they were; a later copy of a key then has no first outcome to wait for: it waits with
    its queue too (sent back each tick, it piled up retry copies), and once the listener
    is back the key reaches it once."""
    import json

    module = tmp_path / "flaky_import.py"
    log = tmp_path / "calls.jsonl"
    source = (
        "import json\n"
        "def ok(messages, context):\n"
        f"    with open({str(log)!r}, 'a') as fh:\n"
        "        for m in messages:\n"
        "            fh.write(json.dumps(m.body.decode()) + '\\n')\n"
        "    return 'CONSUME_SUCCESS'\n"
    )
    module.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    broker.create_topic("orders", queues=2)
    broker.create_group("g", "flaky_import:ok", consume_from="FIRST_OFFSET", dedup_key="KEYS")
    broker.subscribe("g", "orders")
    p = broker.producer("p")
    p.send(Message("orders", b"first", keys="k"), queue_key="a")
    p.send(Message("orders", b"copy", keys="k"), queue_key="b")
    module.unlink()
    t = clock.now_ms()
    for k in range(3):
        assert broker.tick(t + k * 2_000).delivered.setup_failed == 1
    assert broker.sql("SELECT count(*) AS n FROM commit_log WHERE topic = '%RETRY%g'").first()["n"] == 0
    module.write_text(source)
    for k in range(3, 8):
        broker.tick(t + k * 2_000)
    assert [json.loads(line) for line in log.read_text().splitlines()] == ["first"]


def test_dedup_key_expressions_are_checked(orders):
    with pytest.raises(ConfigError, match="does not evaluate"):
        orders.create_group("bad", dedup_key="no_such_column + 1")
    orders.create_group("byprop", dedup_key="properties['order_id']")
    assert orders.groups()["byprop"].dedup_key == "properties['order_id']"
    with pytest.raises(ConfigError, match="'fan'.*CLUSTERING.*would skip the others' messages"):
        orders.create_group(
            "fan",
            "support.listeners:consume_all",
            mode="BROADCASTING",
            instances=["a", "b"],
            dedup_key="KEYS",
        )
    assert "fan" not in orders.groups()


def test_pull_clients_skip_keys_already_acked(orders, clock):
    orders.create_group("w", consume_from="FIRST_OFFSET", dedup_key="KEYS")
    orders.subscribe("w", "orders")
    p = orders.producer("p")
    p.send(Message("orders", b"first", keys="k1"), queue_key="x")
    t = clock.now_ms()
    orders.tick(t)
    c = orders.pull_consumer("w", "c1")
    got = c.pull(10, now=t + 1)
    assert [m.body for m in got] == [b"first"]
    c.ack([m.receipt_handle for m in got], now=t + 2)
    p.send(Message("orders", b"again", keys="k1"), queue_key="x")
    p.send(Message("orders", b"new", keys="k2"), queue_key="x")
    orders.tick(t + 3)
    assert [m.body for m in c.pull(10, now=t + 4)] == [b"new"]


def test_a_pull_ack_lost_after_its_key_is_recorded_is_not_processed_again(orders, clock):
    """The keys are stored before the acks (as deliver stores them before its offsets): a
    client killed between the two leaves the message in flight with its key consumed, so
    the copy handed out again after the invisible time is acknowledged, not processed."""
    from support.crash import Crashed

    orders.create_group("w", consume_from="FIRST_OFFSET", dedup_key="KEYS", invisible_time_ms=1_000)
    orders.subscribe("w", "orders")
    orders.producer("p").send(Message("orders", b"first", keys="k1"), queue_key="x")
    t = clock.now_ms()
    orders.tick(t)
    c = orders.pull_consumer("w", "c1")
    [m] = c.pull(10, now=t + 1)

    def killed(rows):
        raise Crashed("killed before the acks were stored")

    c.store.append_log = killed
    with pytest.raises(Crashed):
        c.ack([m.receipt_handle], now=t + 2)
    del c.store.append_log  # the process runs again
    orders.tick(t + 5_000)  # past the invisible time: sent back to the group's retry topic
    for k in range(1, 5):
        orders.tick(t + 5_000 + k * 30_000)
        assert c.pull(10, now=t + 5_001 + k * 30_000) == []  # the code before handed it out at k = 1
