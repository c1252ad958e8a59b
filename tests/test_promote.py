"""Delay levels and timers (docs/behaviour.md §2), driven by a fake clock."""

from __future__ import annotations

from datetime import timedelta

import pytest
from conftest import table_versions
from support.helpers import append_half_with_delay, hint_matches_the_index

from deltamq import Broker, Message
from deltamq.config import parse_levels
from deltamq.constants import DEFAULT_LEVELS, SCHEDULE_TOPIC, TRANS_HALF_TOPIC, Prop
from deltamq.errors import InvalidTimer


@pytest.fixture
def orders(warehouse_with):
    """Promote passes at the due times these tests name; promoting ahead
    (``promote_ahead_ms``) is tested in tests/test_promote_ahead.py."""
    b = warehouse_with("orders", queues=2).broker
    b.reconfigure(promote_ahead_ms=0)
    return b


def _visible(broker, topic="orders"):
    """Bodies visible to consumers at the last tick: rows in the real topic's consume
    queue, less copies promoted ahead that are not due yet at that tick's now."""
    rows = broker.sql(
        f"SELECT CAST(c.body AS STRING) AS body, q.queue_id, q.queue_offset FROM consume_queue q "
        f"JOIN commit_log c ON c.msg_id = q.msg_id WHERE q.topic = '{topic}' "
        "AND (q.due_ts IS NULL OR q.due_ts <= coalesce((SELECT max(now_ts) FROM job_runs), q.due_ts)) "
        "ORDER BY q.queue_id, q.queue_offset"
    ).collect()
    return [r["body"] for r in rows]


@pytest.mark.slow
def test_every_default_level_is_promoted_exactly_at_its_due_time(orders, clock):
    t0 = clock.now_ms()
    levels = parse_levels(DEFAULT_LEVELS)
    orders.producer("p").send_batch([Message("orders", f"L{lvl}", delay_level=lvl) for lvl, _, _ in levels])
    orders.tick(t0)
    assert _visible(orders) == []
    for lvl, delay_ms, _ in levels:
        due = t0 + delay_ms
        orders.tick(due - 1)
        assert f"L{lvl}" not in _visible(orders), f"level {lvl} visible 1 ms early"
        result = orders.tick(due)
        assert f"L{lvl}" in _visible(orders), f"level {lvl} not visible at its due time"
        assert result.job("promote").details[f"level_{lvl}"] == 1
    assert len(_visible(orders)) == 18


@pytest.mark.story
def test_promoted_message_is_a_new_message_without_delay_properties(orders, clock):
    t0 = clock.now_ms()
    original = orders.producer("p").send(
        Message("orders", b"x", tags="T", keys="k1", delay_level=3, properties={"a": "b"}),
        selector=lambda n, m, arg: 1,
    )
    orders.tick(t0)
    orders.tick(t0 + 10_000)
    row = orders.sql(
        "SELECT c.msg_id, c.topic, c.queue_id, c.tags, c.keys, c.properties, c.store_ts, c.born_ts "
        "FROM consume_queue q JOIN commit_log c ON c.msg_id = q.msg_id WHERE q.topic = 'orders'"
    ).collect()[0]
    assert row["msg_id"] != original
    assert (row["topic"], row["queue_id"], row["tags"], row["keys"]) == ("orders", 1, "T", "k1")
    assert row["properties"] == {"a": "b", Prop.UNIQ_KEY: original}
    assert row["store_ts"] == t0 + 10_000 and row["born_ts"] == t0


def test_level_above_maximum_behaves_as_the_maximum(orders, clock):
    t0 = clock.now_ms()
    orders.producer("p").send_batch(
        [Message("orders", "L19", delay_level=19), Message("orders", "L18", delay_level=18)]
    )
    orders.tick(t0)
    q = orders.sql(
        f"SELECT count(*) AS n FROM consume_queue WHERE topic = '{SCHEDULE_TOPIC}' AND queue_id = 17"
    )
    assert q.collect()[0]["n"] == 2
    orders.tick(t0 + 7_200_000 - 1)
    assert _visible(orders) == []
    orders.tick(t0 + 7_200_000)
    assert sorted(_visible(orders)) == ["L18", "L19"]


def test_custom_level_string(tmp_path, clock):
    b = Broker.init(tmp_path / "custom", clock=clock, levels="1s 2s 4s")
    b.create_topic("t")
    t0 = clock.now_ms()
    b.producer("p").send_batch([Message("t", f"L{i}", delay_level=i) for i in (1, 2, 3, 7)])
    b.tick(t0)
    b.tick(t0 + 2000)
    assert sorted(_visible(b, "t")) == ["L1", "L2"]
    b.tick(t0 + 4000)
    assert sorted(_visible(b, "t")) == ["L1", "L2", "L3", "L7"]  # level 7 clamps to 3 (4s)


