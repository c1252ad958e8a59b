"""Promoting ahead (``promote_ahead_ms``, docs/behaviour.md §2): a tick writes and indexes
the copies of what falls due within the horizon before it is due; every reader of a
queue (deliver, the sinks, both kinds of pull client) stops at the first copy not due
yet, so nothing is handed out early, and the next deliver after the due time hands it
over without a promote pass in between. Driven by a fake clock."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.listeners import read_log

from deltamq import Message
from deltamq.config import BrokerConfig
from deltamq.errors import ConfigError
from deltamq.lite import PullConsumer


@pytest.fixture
def shop(warehouse_with):
    return warehouse_with("orders", queues=1, group="g")


def _bodies(log) -> list[str]:
    return [c["body"] for c in read_log(log)]


def _index(broker) -> list[tuple[int, int | None]]:
    rows = broker.sql(
        "SELECT queue_offset, due_ts FROM consume_queue WHERE topic = 'orders' ORDER BY queue_offset"
    ).collect()
    return [(r["queue_offset"], r["due_ts"]) for r in rows]


def test_a_timer_is_indexed_ahead_and_handed_out_at_its_due_time_never_before(shop, clock):
    b = shop.broker
    ahead = b.context.promote_ahead_ms
    assert ahead == 1000  # the default
    t0 = clock.now_ms()
    b.producer("p").send(Message("orders", b"timer", delay=timedelta(seconds=10)))
    due = t0 + 10_000
    assert b.tick(t0).job("promote").rows_out == 0  # not within the horizon yet
    r = b.tick(due - ahead // 2)
    assert r.job("promote").rows_out == 1 and r.job("promote").details["ahead"] == 1
    assert "redeliver" not in [j.job for j in r.jobs]  # nothing was due already
    assert _index(b) == [(0, due)]  # in its queue, carrying its due time
    for at in (due - ahead // 2, due - 1):
        r = b.tick(at)
        assert r.delivered is None or r.delivered.taken == 0
    assert _bodies(shop.log) == []
    r = b.tick(due)
    assert r.job("deliver").rows_out == 1 and r.job("promote").rows_out == 0
    assert _bodies(shop.log) == ["timer"]


def test_a_plain_message_behind_a_copy_not_yet_due_waits_for_it(shop, clock):
    b = shop.broker
    t0 = clock.now_ms()
    p = b.producer("p")
    p.send(Message("orders", b"delayed", delay_level=1))  # due at t0 + 1 s
    b.tick(t0)  # promoted ahead: offset 0, due at t0 + 1 s
    p.send(Message("orders", b"plain"))
    r = b.tick(t0 + 500)
    assert r.delivered is None or r.delivered.taken == 0  # the queue's reader stops at offset 0
    assert [o for o, _ in _index(b)] == [0, 1]
    assert _bodies(shop.log) == []
    b.tick(t0 + 1000)
    assert sorted(_bodies(shop.log)) == ["delayed", "plain"]


def test_pull_clients_of_both_kinds_see_a_copy_only_when_due(warehouse_with, clock):
    b = warehouse_with("orders", queues=1, group="workers", recorder=None).broker
    t0 = clock.now_ms()
    b.producer("p").send(Message("orders", b"soon", delay_level=1))
    b.tick(t0)  # indexed ahead, due at t0 + 1 s
    lite = PullConsumer(b.warehouse.location, "workers", "lite", config=b.config, clock=clock)
    broker_client = b.pull_consumer("workers", "spark")
    for client in (lite, broker_client):
        client.heartbeat(t0)
    assert lite.pull(10, now=t0 + 999) == [] and broker_client.pull(10, now=t0 + 999) == []
    got = lite.pull(10, now=t0 + 1000) + broker_client.pull(10, now=t0 + 1000)
    assert [m.body for m in got] == [b"soon"]


def test_a_copy_due_at_the_tick_is_delivered_in_the_same_tick(shop, clock):
    b = shop.broker
    t0 = clock.now_ms()
    b.producer("p").send(Message("orders", b"late", delay_level=1))
    r = b.tick(t0 + 60_000)  # a tick long after the due time: promote finds it due already
    assert r.job("promote").result.due_now == 1 and r.job("redeliver").rows_out == 1
    assert r.delivered.consumed == 1 and _bodies(shop.log) == ["late"]


def test_without_promoting_ahead_nothing_is_indexed_before_it_is_due(shop, clock):
    b = shop.broker
    b.reconfigure(promote_ahead_ms=0)
    t0 = clock.now_ms()
    b.producer("p").send(Message("orders", b"timer", delay=timedelta(seconds=10)))
    b.tick(t0 + 9_999)
    assert _index(b) == []
    r = b.tick(t0 + 10_000)
    assert r.job("redeliver").rows_out == 1 and _bodies(shop.log) == ["timer"]


def test_a_copy_promoted_by_clock_correction_is_visible_at_once(shop, clock):
    """An entry due implausibly late (a producer clock far ahead: due beyond now plus its
    level's delay) is due now, as RocketMQ has it; its copy is not held to that time."""
    b = shop.broker
    t0 = clock.now_ms()
    b.producer("p").send(Message("orders", b"skewed", delay_level=1))
    r = b.tick(t0 - 3_600_000)  # this tick's clock is an hour behind the producer's
    assert r.job("promote").rows_out == 1
    assert _bodies(shop.log) == ["skewed"]


def test_a_delayed_message_stored_while_a_tick_runs_keeps_its_delay(shop, clock, monkeypatch):
    """A tick reads its ``now`` once, at its start: a message stored a few ms later, before
    dispatch reads commit_log, was due after ``now`` plus its level's delay, so clock
    correction took it as due now and delivered it in that tick, its 2 h delay lost. Only
    an entry more than CLOCK_CORRECTION_SLACK_MS beyond that is corrected."""
    from deltamq.jobs import dispatch

    b = shop.broker
    t0 = clock.now_ms()
    real = dispatch.run
    sent: list[int] = []

    def run(ctx, now, **kw):
        if not sent:  # the producer sends 5 ms into the tick, before dispatch reads
            clock.set(now + 5)
            b.producer("p").send(Message("orders", b"two-hours", delay_level=18))
            sent.append(clock.now_ms())
        return real(ctx, now, **kw)

    monkeypatch.setattr(dispatch, "run", run)
    b.tick(t0)
    monkeypatch.setattr(dispatch, "run", real)
    assert _bodies(shop.log) == []
    b.tick(sent[0] + 2 * 3_600_000 - 1)
    assert _bodies(shop.log) == []
    b.tick(sent[0] + 2 * 3_600_000)
    assert _bodies(shop.log) == ["two-hours"]


@pytest.mark.unit
@pytest.mark.parametrize("value", [-1, 60_001])
def test_a_horizon_out_of_range_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=rf"promote_ahead_ms={value}.*between 0 .* and 60000"):
        BrokerConfig(promote_ahead_ms=value)


