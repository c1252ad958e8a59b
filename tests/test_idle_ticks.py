"""Idle ticks (orchestration/tick.py, ``skip_idle_ticks``): after a tick that found nothing
to do, the runner's ticks run no job and no statement until a table the jobs read gets a
commit, something held falls due, or its configuration changes; what was held is still
delivered at its due time, never before."""

from __future__ import annotations

from datetime import timedelta

from support.helpers import recorded_sql
from support.listeners import Recorder, read_log

from deltamq import Message


def _setup(broker, tmp_path):
    broker.create_topic("orders", queues=1)
    log = tmp_path / "calls.jsonl"
    broker.create_group("g", Recorder(log), consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    return log


def _job_runs(broker) -> int:
    return broker.sql("SELECT count(*) AS n FROM job_runs").collect()[0]["n"]


def _quiet(broker, now: int) -> None:
    """Ticks until the runner is quiet (a tick that did nothing and wrote nothing)."""
    for _ in range(4):
        broker.tick(now)
        if broker.runner.quiet is not None:
            return
    raise AssertionError("the runner never went quiet")


def test_an_idle_tick_runs_no_statement_and_records_nothing(broker, clock, tmp_path):
    _setup(broker, tmp_path)
    t0 = clock.now_ms()
    _quiet(broker, t0)
    runs = _job_runs(broker)
    with recorded_sql() as statements:
        results = [broker.tick(t0 + i) for i in range(1, 6)]
    assert statements == []
    assert all(r.idle and r.jobs == () and r.ok for r in results)
    assert "idle" in results[0].summary()
    assert _job_runs(broker) == runs


def test_a_send_ends_the_quiet_and_is_delivered_by_the_next_tick(broker, clock, tmp_path):
    log = _setup(broker, tmp_path)
    t0 = clock.now_ms()
    _quiet(broker, t0)
    broker.producer("p").send(Message("orders", b"hello"))
    r = broker.tick(t0 + 1)
    assert not r.idle and r.job("deliver").rows_out == 1
    assert [c["body"] for c in read_log(log)] == ["hello"]


def test_a_write_by_another_broker_ends_the_quiet(broker, clock, tmp_path):
    log = _setup(broker, tmp_path)
    t0 = clock.now_ms()
    _quiet(broker, t0)
    from deltamq.lite import Producer  # another writer: the Spark-free producer, its own commit

    Producer(broker.warehouse.location, "lite").send(Message("orders", b"from elsewhere"))
    assert not broker.tick(t0 + 1).idle
    assert [c["body"] for c in read_log(log)] == ["from elsewhere"]


def test_held_messages_are_delivered_at_their_due_time_never_before(broker, clock, tmp_path):
    log = _setup(broker, tmp_path)
    t0 = clock.now_ms()
    broker.producer("p").send(Message("orders", b"timer", delay=timedelta(seconds=10)))
    _quiet(broker, t0)
    ahead = broker.context.promote_ahead_ms
    assert broker.runner.quiet.until == t0 + 10_000 - ahead  # promoted ahead of its due time
    for at in (t0 + 1_000, t0 + 9_999 - ahead):
        assert broker.tick(at).idle
    r = broker.tick(t0 + 10_000 - ahead)
    assert not r.idle and r.job("promote").rows_out == 1 and r.delivered.consumed == 0
    r = broker.tick(t0 + 9_999)  # the copy is in its queue, not due: nothing is handed out
    assert r.delivered is None or r.delivered.consumed == 0
    assert broker.runner.quiet is not None and broker.runner.quiet.until == t0 + 10_000  # the copy's due time
    assert read_log(log) == []
    r = broker.tick(t0 + 10_000)
    assert not r.idle
    assert [c["body"] for c in read_log(log)] == ["timer"]


def test_the_loop_sleeps_through_idle_ticks_and_wakes_at_the_due_time(broker, clock, tmp_path):
    log = _setup(broker, tmp_path)
    t0 = clock.now_ms()
    broker.producer("p").send(Message("orders", b"delayed", delay_level=2))  # 5 s
    seen = []
    broker.runner.loop(1, for_s=8, on_tick=seen.append)
    assert [c["body"] for c in read_log(log)] == ["delayed"]
    delivered = [r.now - t0 for r in seen if not r.idle and r.job("deliver").rows_out]
    assert delivered == [5_000]
    assert sum(r.idle for r in seen) >= 3  # the seconds in between skipped their jobs


def test_a_new_configuration_or_the_setting_off_runs_every_tick(broker, clock, tmp_path):
    _setup(broker, tmp_path)
    t0 = clock.now_ms()
    _quiet(broker, t0)
    broker.reconfigure(skip_idle_ticks=False)
    assert all(not broker.tick(t0 + i).idle for i in range(1, 4))
    assert broker.runner.quiet is None


def test_a_retention_pass_falling_due_ends_the_quiet(broker, clock, tmp_path):
    _setup(broker, tmp_path)
    t0 = clock.now_ms()
    _quiet(broker, t0)
    every = broker.config.retain_interval_ms
    assert broker.tick(t0 + every - 1).idle
    r = broker.tick(t0 + every)
    assert not r.idle and r.job("retain").status == "OK"