def test_fifo_per_level(orders, clock):
    p = orders.producer("p")
    t0 = clock.now_ms()
    for i in range(5):
        p.send(Message("orders", f"m{i}", delay_level=2), selector=lambda n, m, arg: 0)
        clock.advance(ms=100)
    orders.tick()
    orders.tick(t0 + 5000 + 250)  # the first three are due
    assert _visible(orders) == ["m0", "m1", "m2"]
    orders.tick(t0 + 5000 + 1000)
    assert _visible(orders) == ["m0", "m1", "m2", "m3", "m4"]


def test_pass_stops_at_first_entry_not_yet_due(orders, clock):
    """Stored out of due order (a producer with a fast clock): the later entries wait
    behind the first one not yet due, as in RocketMQ."""
    p = orders.producer("p")
    t0 = clock.now_ms()
    p.send(Message("orders", "early", delay_level=1))
    clock.set(t0 + 500)
    p.send(Message("orders", "ahead", delay_level=1))  # due t0 + 1500
    clock.set(t0)
    p.send(Message("orders", "behind", delay_level=1))  # due t0 + 1000, queued after "ahead"
    orders.tick(t0)
    orders.tick(t0 + 1000)
    assert _visible(orders) == ["early"]
    orders.tick(t0 + 1500)
    assert sorted(_visible(orders)) == ["ahead", "behind", "early"]


def test_clock_correction_due_beyond_now_plus_delay_is_due_now(orders, clock):
    t0 = clock.now_ms()
    clock.set(t0 + 3_600_000)  # this producer's clock is an hour ahead
    orders.producer("p").send(Message("orders", "skewed", delay_level=2))  # due t0 + 1h + 5s
    orders.tick(t0)
    assert _visible(orders) == ["skewed"]  # due > now + 5s: treated as due now


def test_half_topic_entry_is_skipped(orders, clock):
    t0 = clock.now_ms()
    append_half_with_delay(orders, t0)
    orders.producer("p").send(Message("orders", "after", delay_level=1))
    orders.tick(t0)
    result = orders.tick(t0 + 1000).job("promote")
    assert result.details["skipped_half"] == 1 and result.rows_out == 1
    assert _visible(orders) == ["after"] and _visible(orders, TRANS_HALF_TOPIC) == []
    offs = orders.sql(
        f"SELECT next_offset FROM offsets WHERE consumer_group = '%PROMOTE%' AND topic = '{SCHEDULE_TOPIC}'"
    ).collect()
    assert offs[0]["next_offset"] == 2  # moved past the skipped entry


def test_timer_beyond_the_horizon_is_refused(orders, clock, tmp_path):
    before = table_versions(tmp_path / "wh")
    p = orders.producer("p")
    with pytest.raises(InvalidTimer, match="400.0 days ahead"):
        p.send(Message("orders", b"x", delay=timedelta(days=400)))
    with pytest.raises(InvalidTimer, match="in the past"):
        p.send(Message("orders", b"x", deliver_at=clock.now_ms() - 366 * 86_400_000))
    with pytest.raises(InvalidTimer, match="epoch milliseconds"):
        p.send(Message("orders", b"x", properties={Prop.TIMER_DELIVER_MS: "soon"}))
    with pytest.raises(InvalidTimer, match="one of"):
        p.send(Message("orders", b"x", delay=timedelta(seconds=1), deliver_at=clock.now_ms()))
    df = orders.engine.spark.createDataFrame(
        [("orders", "x", clock.now_ms() + 400 * 86_400_000)],
        "topic string, body string, deliver_at_ms bigint",
    )
    with pytest.raises(InvalidTimer, match="days ahead"):
        p.send_dataframe(df)
    assert table_versions(tmp_path / "wh") == before


@pytest.mark.story(s3="slow")
def test_timers_in_30_days_and_in_1_5_seconds(orders, clock):
    t0 = clock.now_ms()
    p = orders.producer("p")
    p.send(Message("orders", "soon", delay=timedelta(milliseconds=1500)))
    p.send(Message("orders", "month", deliver_at=t0 + 30 * 86_400_000))
    orders.tick(t0)
    orders.tick(t0 + 1499)
    assert _visible(orders) == []
    orders.tick(t0 + 1500)
    assert _visible(orders) == ["soon"]
    orders.tick(t0 + 30 * 86_400_000 - 1)
    assert _visible(orders) == []  # "soon" was stored 30 days ago: retention (72 h) removed it
    result = orders.tick(t0 + 30 * 86_400_000)
    # the held timer stayed through retention, body included, and is promoted on time
    assert _visible(orders) == ["month"] and result.job("promote").details["timers"] == 1


