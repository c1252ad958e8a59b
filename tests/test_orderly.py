"""Orderly consumption (docs/behaviour.md §4): strictly in offset order per queue, suspend and retry
the failing message after a pause, nothing later in that queue meanwhile."""

from __future__ import annotations

from functools import partial

import pytest
from support.listeners import read_log

from deltamq import Message


@pytest.fixture
def orderly(warehouse_with):
    """The broker, and ``group(behavior, **options)``: adds the orderly group "seq" with a
    Recorder listener of that behaviour, from FIRST_OFFSET, and returns its log."""
    wh = warehouse_with("orders", queues=2, log="o.jsonl")
    return wh.broker, partial(wh.add_group, name="seq", orderly=True)


def _send(broker, queue, bodies):
    broker.producer("p").send_batch(
        [Message("orders", b) for b in bodies], selector=lambda n, m, arg: arg, arg=queue
    )


@pytest.mark.story(s3="slow")  # the S3 variant in the slow tier (the default tier stays under 6 min)
def test_order_preserved_across_suspends(orderly, clock):
    broker, group = orderly
    log = group("suspend_bad_twice")
    _send(broker, 0, ["m0", "m1", "bad2", "m3", "m4"])
    t = clock.now_ms()
    result = broker.tick(t).job("deliver").result
    assert [c["body"] for c in read_log(log)] == ["m0", "m1", "bad2"]
    assert result.suspended == 1 and result.retried == 0
    broker.tick(t + 500)  # still suspended (pause 1 s): nothing later in the queue is consumed
    assert len(read_log(log)) == 3
    broker.tick(t + 1000)
    broker.tick(t + 2000)
    calls = read_log(log)
    assert [(c["body"], c["reconsume"]) for c in calls] == [
        ("m0", 0),
        ("m1", 0),
        ("bad2", 0),
        ("bad2", 1),
        ("bad2", 2),
        ("m3", 0),
        ("m4", 0),
    ]
    nxt = broker.sql(
        "SELECT next_offset, suspends FROM offsets WHERE consumer_group = 'seq' AND queue_id = 0"
    )
    row = nxt.collect()[0]
    assert (row["next_offset"], row["suspends"]) == (5, 0)


def test_blocked_queue_does_not_hold_back_other_queues(orderly, clock):
    broker, group = orderly
    log = group("suspend_bad")
    _send(broker, 0, ["bad", "after-bad"])
    _send(broker, 1, ["a1", "a2"])
    t = clock.now_ms()
    broker.tick(t)
    _send(broker, 1, ["a3"])
    broker.tick(t + 1000)
    bodies = [c["body"] for c in read_log(log)]
    assert bodies.count("bad") == 2 and "after-bad" not in bodies
    assert [b for b in bodies if b.startswith("a")] == ["a1", "a2", "a3"]


def test_dead_letter_at_the_set_maximum_then_the_queue_moves_on(orderly, clock):
    broker, group = orderly
    log = group("suspend_bad", max_reconsume_times=2)
    _send(broker, 0, ["bad", "next"])
    t = clock.now_ms()
    for step in range(4):
        broker.tick(t + step * 1000)
    calls = [(c["body"], c["reconsume"]) for c in read_log(log)]
    assert calls == [("bad", 0), ("bad", 1), ("bad", 2), ("next", 0)]
    dead = broker.sql("SELECT properties FROM commit_log WHERE topic = '%DLQ%seq'").collect()
    assert len(dead) == 1 and dead[0]["properties"]["DLQ_REASON"] == "orderly_max"


def test_a_queue_head_removed_by_retention_leaves_no_suspends_to_the_next(orderly, clock):
    """Retention moves a group past an expired, suspended head: the next message starts
    afresh (reconsume 0, no pause), as after any offset move, instead of inheriting the
    removed head's suspends and pause."""
    broker, group = orderly
    log = group("suspend_bad_twice")
    t = clock.now_ms()
    _send(broker, 0, ["bad0"])
    broker.tick(t)  # suspended once
    later = t + 4 * 86_400_000
    clock.set(later)
    _send(broker, 0, ["m1"])
    result = broker.tick(later)  # bad0 suspended again, then removed by retention (72 h)
    assert result.job("retain").status == "OK"
    assert [(c["body"], c["reconsume"]) for c in read_log(log)] == [("bad0", 0), ("bad0", 1)]
    [row] = broker.sql(
        "SELECT next_offset, suspends, suspend_until FROM offsets WHERE consumer_group = 'seq' "
        "AND topic = 'orders' AND queue_id = 0"
    ).collect()
    assert (row["next_offset"], row["suspends"], row["suspend_until"]) == (1, 0, None), row
    broker.tick(later + 1)  # within the removed head's pause: not held by it
    assert [(c["body"], c["reconsume"]) for c in read_log(log)][-1] == ("m1", 0)


