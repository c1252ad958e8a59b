"""The tick loop wakes when held work falls due (deltamq/jobs/wake.py), not at the next
interval: on a fake clock, whose ``sleep`` moves it, a loop with a one-minute interval
delivers a 5 s delayed message and a 10 s timer at exactly their due times."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.listeners import Recorder, read_log

from deltamq import Message


def _deliveries(broker, t0):
    rows = broker.sql(
        "SELECT now_ts, rows_out FROM job_runs WHERE job IN ('deliver', 'redeliver') AND rows_out > 0 "
        "ORDER BY now_ts"
    ).collect()
    return [(r["now_ts"] - t0, r["rows_out"]) for r in rows]


@pytest.mark.parametrize("wake", [True, False])
def test_the_loop_delivers_held_messages_when_due_not_at_the_next_interval(broker, clock, tmp_path, wake):
    broker.create_topic("orders", queues=1)
    log = tmp_path / "calls.jsonl"
    broker.create_group("g", Recorder(log), consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    t0 = clock.now_ms()
    shop = broker.producer("shop")
    shop.send(Message("orders", b"timer", delay=timedelta(seconds=10)))
    shop.send(Message("orders", b"delayed", delay_level=2))  # level 2: 5 s
    ticks = broker.runner.loop(60, for_s=120, wake_at_due=wake)
    assert sorted(c["body"] for c in read_log(log)) == ["delayed", "timer"]
    if wake:
        assert _deliveries(broker, t0) == [(5_000, 1), (10_000, 1)]
        # t0, +4 s and +9 s (each promoted promote_ahead_ms ahead), +5 s, +10 s (the due
        # times), +70 s (an interval later), +120 s
        assert ticks == 7
    else:
        assert _deliveries(broker, t0) == [(60_000, 2)]
        assert ticks == 3


def test_next_due_sees_levels_timers_and_suspended_queues(broker, clock):
    from deltamq.jobs import dispatch, wake

    broker.create_topic("orders", queues=1)
    t0 = clock.now_ms()
    ctx = broker.context
    assert wake.next_due(ctx, t0) is None
    shop = broker.producer("shop")
    shop.send(Message("orders", b"t", delay=timedelta(hours=3)))
    shop.send(Message("orders", b"d", delay_level=4))  # 30 s
    dispatch.run(broker.context, t0)
    ahead = broker.context.promote_ahead_ms  # held entries are promoted this long before due
    assert wake.next_due(ctx, t0) == t0 + 30_000 - ahead
    assert wake.next_due(ctx, t0 + 30_000) == t0 + 3 * 3_600_000 - ahead  # past the head: the timer


@pytest.mark.unit
def test_a_loop_busy_promoting_ticks_again_without_reading_the_next_due_time():
    """With work falling due densely (a promote pass handling more per ms than the tick's
    length), the next tick starts at once; a sparse pass lets the loop read the due time."""
    from deltamq.orchestration.tick import JobRun, TickResult, _due_meanwhile

    def ticked(now: int, promoted: int) -> TickResult:
        return TickResult("t", now, "me", (JobRun(job="promote", status="OK", rows_in=promoted),))

    now = 1_000_000
    assert _due_meanwhile(ticked(now, 67), now - 400, now + 400)  # 10 000 across a minute
    assert not _due_meanwhile(ticked(now, 1), now - 10_000, now + 300)  # one now and then
    assert not _due_meanwhile(ticked(now, 0), now - 400, now + 400)  # nothing due
    assert not _due_meanwhile(ticked(now, 67), None, now + 400)  # the first tick
