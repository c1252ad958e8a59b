"""Promote's reads and copies from the tables' files (deltamq/jobs/promote_files.py) give
what the engine's plan gives, on the same warehouse at the same moment."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.helpers import append_half_with_delay

from deltamq import Message
from deltamq.jobs import dispatch, promote, promote_files
from deltamq.tables.bodies import read_bodies, stored_ids
from deltamq.tables.ranges import merge_ranges

_ENTRY = ("topic", "queue_id", "queue_offset", "msg_id", "due_ts", "kind", "skip", "store_at", "cl_batch_id")


@pytest.fixture
def orders(warehouse_with):
    b = warehouse_with("orders", queues=2).broker
    b.reconfigure(promote_ahead_ms=0)
    return b


def _both(broker, now, until):
    """(files, engine): the due entries, the summary rows and the copies' rows, each
    keyed for comparison."""
    ctx, wh = broker.context, broker.warehouse
    state, levels = promote.load_state(wh), wh.levels()
    found = promote_files.due_entries(
        wh, state.level_offsets, state.timer_watermark, state.timer_next_offset, levels, now, until
    )
    assert found is not None  # plain tables: the files are read
    entries, timer_hi = found
    due = promote._due(ctx, state, levels, now, until)
    engine_entries = [r.asDict() for r in due.collect()]
    files_summary = promote_files.summary_rows(entries, timer_hi)
    engine_summary = [r.asDict() for r in promote._summary(wh, state, due).collect()]
    s = promote._summarise(engine_summary, now)
    ranges = merge_ranges([k[2] for k in s.keys], gap=60_000)
    stored = {r["msg_id"] for r in stored_ids(wh, ranges).collect()} if ranges else set()
    assert (promote_files.stored_ids(wh, ranges) if ranges else set()) == stored
    bodies = read_bodies(wh, (k[1] for k in s.keys), (k[0] for k in s.keys))
    engine_copies = promote.plan_messages(due, bodies).collect() if s.keys else []
    files_copies = promote_files.copies(wh, entries, set())
    assert files_copies is not None

    def entry_key(e):
        return tuple(e[k] for k in _ENTRY) + (dict(e["properties"] or {}),)

    def summary_key(r):
        return tuple(sorted((k, str(v)) for k, v in r.items()))

    def copy_key(r):
        def plain(k, v):
            return dict(v) if k == "properties" else bytes(v) if k == "body" else v

        return (r["msg_id"], tuple(sorted((k, str(plain(k, v))) for k, v in r.items())))

    return (
        sorted(map(entry_key, entries), key=str),
        sorted(map(summary_key, files_summary)),
        sorted(map(copy_key, files_copies.to_pylist())),
    ), (
        sorted(map(entry_key, engine_entries), key=str),
        sorted(map(summary_key, engine_summary)),
        sorted(copy_key(r.asDict()) for r in engine_copies),
    )


def test_the_files_give_the_engines_due_entries_summary_and_copies(orders, clock):
    t0 = clock.now_ms()
    p = orders.producer("p")
    append_half_with_delay(orders, t0)  # the head of level 1
    clock.set(t0 + 3_600_000)  # a producer whose clock is an hour ahead: clock correction
    p.send(Message("orders", "skewed", delay_level=2))  # the head of level 2
    clock.set(t0)
    p.send_batch([Message("orders", f"L1-{i}", delay_level=1, tags="T", keys=f"k{i}") for i in range(3)])
    p.send_batch([Message("orders", f"L2-{i}", delay_level=2, properties={"a": str(i)}) for i in range(2)])
    p.send(Message("orders", "L3", delay_level=3))
    p.send_batch(
        [
            Message("orders", "t2", delay=timedelta(seconds=2)),
            Message("orders", "t3", deliver_at=t0 + 3_600),
            Message("orders", "t-hour", delay=timedelta(hours=1)),
        ]
    )
    dispatch.run(orders.context, t0)  # the schedule and timer entries indexed, none promoted
    for now, until in ((t0 + 500, t0 + 500), (t0 + 3_000, t0 + 4_000), (t0 + 6_000, t0 + 11_000)):
        files, engine = _both(orders, now, until)
        assert files == engine
        assert files[0]  # the comparison is not of nothing
    # a pass that moved the levels and the watermark, then a timer sent late (its due time
    # behind the watermark) and more entries behind the saved offsets
    orders.tick(t0 + 3_000)
    clock.set(t0 + 4_000)
    p.send(Message("orders", "late", deliver_at=t0 + 2_000))
    p.send_batch([Message("orders", f"L1b-{i}", delay_level=1) for i in range(2)])
    orders.tick(t0 + 4_000)
    files, engine = _both(orders, t0 + 5_000, t0 + 5_500)
    assert files == engine and files[2]


def test_a_tick_promotes_through_the_files_and_the_engine_alike(orders, clock, monkeypatch):
    """The same sends, promoted by the files path and (files refused) the engine's: the
    same copies consumed, in the same queues, with the same store times."""

    def run(broker, topic, t0):
        clock.set(t0)
        broker.create_topic(topic, queues=2)
        p = broker.producer("p")
        p.send_batch([Message(topic, f"{topic}-L{lvl}", delay_level=lvl) for lvl in (1, 2, 3)])
        p.send(Message(topic, f"{topic}-t", delay=timedelta(seconds=4)))
        broker.tick(t0)
        for dt in (1_000, 4_000, 5_000, 10_000):
            broker.tick(t0 + dt)
        rows = broker.sql(
            f"SELECT CAST(c.body AS STRING) AS body, c.queue_id, c.store_ts, q.queue_offset, q.due_ts "
            f"FROM consume_queue q JOIN commit_log c ON c.msg_id = q.msg_id WHERE q.topic = '{topic}'"
        ).collect()
        return sorted((r["body"].split("-", 1)[1], r["store_ts"] - t0, r["due_ts"] - t0) for r in rows)

    t0 = clock.now_ms()
    by_files = run(orders, "viaFiles", t0)
    monkeypatch.setattr(promote_files, "due_entries", lambda *a, **k: None)
    by_engine = run(orders, "viaEngine", t0 + 60_000)
    assert by_files == by_engine
    assert [b for b, _, _ in by_files] == ["L1", "L2", "L3", "t"]


def test_a_backlog_falling_due_at_once_is_the_engines(orders, clock, monkeypatch):
    """Above MAX_ENTRIES candidates the files' way steps aside (Python per entry) and the
    engine's statements promote them: everything still arrives once."""
    monkeypatch.setattr(promote_files, "MAX_ENTRIES", 3)
    t0 = clock.now_ms()
    orders.producer("p").send_batch([Message("orders", f"m{i}", delay_level=1) for i in range(5)])
    orders.tick(t0)
    wh = orders.warehouse
    state = promote.load_state(wh)
    args = (state.level_offsets, state.timer_watermark, state.timer_next_offset, wh.levels())
    assert promote_files.due_entries(wh, *args, t0 + 1_000, t0 + 1_000) is None
    result = orders.tick(t0 + 1_000).job("promote")
    assert result.rows_out == 5
    rows = orders.sql(
        "SELECT count(*) AS n, count(DISTINCT msg_id) AS d FROM consume_queue WHERE topic = 'orders'"
    )
    assert rows.collect()[0].asDict() == {"n": 5, "d": 5}