def test_late_timer_sent_after_the_watermark_passed_its_due(orders, clock):
    t0 = clock.now_ms()
    p = orders.producer("p")
    p.send(Message("orders", "first", delay=timedelta(seconds=1)))
    orders.tick(t0)
    orders.tick(t0 + 5000)  # watermark moves to t0 + 5s
    assert _visible(orders) == ["first"]
    clock.set(t0 + 5000)
    p.send(Message("orders", "late", deliver_at=t0 + 2000))  # already overdue when sent
    orders.tick(t0 + 5001)
    assert sorted(_visible(orders)) == ["first", "late"]


def test_dataframe_timers_and_levels(orders, clock):
    t0 = clock.now_ms()
    df = orders.engine.spark.createDataFrame(
        [("orders", "a", t0 + 2500, None), ("orders", "b", None, 2), ("orders", "c", None, None)],
        "topic string, body string, deliver_at_ms bigint, delay_level int",
    )
    orders.producer("p").send_dataframe(df)
    orders.tick(t0)
    assert _visible(orders) == ["c"]
    orders.tick(t0 + 2500)
    assert sorted(_visible(orders)) == ["a", "c"]
    orders.tick(t0 + 5000)
    assert sorted(_visible(orders)) == ["a", "b", "c"]


def test_arrow_timers_and_levels(orders, clock):
    import pyarrow as pa

    t0 = clock.now_ms()
    table = pa.table(
        {
            "topic": ["orders"] * 4,
            "body": ["a", "b", "c", "d"],
            "deliver_at_ms": [t0 + 2500, None, None, None],
            "delay_level": [None, 2, None, 0],
            "properties": pa.array(
                [None, None, [("TIMER_DELIVER_MS", str(t0 + 1500))], [("trace", "t-4")]],
                pa.map_(pa.string(), pa.string()),
            ),
        }
    )
    orders.producer("p").send_arrow(table)
    orders.tick(t0)
    assert _visible(orders) == ["d"]
    orders.tick(t0 + 1499)
    assert _visible(orders) == ["d"]
    orders.tick(t0 + 2500)
    assert sorted(_visible(orders)) == ["a", "c", "d"]
    orders.tick(t0 + 4999)
    assert "b" not in _visible(orders)
    orders.tick(t0 + 5000)
    assert sorted(_visible(orders)) == ["a", "b", "c", "d"]


def test_idle_promote_commits_nothing(orders, clock, tmp_path):
    orders.producer("p").send_batch(
        [Message("orders", b"x", delay_level=18), Message("orders", b"t", delay=timedelta(days=3))]
    )
    orders.tick()
    before = table_versions(tmp_path / "wh")
    clock.advance(seconds=30)
    orders.tick()
    after = table_versions(tmp_path / "wh")
    assert {t for t in before if before[t] != after[t]} == {"job_runs"}