@pytest.mark.unit
def test_the_horizon_left_unset_is_the_engine_s():
    """None (the default, DELTAMQ_PROMOTE_AHEAD_MS=auto): about two busy ticks of the
    engine, 1 s on Sail and 8 s on Apache Spark, whose ticks take seconds; a value given
    is used on either."""
    from types import SimpleNamespace

    from deltamq.context import Context

    def ahead(flavor: str, config: BrokerConfig) -> int:
        engine = SimpleNamespace(flavor=flavor)
        return Context(engine, None, None, config, None).promote_ahead_ms  # type: ignore[arg-type]

    assert BrokerConfig().promote_ahead_ms is None
    assert (ahead("sail", BrokerConfig()), ahead("spark", BrokerConfig())) == (1_000, 8_000)
    assert ahead("spark", BrokerConfig(promote_ahead_ms=0)) == 0
    assert ahead("sail", BrokerConfig(promote_ahead_ms=2_500)) == 2_500
    assert BrokerConfig.from_env({"DELTAMQ_PROMOTE_AHEAD_MS": "auto"}).promote_ahead_ms is None
    assert BrokerConfig.from_env({"DELTAMQ_PROMOTE_AHEAD_MS": "8000"}).promote_ahead_ms == 8_000
    with pytest.raises(ConfigError, match=r"DELTAMQ_PROMOTE_AHEAD_MS='soon' is not an integer or auto"):
        BrokerConfig.from_env({"DELTAMQ_PROMOTE_AHEAD_MS": "soon"})
    with pytest.raises(ConfigError, match=r"promote_ahead_ms=True .* or None"):
        BrokerConfig(promote_ahead_ms=True)


def test_a_copy_is_held_to_its_due_time_whatever_pass_indexes_it(shop, clock):
    """The hold is the copy's own (its store time), not the indexing pass's setting: a
    timer promoted early by a watermark an earlier, longer horizon left ahead (and a
    promote pass that leaves the indexing to dispatch) is still handed out at its due
    time, not before."""
    from deltamq.jobs import dispatch, promote

    b = shop.broker
    t0 = clock.now_ms()
    b.reconfigure(promote_ahead_ms=5_000)
    b.producer("p").send(Message("orders", b"first", delay=timedelta(seconds=1)))
    b.tick(t0)  # the timer watermark is now t0 + 5 s
    b.reconfigure(promote_ahead_ms=0)
    clock.set(t0 + 100)
    b.producer("p").send(Message("orders", b"second", delay=timedelta(seconds=3)))  # due t0 + 3.1 s
    r = b.tick(t0 + 200)  # promoted now (due before the watermark), held in its queue
    assert r.job("promote").rows_out == 1 and "redeliver" not in [j.job for j in r.jobs]
    assert (r.delivered is None or r.delivered.consumed == 0) and _bodies(shop.log) == []
    b.tick(t0 + 1_000)
    assert _bodies(shop.log) == ["first"]
    b.tick(t0 + 3_099)
    assert _bodies(shop.log) == ["first"]
    b.tick(t0 + 3_100)
    assert _bodies(shop.log) == ["first", "second"]
    # promote alone (dispatch's lease not held): dispatch indexes the copy later, held all the same
    b.producer("p").send(Message("orders", b"third", delay_level=3))  # stored at t0 + 100: due t0 + 10.1 s
    dispatch.run(b.context, t0 + 3_100)
    b.reconfigure(promote_ahead_ms=60_000)
    assert promote.run(b.context, t0 + 3_100).rows_out == 1
    assert dispatch.run(b.context, t0 + 3_100).rows_out == 1
    assert _index(b)[-1][1] == t0 + 10_100  # carries its due time as stored


def test_a_group_created_from_the_last_offset_still_gets_a_copy_promoted_ahead(shop, clock, tmp_path):
    from support.listeners import Recorder

    b = shop.broker
    t0 = clock.now_ms()
    b.producer("p").send(Message("orders", b"soon", delay_level=1))
    b.tick(t0)  # the copy is in the queue, due at t0 + 1 s
    log = tmp_path / "late.jsonl"
    b.create_group("late", Recorder(log), consume_from="LAST_OFFSET")
    b.subscribe("late", "orders")
    b.tick(t0 + 1_000)
    assert _bodies(log) == ["soon"]  # as if it had been promoted at its due time