def _killed_before_its_progress(broker, monkeypatch, now: int) -> None:
    """A tick at ``now`` whose promote pass dies after its copies, before its progress."""
    with monkeypatch.context() as m:
        m.setattr(promote, "write_progress", lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
        with pytest.raises(OSError):
            broker.tick(now)


@pytest.mark.parametrize("way", ["files", "engine"])
def test_a_copy_written_again_across_midnight_is_indexed_once(orders, clock, monkeypatch, way):
    """A pass corrects an entry (a producer two minutes ahead) just before midnight and is
    killed after writing the copy; the pass after midnight no longer corrects it, looks for
    its copy from the entry's store day on, misses the copy stored the day before and
    writes it again. That second write must not be indexed a second time (promote indexed
    its own commit without dispatch's check for messages already indexed)."""
    if way == "engine":
        monkeypatch.setattr(promote_files, "due_entries", lambda *a, **k: None)
    midnight = clock.now_ms() + 86_400_000
    t1 = midnight - 10_000
    orders.tick(t1 - 60_000)
    clock.set(midnight + 120_000)  # the producer's clock: after midnight, two minutes ahead
    orders.producer("p").send(Message("orders", "late-night", delay_level=1))
    clock.set(t1)
    _killed_before_its_progress(orders, monkeypatch, t1)
    orders.tick(midnight + 125_000)
    orders.tick(midnight + 126_000)
    copies = orders.sql(
        "SELECT msg_id, count(*) AS n FROM consume_queue WHERE topic = 'orders' GROUP BY msg_id"
    ).collect()
    assert [r["n"] for r in copies] == [1], copies


@pytest.mark.parametrize("way", ["files", "engine"])
def test_a_clock_corrected_copy_written_before_a_kill_is_not_written_again(orders, clock, monkeypatch, way):
    """A copy promoted by clock correction is stored at ``now``, not on its due day: the
    look-up of copies already stored covers the days they are stored on (a producer
    clock a day ahead, then a pass killed between its output and its progress)."""
    if way == "engine":
        monkeypatch.setattr(promote_files, "due_entries", lambda *a, **k: None)
    t0 = clock.now_ms()
    clock.set(t0 + 86_400_000)  # a producer a day ahead
    orders.producer("p").send(Message("orders", "skewed", delay_level=2))
    clock.set(t0)
    _killed_before_its_progress(orders, monkeypatch, t0)
    result = orders.tick(t0 + 1).job("promote")
    assert (result.rows_out, result.details["already_stored"]) == (0, 1)
    rows = orders.sql(
        "SELECT count(*) AS n, count(DISTINCT msg_id) AS d FROM commit_log WHERE topic = 'orders'"
    )
    assert rows.collect()[0].asDict() == {"n": 2, "d": 2}  # the message and one copy