def test_rerun_after_output_without_offsets_writes_nothing_twice(orders, clock, monkeypatch):
    from deltamq.jobs import promote

    t0 = clock.now_ms()
    orders.producer("p").send_batch([Message("orders", f"m{i}", delay_level=1) for i in range(10)])
    orders.tick(t0)
    monkeypatch.setattr(promote, "write_progress", lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        orders.tick(t0 + 1000)
    monkeypatch.undo()
    result = orders.tick(t0 + 1000)
    assert result.job("promote").details["already_stored"] == 10 and result.job("promote").rows_out == 0
    assert sorted(_visible(orders)) == sorted(f"m{i}" for i in range(10))


@pytest.mark.plan
def test_plan_due_takes_only_the_consecutive_head(spark):
    from deltamq.jobs.promote import plan_due

    rows = [
        (SCHEDULE_TOPIC, 0, 5, 100, {"REAL_TOPIC": "t"}),
        (SCHEDULE_TOPIC, 0, 6, 200, {"REAL_TOPIC": "t"}),
        (SCHEDULE_TOPIC, 0, 8, 300, {"REAL_TOPIC": "t"}),  # 7 not due: 8 waits
        (SCHEDULE_TOPIC, 1, 0, 100, {"REAL_TOPIC": TRANS_HALF_TOPIC}),
        ("rmq_sys_wheel_timer", 0, 3, 50, {"REAL_TOPIC": "t"}),
    ]
    cands = spark.createDataFrame(
        rows, "topic string, queue_id int, queue_offset bigint, due_ts bigint, properties map<string,string>"
    )
    base = spark.createDataFrame([(0, 5)], "queue_id int, next_offset bigint")
    out = sorted(
        (r["topic"], r["queue_id"], r["queue_offset"], r["skip"], r["kind"])
        for r in plan_due(cands, base).collect()
    )
    assert out == [
        (SCHEDULE_TOPIC, 0, 5, False, 1),
        (SCHEDULE_TOPIC, 0, 6, False, 1),
        (SCHEDULE_TOPIC, 1, 0, True, 2),
        ("rmq_sys_wheel_timer", 0, 3, False, 0x1000),
    ]


def test_status_shows_levels_and_timers(orders, clock):
    t0 = clock.now_ms()
    p = orders.producer("p")
    p.send_batch([Message("orders", "a", delay_level=3), Message("orders", "b", delay_level=3)])
    p.send(Message("orders", "t", deliver_at=t0 + 2 * 86_400_000))
    orders.tick(t0)
    st = orders.status()
    level3 = st["levels"][2]
    got = (level3["level"], level3["pending"], level3["oldest_due"], level3["offset"])
    assert got == (3, 2, t0 + 10_000, 0)
    assert st["timers"] == [{"due_day": "2026-01-03", "pending": 1, "first_due": t0 + 2 * 86_400_000}]
    orders.tick(t0 + 10_000)
    level3 = orders.status()["levels"][2]
    assert (level3["pending"], level3["offset"]) == (0, 2)


def test_a_tick_indexes_the_copies_in_the_promote_pass_as_dispatch_would(orders, clock):
    from deltamq.dq.conservation import check_dispatch
    from deltamq.jobs import dispatch
    from deltamq.tables import deltalog

    t0 = clock.now_ms()
    p = orders.producer("p")
    p.send_batch([Message("orders", f"plain{i}") for i in range(6)])
    p.send_batch(
        [Message("orders", f"d{i}", delay_level=1) for i in range(5)]
        + [Message("orders", f"t{i}", delay=timedelta(seconds=1)) for i in range(5)]
    )
    orders.tick(t0)
    result = orders.tick(t0 + 1000)
    promoted = result.job("promote")
    assert promoted.rows_out == promoted.details["indexed"] == 10
    assert "redispatch" not in [j.job for j in result.jobs]  # no second dispatch
    wh = orders.warehouse
    report = check_dispatch(wh)
    assert report.ok, report.describe()
    # the index rows carry the copies' commit_log version, as dispatch's do, and the hint
    # moved with promote's progress: dispatch finds nothing left to index
    copies = orders.sql(
        "SELECT cl_version, count(*) AS n FROM consume_queue WHERE topic = 'orders' AND cl_version = "
        "(SELECT max(cl_version) FROM consume_queue) GROUP BY 1"
    ).collect()
    assert [(r["cl_version"], r["n"]) for r in copies] == [
        (deltalog.latest_version(wh.storage, wh.uri("commit_log")), 10)
    ]
    hint_matches_the_index(orders)
    assert dispatch.run(orders.context, t0 + 1000).rows_out == 0
    assert sorted(_visible(orders)) == sorted(
        [f"plain{i}" for i in range(6)] + [f"d{i}" for i in range(5)] + [f"t{i}" for i in range(5)]
    )


def test_a_commit_between_dispatch_and_the_copies_leaves_their_index_to_dispatch(orders, clock, monkeypatch):
    from deltamq import faults
    from deltamq.dq.conservation import check_dispatch

    t0 = clock.now_ms()
    p = orders.producer("p")
    p.send_batch([Message("orders", f"d{i}", delay_level=2) for i in range(5)])  # due in 5 s
    orders.tick(t0)  # promotes 1 s ahead: nothing yet
    real_point = faults.point

    def point(name: str) -> None:  # a producer commits after dispatch, before promote's copies
        if name == "promote.before_output_commit":
            p.send(Message("orders", "between"))
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    result = orders.tick(t0 + 5000)
    monkeypatch.undo()
    assert result.job("promote").rows_out == 5 and result.job("promote").details["indexed"] == 0
    assert result.job("redispatch").rows_out == 6  # the producer's message, then the copies
    report = check_dispatch(orders.warehouse)
    assert report.ok, report.describe()
    hint_matches_the_index(orders)
    assert sorted(_visible(orders)) == sorted(["between"] + [f"d{i}" for i in range(5)])


def test_promote_alone_leaves_the_index_to_dispatch(orders, clock):
    from deltamq.jobs import dispatch, promote

    t0 = clock.now_ms()
    orders.producer("p").send_batch([Message("orders", f"d{i}", delay_level=1) for i in range(3)])
    dispatch.run(orders.context, t0)
    r = promote.run(orders.context, t0 + 1000)  # indexes=False: dispatch's lease is not ours
    assert r.rows_out == 3 and r.indexed == 0 and _visible(orders) == []
    assert dispatch.run(orders.context, t0 + 1000).rows_out == 3
    assert sorted(_visible(orders)) == ["d0", "d1", "d2"]


def test_a_runner_remembers_promote_state_and_an_older_memory_writes_nothing_twice(orders, clock):
    from support.helpers import recorded_sql

    from deltamq.dq.conservation import check_dispatch
    from deltamq.jobs import dispatch, promote

    t0 = clock.now_ms()
    p = orders.producer("p")
    p.send_batch([Message("orders", f"a{i}", delay_level=1) for i in range(4)])
    orders.tick(t0)
    orders.tick(t0 + 1000)  # promotes a*: the runner remembers the state it committed
    with recorded_sql() as statements:
        orders.tick(t0 + 2000)
    assert not any("'%PROMOTE%'" in s for s in statements)  # the state was not read
    # another runner's pass moves the table past the memory: the next pass starts from
    # the older state and finds those copies already stored
    p.send_batch([Message("orders", f"b{i}", delay_level=1) for i in range(3)])
    dispatch.run(orders.context, t0 + 2000)
    assert promote.run(orders.context, t0 + 3000).rows_out == 3
    dispatch.run(orders.context, t0 + 3000)
    result = orders.tick(t0 + 4000)
    assert result.job("promote").rows_out == 0 and result.job("promote").details["already_stored"] == 3
    report = check_dispatch(orders.warehouse)
    assert report.ok, report.describe()
    assert sorted(_visible(orders)) == sorted([f"a{i}" for i in range(4)] + [f"b{i}" for i in range(3)])


def test_a_runner_forgets_promote_state_once_another_runner_held_the_lease(orders, clock, monkeypatch):
    from deltamq.jobs import promote
    from deltamq.orchestration.tick import TickRunner

    loads: list[int] = []
    real_load = promote.load_state

    def load_state(wh):  # the state read from the table (the runner's memory not used)
        loads.append(1)
        return real_load(wh)

    monkeypatch.setattr(promote, "load_state", load_state)

    t0 = clock.now_ms()
    orders.producer("p").send_batch([Message("orders", f"a{i}", delay_level=1) for i in range(4)])
    orders.tick(t0)
    orders.tick(t0 + 1000)  # promotes: the runner remembers the state it committed
    orders.runner.release()
    other = TickRunner(orders.context, holder="other")
    other.tick(t0 + 2000)  # the leases at a new epoch: promote may have moved meanwhile
    other.release()
    loads.clear()
    orders.tick(t0 + 3000)
    assert loads  # read again, not remembered
    loads.clear()
    orders.tick(t0 + 4000)
    assert not loads  # its own lease since: remembered


def test_a_late_copy_from_a_pass_killed_before_midnight_is_not_written_again_after(orders, clock):
    """A late entry's copy is stored at its pass's now: a pass killed after writing it at
    23:59:59 and run again after midnight (another now, another day) finds it on the day
    before and writes no second copy."""
    from support.crash import Crashed, crash_at

    from deltamq.jobs import dispatch, promote

    t0 = clock.now_ms()  # midnight
    orders.producer("p").send(Message("orders", "late", deliver_at=t0 - 3_600_000))
    dispatch.run(orders.context, t0)
    before_midnight = t0 + 86_400_000 - 1
    with crash_at("promote.after_output_commit"), pytest.raises(Crashed):
        promote.run(orders.context, before_midnight)
    result = promote.run(orders.context, before_midnight + 2)
    assert result.details["already_stored"] == 1, result.details
    orders.tick(before_midnight + 3)
    assert _visible(orders) == ["late"]
    copies = orders.sql(f"SELECT store_ts FROM commit_log WHERE topic = 'orders' AND store_ts > {t0}")
    assert [r["store_ts"] for r in copies.collect()] == [before_midnight]