def test_an_orderly_chunk_whose_worker_dies_is_tried_again_in_order(orderly, clock):
    """A worker that dies on a chunk has its messages tried one at a time, to find the one
    at fault; for an orderly queue that stops at the first that fails (no message reaches
    the listener before the ones ahead of it succeeded), and the one before it that
    succeeded alone stays consumed. The error is in the deliver row of job_runs."""
    broker, group = orderly
    log = group("exit_on_any", consume_message_batch_max_size=3, consume_timeout_ms=4000)
    _send(broker, 0, ["ok0", "exit", "ok2"])
    run = broker.tick(clock.now_ms()).job("deliver")
    calls = [(c["body"], c["batch"]) for c in read_log(log)]
    assert calls[:3] == [("ok0", 3), ("exit", 3), ("ok2", 3)]  # the chunk, then one at a time
    assert ("ok0", 1) in calls and ("ok2", 1) not in calls, calls
    assert run.result.consumed == 1 and run.result.suspended == 2  # "exit" and the one behind it
    assert "group seq" in run.error and "listener ended without an outcome" in run.error


def test_an_orderly_listener_that_raises_is_reported(orderly, clock):
    """A suspended chunk's error reaches the tick's result and job_runs, as a concurrent
    group's failures do (it was left out: a failing orderly listener was silent)."""
    broker, group = orderly
    group("raise")
    _send(broker, 0, ["m0"])
    run = broker.tick(clock.now_ms()).job("deliver")
    assert run.result.suspended == 1 and "ValueError: cannot handle" in run.error
    row = broker.sql("SELECT error FROM job_runs WHERE job = 'deliver'").collect()[0]
    assert "group seq: 1 failed" in row["error"]


def test_an_orderly_group_whose_listener_cannot_load_waits_and_dead_letters_nothing(
    orderly, clock, tmp_path, monkeypatch
):
    """As a concurrent group's: nothing consumed, the queue held where it was, no suspend
    counted (they had counted towards max_reconsume_times and dead-lettered the queue)."""
    broker, _ = orderly
    module = tmp_path / "vanishing_orderly.py"
    module.write_text("def ok(messages, context):\n    return 'SUCCESS'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broker.create_group(
        "seq", "vanishing_orderly:ok", orderly=True, consume_from="FIRST_OFFSET", max_reconsume_times=1
    )
    broker.subscribe("seq", "orders")
    _send(broker, 0, ["m0", "m1"])
    module.unlink()
    t = clock.now_ms()
    for k in range(4):
        result = broker.tick(t + k * 2_000)
        d = result.delivered
        assert d.setup_failed >= 1 and d.suspended == 0 and d.dead_lettered == 0
        assert [g for g, _ in result.setup_errors] == ["seq"]
    assert broker.sql("SELECT count(*) FROM commit_log WHERE topic LIKE '%\\%seq'").collect()[0][0] == 0


def test_an_orderly_success_short_of_the_chunk_consumes_its_prefix_and_suspends_after_it(orderly, clock):
    """``ack_index`` 0 on an orderly chunk of three: the first is consumed, the queue
    suspends at the second (docs/behaviour.md §4), which comes back after the pause with
    the third behind it."""
    broker, group = orderly
    log = group("ack_first", consume_message_batch_max_size=3)
    _send(broker, 0, ["m0", "m1", "m2"])
    t = clock.now_ms()
    result = broker.tick(t).job("deliver").result
    assert (result.consumed, result.suspended) == (1, 2)
    broker.tick(t + 2_000)
    calls = [(c["body"], c["reconsume"]) for c in read_log(log)]
    assert calls == [("m0", 0), ("m1", 0), ("m2", 0), ("m1", 1), ("m2", 0)]
