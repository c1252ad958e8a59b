"""Dispatch: commit order → dense offsets, routing, exactness, idle ticks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import table_versions

from deltamq import Message
from deltamq.constants import SCHEDULE_TOPIC, TIMER_TOPIC, TRANS_HALF_TOPIC, Prop, SysFlag
from deltamq.dq.conservation import check_dispatch
from deltamq.jobs import dispatch
from deltamq.tables.consume_queue import load_dispatch_state
from deltamq.tables.offsets import dispatch_hint

_PRODUCER = textwrap.dedent(
    """
    import sys, time
    from deltamq import Broker, Message
    wh, name, batches, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    b = Broker.init(wh)
    p = b.producer(name)
    time.sleep(max(0.0, start_at - time.time()))
    for i in range(batches):
        p.send_batch([Message("orders", f"{name}:{i}:{j}", keys=f"{name}:{i:04d}:{j:02d}")
                      for j in range(10)], queue_keys=[name] * 10)
    print("DONE", flush=True)
    """
)


@pytest.fixture
def orders(warehouse_with):
    return warehouse_with("orders", queues=4).broker


def _queue(broker, topic, qid):
    return broker.sql(
        f"SELECT queue_offset, msg_id, keys, due_ts, properties FROM consume_queue "
        f"WHERE topic = '{topic}' AND queue_id = {qid} ORDER BY queue_offset"
    ).collect()


@pytest.mark.slow  # subprocesses
def test_two_producer_processes_dense_offsets_in_commit_order(orders, tmp_path):
    import time

    start = time.time() + 6.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PRODUCER, str(tmp_path / "wh"), name, "15", str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("alpha", "beta")
    ]
    orders.tick()  # a dispatch while the producers are (about to be) running
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert "DONE" in out, err[-2000:]
    orders.tick()
    report = check_dispatch(orders.warehouse)
    assert report.ok, report.describe()
    assert report.stored == report.indexed == 300
    queues = orders.sql(
        "SELECT queue_id, count(*) AS n, min(queue_offset) AS lo, max(queue_offset) AS hi "
        "FROM consume_queue WHERE topic = 'orders' GROUP BY queue_id"
    ).collect()
    for q in queues:
        assert (q["lo"], q["hi"]) == (0, q["n"] - 1)
    # each producer's messages keep their send order within their queue
    for name in ("alpha", "beta"):
        rows = orders.sql(
            f"SELECT keys FROM consume_queue WHERE topic = 'orders' AND keys LIKE '{name}:%' "
            "ORDER BY queue_id, queue_offset"
        ).collect()
        keys = [r["keys"] for r in rows]
        assert keys == sorted(keys) and len(keys) == 150


def test_late_committing_producer_is_still_indexed(orders, clock):
    """A producer whose commit lands after later producers' commits (and after a dispatch)
    is indexed, after them, in commit order — whatever its clock said."""
    slow = orders.producer("slow")
    held = []
    real_append = orders.context.append_commit_log
    with pytest.MonkeyPatch.context() as mp:  # stalls the slow commit
        mp.setattr(type(orders.context), "append_commit_log", lambda _ctx, rows, what: held.append(rows))
        slow_id = slow.send(Message("orders", b"slow"), queue_key="k")
    clock.advance(seconds=5)
    fast_id = orders.producer("fast").send(Message("orders", b"fast"), queue_key="k")
    assert slow_id < fast_id  # the slow one was stored "earlier" by its clock
    orders.tick()
    real_append(held[0], what="send")  # the slow commit finally lands
    clock.advance(seconds=1)
    orders.tick()
    from deltamq.sending import queue_for_key

    rows = _queue(orders, "orders", queue_for_key("k", 4))
    assert [r["msg_id"] for r in rows] == [fast_id, slow_id]
    assert [r["queue_offset"] for r in rows] == [0, 1]
    assert check_dispatch(orders.warehouse).ok


def test_routing_delay_timer_half(orders, clock):
    p = orders.producer("p")
    now = clock.now_ms()
    plain = p.send(Message("orders", b"p"), selector=lambda n, m, a: 2)
    d3 = p.send(Message("orders", b"d", delay_level=3), selector=lambda n, m, a: 1)
    d99 = p.send(Message("orders", b"d", delay_level=99), selector=lambda n, m, a: 0)
    timer_due = now + 123_456
    t = p.send(Message("orders", b"t", properties={Prop.TIMER_DELIVER_MS: str(timer_due)}))
    _write_half_message(orders, now)
    result = orders.tick().job("dispatch")
    assert result.details["route_plain"] == 1 and result.details["route_schedule"] == 2
    assert result.details["route_timer"] == 1 and result.details["route_half"] == 1
    assert [r["msg_id"] for r in _queue(orders, "orders", 2)] == [plain]
    (s3,) = _queue(orders, SCHEDULE_TOPIC, 2)
    assert s3["msg_id"] == d3 and s3["due_ts"] == now + 10_000
    assert s3["properties"][Prop.REAL_TOPIC] == "orders" and s3["properties"][Prop.REAL_QID] == "1"
    (s18,) = _queue(orders, SCHEDULE_TOPIC, 17)
    assert s18["msg_id"] == d99 and s18["due_ts"] == now + 7_200_000
    (tm,) = _queue(orders, TIMER_TOPIC, 0)
    assert tm["msg_id"] == t and tm["due_ts"] == timer_due
    (half,) = _queue(orders, TRANS_HALF_TOPIC, 0)
    assert half["properties"][Prop.REAL_TOPIC] == "orders" and half["properties"][Prop.TRAN_MSG] == "true"
    assert half["due_ts"] is None


def _write_half_message(broker, now):
    from deltamq import ids
    from deltamq.sending import rows_to_arrow

    batch = ids.new_batch_id(now)
    mid = ids.msg_id(batch, 0)
    row = {
        "msg_id": mid,
        "topic": "orders",
        "queue_id": 3,
        "tags": None,
        "keys": None,
        "body": b"half",
        "flag": 0,
        "properties": {Prop.TRAN_MSG: "true", Prop.PGROUP: "p", Prop.DELAY: "2"},
        "born_ts": now,
        "store_ts": now,
        "reconsume_times": 0,
        "sys_flag": SysFlag.TRANSACTION_PREPARED_TYPE,
        "producer_group": "p",
        "batch_id": batch,
        "batch_pos": 0,
        "store_date": ids.store_date(now),
    }
    broker.append_commit_log(rows_to_arrow([row]), what="test")
    return mid


def test_idle_tick_commits_only_job_runs(orders, clock, tmp_path):
    orders.producer("p").send_batch([Message("orders", b"x")] * 3)
    orders.tick()
    before = table_versions(tmp_path / "wh")
    clock.advance(seconds=1)
    result = orders.tick()
    after = table_versions(tmp_path / "wh")
    assert result.job("dispatch").rows_out == 0
    changed = {t: (before[t], after[t]) for t in before if before[t] != after[t]}
    assert changed == {"job_runs": (before["job_runs"], before["job_runs"] + 1)}


def test_busy_tick_commits_once_per_table(orders, clock, tmp_path):
    """Nothing falls due here: dispatch alone works (a tick that promotes also runs the
    second dispatch of docs/design.md's order, and so commits consume_queue twice)."""
    orders.tick()
    # levels 0, 2 and 4 (plain, 5 s, 30 s): beyond promote's horizon half a second on
    orders.producer("p").send_batch([Message("orders", b"x", delay_level=(i % 3) * 2) for i in range(30)])
    before = table_versions(tmp_path / "wh")
    clock.advance(ms=500)
    orders.tick()
    after = table_versions(tmp_path / "wh")
    assert {t: after[t] - before[t] for t in before if after[t] != before[t]} == {
        "consume_queue": 1,
        "offsets": 1,
        "job_runs": 1,
    }


@pytest.mark.spark  # also on Apache Spark, where the combined MERGE is the engine's statement
def test_a_busy_tick_writes_the_hint_with_delivers_attempt_record(warehouse_with, clock, tmp_path):
    """Dispatch's hint rides on deliver's attempt record: a tick that dispatches and
    delivers commits offsets twice (attempt record, then the offsets past what was
    consumed), not three times; the hint it leaves is the index's own heads."""
    broker = warehouse_with("orders", queues=4, group="g").broker
    broker.tick()
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(20)])
    before = table_versions(tmp_path / "wh")
    clock.advance(ms=100)
    result = broker.tick()
    after = table_versions(tmp_path / "wh")
    assert result.job("deliver").result.consumed == 20
    assert after["offsets"] - before["offsets"] == 2
    version, recorded = dispatch_hint(broker.warehouse)
    assert load_dispatch_state(broker.warehouse).stale == {}
    assert sum(recorded.values()) == 20 and version >= 0


def test_the_hint_is_recorded_when_deliver_fails(warehouse_with, clock, monkeypatch):
    """Deliver fails after dispatch indexed: the hint is written on its own, so the next
    pass does not read the index past a hint that lags further each tick."""
    from deltamq.jobs import deliver

    broker = warehouse_with("orders", queues=2, group="g").broker
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(6)])
    monkeypatch.setattr(deliver, "plan", lambda *a, **k: (_ for _ in ()).throw(OSError("store down")))
    with pytest.raises(OSError, match="store down"):
        broker.tick(clock.now_ms())
    version, recorded = dispatch_hint(broker.warehouse)
    assert sum(recorded.values()) == 6 and load_dispatch_state(broker.warehouse).stale == {}


def test_rerun_after_index_commit_without_progress_repeats_nothing(orders, monkeypatch):
    p = orders.producer("p")
    p.send_batch([Message("orders", f"{i}") for i in range(20)])
    monkeypatch.setattr(dispatch, "write_progress", lambda *a, **k: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        dispatch.run(orders.context, 0)
    monkeypatch.undo()
    p.send_batch([Message("orders", f"b{i}") for i in range(8)])
    result = dispatch.run(orders.context, 0)
    assert result.rows_out == 8  # the first 20 were already indexed (progress is in the rows)
    report = check_dispatch(orders.warehouse)
    assert report.ok and report.indexed == 28, report.describe()


def test_non_append_commits_are_not_reindexed(orders, clock):
    p = orders.producer("p")
    p.send_batch([Message("orders", f"{i}") for i in range(6)])
    orders.tick()
    # an operator rewrites commit_log rows (e.g. retention): the rewrite re-adds files
    orders.engine.execute(f"UPDATE {orders.warehouse.ref('commit_log')} SET flag = 7 WHERE flag = 0")
    clock.advance(seconds=1)
    assert orders.tick().job("dispatch").rows_out == 0
    assert check_dispatch(orders.warehouse).indexed == 6


def test_offsets_continue_across_runs(orders, clock):
    p = orders.producer("p")
    for _ in range(3):
        p.send_batch([Message("orders", b"x")] * 4, queue_keys=["same"] * 4)
        orders.tick()
        clock.advance(seconds=1)
    from deltamq.sending import queue_for_key

    rows = _queue(orders, "orders", queue_for_key("same", 4))
    assert [r["queue_offset"] for r in rows] == list(range(12))
    hint = orders.sql(
        "SELECT next_offset FROM offsets WHERE consumer_group = '%DISPATCH%' AND topic = 'orders' "
        f"AND queue_id = {queue_for_key('same', 4)}"
    ).collect()
    assert hint[0]["next_offset"] == 12


@pytest.mark.plan
def test_plan_index_routes_and_numbers(spark):
    from deltamq.tables.consume_queue import plan_index

    rows = spark.createDataFrame(
        [
            ("m1", "t", 0, "A", None, {}, 1000, 0, 0, 5, 0, 10, 990),
            ("m2", "t", 0, None, None, {"DELAY": "2"}, 1000, 0, 0, 5, 1, 10, 990),
            ("m3", "t", 0, "B", None, {}, 2000, 0, 0, 7, 0, 11, 1990),
            ("m4", "t", 1, None, None, {"TIMER_DELIVER_MS": "99999"}, 2000, 0, 0, 7, 1, 11, 1990),
            ("m5", "t", 0, None, None, {"DELAY": "x"}, 3000, 0, 0, 9, 0, 12, 2990),
            ("m6", "t", 1, None, None, {"TRAN_MSG": "true"}, 3000, 0, 4, 9, 1, 12, 2990),
        ],
        "msg_id string, topic string, queue_id int, tags string, keys string, properties map<string,string>, "
        "store_ts bigint, reconsume_times int, sys_flag int, cl_version bigint, batch_pos bigint, "
        "batch_id bigint, born_ts bigint",
    )
    heads = spark.createDataFrame([("t", 0, 40)], "topic string, queue_id int, next_offset bigint")
    out = {r["msg_id"]: r for r in plan_index(rows, heads, [(1, 1000), (2, 5000)]).collect()}
    assert (out["m1"]["topic"], out["m1"]["queue_id"], out["m1"]["queue_offset"]) == ("t", 0, 40)
    assert (out["m3"]["queue_offset"], out["m5"]["queue_offset"]) == (41, 42)  # bad DELAY: plain
    assert (out["m2"]["topic"], out["m2"]["queue_id"], out["m2"]["due_ts"]) == (SCHEDULE_TOPIC, 1, 6000)
    assert (out["m4"]["topic"], out["m4"]["due_ts"], out["m4"]["route"]) == (TIMER_TOPIC, 99999, "timer")
    assert (out["m6"]["topic"], out["m6"]["route"]) == (TRANS_HALF_TOPIC, "half")
    assert out["m6"]["born_ts"] == 2990  # check-back ages come from the index
    assert out["m1"]["tags_hash"] is not None and out["m2"]["tags_hash"] is None


def test_heads_a_killed_pass_left_out_of_the_hint_are_kept_by_the_next_pass(broker, clock, monkeypatch):
    """A pass killed between its index commit and its hint: the next pass finds those
    rows in the index tail and, indexing something new, writes them into the hint with
    its own, so a third pass never gives their offsets out again."""
    broker.create_topic("two", queues=2)
    p = broker.producer("p")
    wh, t = broker.warehouse, clock.now_ms()

    def send(body: str, q: int) -> None:
        p.send_batch([Message("two", body)], selector=lambda n, m, a: a, arg=q)

    send("a", 0)
    with monkeypatch.context() as m:  # the hint's commit never happens
        m.setattr(dispatch, "write_progress", lambda *a, **k: None)
        dispatch.run(broker.context, t)
    send("b", 1)
    dispatch.run(broker.context, t + 1)  # the index tail (queue 0) and a new commit (queue 1)
    send("c", 0)
    dispatch.run(broker.context, t + 2)
    rows = broker.sql("SELECT queue_id, queue_offset FROM consume_queue WHERE topic = 'two'").collect()
    assert sorted((r["queue_id"], r["queue_offset"]) for r in rows) == [(0, 0), (0, 1), (1, 0)]
    report = check_dispatch(wh)
    assert report.ok, report.describe()


@pytest.mark.unit
def test_a_batch_spread_over_the_files_of_one_commit_needs_no_repeat_check():
    """An engine write stores a large batch as several files of one commit: each row once,
    so dispatch skips the search for repeated rows (a window over every new row: 1.1 s of
    4.9 for 1M, and 2 s more in the index statement). The same batch in two commits is
    what an ambiguous commit written again leaves: checked."""
    from deltamq.tables.commit_log import batch_ids
    from deltamq.tables.deltalog import AddedFile, Commit

    def f(batch: int | None, n: int = 10) -> AddedFile:
        stats = {} if batch is None else {"batch_id": batch}
        return AddedFile(f"/t/{batch}-{n}.parquet", {}, n, stats, dict(stats))

    one_commit = [Commit(1, "WRITE", (f(7, 1), f(7, 2), f(7, 3)), 0), Commit(2, "WRITE", (f(8),), 0)]
    assert batch_ids(one_commit) == ({7, 8}, True)
    again = [Commit(1, "WRITE", (f(7, 1),), 0), Commit(2, "WRITE", (f(7, 2),), 0)]
    assert batch_ids(again) == ({7}, False)
    no_stats = [Commit(1, "WRITE", (f(7), f(None)), 0)]
    assert batch_ids(no_stats) == ({7}, False)
