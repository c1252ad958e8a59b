"""Push consumption, retry with back-off, dead letters, poison isolation (docs/behaviour.md §3)."""

from __future__ import annotations

import pytest
from support.listeners import Recorder, read_log

from deltamq import Message
from deltamq.config import parse_levels
from deltamq.constants import DEFAULT_LEVELS, FailReason, Prop


@pytest.fixture
def setup(warehouse_with):
    """The broker, and ``group(behavior, **options)``: adds group "g" with a Recorder
    listener of that behaviour, from FIRST_OFFSET, and returns its log."""
    wh = warehouse_with("orders", queues=2)
    return wh.broker, wh.add_group


def _dlq(broker, group="g"):
    """Dead letters stored (dispatch indexes them in the next tick)."""
    return broker.sql(
        f"SELECT CAST(body AS STRING) AS body, reconsume_times, properties FROM commit_log "
        f"WHERE topic = '%DLQ%{group}'"
    ).collect()


@pytest.mark.slow
@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
def test_always_failing_message_backs_off_through_levels_3_to_18_then_dead_letters(setup, clock):
    broker, group = setup
    log = group("fail")
    sent = broker.producer("p").send(Message("orders", b"doomed"))
    t = clock.now_ms()
    broker.tick(t)
    assert [c["reconsume"] for c in read_log(log)] == [0]
    delays = [ms for lvl, ms, _ in parse_levels(DEFAULT_LEVELS) if lvl >= 3]  # 10s 30s 1m ... 2h
    assert len(delays) == 16
    for n, delay in enumerate(delays, start=1):
        broker.tick(t + delay - 1)
        assert len(read_log(log)) == n, f"retry {n} handed over before its {delay} ms back-off"
        t += delay
        broker.tick(t)
        calls = read_log(log)
        assert len(calls) == n + 1, f"retry {n} not handed over {delay} ms after the failure"
        assert calls[-1]["reconsume"] == n and calls[-1]["topic"] == "orders" and calls[-1]["id"] == sent
    (dead,) = _dlq(broker)
    assert dead["body"] == "doomed" and dead["reconsume_times"] == 17
    assert dead["properties"][Prop.DLQ_REASON] == "max_reconsume"
    assert (
        dead["properties"][Prop.ORIGIN_MESSAGE_ID] == sent
        and dead["properties"][Prop.RETRY_TOPIC] == "orders"
    )
    broker.tick(t + 10 * 3_600_000)  # dead letters are never delivered again
    assert len(read_log(log)) == 17


@pytest.mark.spark_cluster  # the story on a standalone Spark cluster (CI)
@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
@pytest.mark.story(s3="slow")
def test_fails_twice_then_succeeds_is_consumed_once(setup, clock):
    broker, group = setup
    log = group("fail_twice")
    broker.producer("p").send(Message("orders", b"flaky"))
    t = clock.now_ms()
    broker.tick(t)
    broker.tick(t + 10_000)
    broker.tick(t + 40_000)
    broker.tick(t + 100_000)
    assert [c["reconsume"] for c in read_log(log)] == [0, 1, 2]
    assert _dlq(broker) == []
    lag = broker.sql(
        "SELECT sum(next_offset) AS n FROM offsets WHERE consumer_group = 'g' AND topic = '%RETRY%g'"
    ).collect()[0]["n"]
    assert lag == 2  # both retry copies consumed


def test_ack_index_partial_success(setup, clock):
    broker, group = setup
    log = group("ack_first", consume_message_batch_max_size=3)
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(3)], queue_keys=["k"] * 3)
    t = clock.now_ms()
    broker.tick(t)
    assert [c["batch"] for c in read_log(log)] == [3, 3, 3]
    broker.tick(t + 10_000)
    retried = sorted(c["body"] for c in read_log(log)[3:])
    assert retried == ["m1", "m2"]  # everything after ack_index 0 failed


def test_delay_level_when_next_consume(setup, clock):
    broker, group = setup
    log = group("level_from_body")
    broker.producer("p").send_batch([Message("orders", "5"), Message("orders", "-1")])
    t = clock.now_ms()
    broker.tick(t)
    broker.tick(t + 60_000 - 1)
    assert len(read_log(log)) == 2
    broker.tick(t + 60_000)  # level 5 = 1m
    assert [c["body"] for c in read_log(log)[2:]] == ["5"]
    (dead,) = _dlq(broker)
    assert dead["body"] == "-1" and dead["properties"][Prop.DLQ_REASON] == "negative_level"


def test_custom_retry_policy(setup, clock):
    broker, group = setup
    log = group("fail", retry_policy={"delays_ms": [2000, 4000]}, max_reconsume_times=3)
    broker.producer("p").send(Message("orders", b"x"))
    t = clock.now_ms()
    broker.tick(t)
    for delay in (2000, 4000, 4000):
        broker.tick(t + delay - 1)
        before = len(read_log(log))
        t += delay
        broker.tick(t)
        assert len(read_log(log)) == before + 1
    (dead,) = _dlq(broker)
    assert dead["reconsume_times"] == 4 and dead["properties"][Prop.DLQ_REASON] == "max_reconsume"


def test_group_created_after_the_messages_gets_its_own_retries(broker, clock, tmp_path):
    broker.create_topic("orders", queues=1)
    p = broker.producer("p")
    p.send(Message("orders", b"old"))
    t = clock.now_ms()
    broker.tick(t)
    log = tmp_path / "late.jsonl"
    broker.create_group("late", Recorder(log, "fail_twice"))  # LAST_OFFSET
    broker.subscribe("late", "orders")
    p.send(Message("orders", b"new"))
    broker.tick(t + 1)
    broker.tick(t + 10_001)
    broker.tick(t + 40_001)
    assert [(c["body"], c["reconsume"]) for c in read_log(log)] == [("new", 0), ("new", 1), ("new", 2)]


def test_offset_reset_redelivers(setup, clock):
    broker, group = setup
    log = group("ok")
    t0 = clock.now_ms()
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(4)])
    broker.tick(t0)
    assert len(read_log(log)) == 4
    new = broker.reset_offsets("g", t0)
    assert sum(new.values()) == 0
    broker.tick(t0 + 1)
    assert sorted(c["body"] for c in read_log(log)[4:]) == ["m0", "m1", "m2", "m3"]


def test_tags_filter_skips_and_moves_past(broker, clock, warehouse_with):
    log = warehouse_with("orders", queues=1, group="g", expression="A || C", log="tags.jsonl").log
    broker.producer("p").send_batch([Message("orders", t or "none", tags=t) for t in ["A", "B", None, "C"]])
    result = broker.tick(clock.now_ms()).job("deliver").result
    assert sorted(c["body"] for c in read_log(log)) == ["A", "C"]
    assert (result.filtered, result.consumed) == (2, 2)
    nxt = broker.sql("SELECT next_offset FROM offsets WHERE consumer_group = 'g' AND topic = 'orders'")
    assert nxt.collect()[0]["next_offset"] == 4


def test_idle_deliver_commits_nothing(setup, clock, tmp_path):
    from conftest import table_versions

    broker, group = setup
    group("ok")
    broker.producer("p").send(Message("orders", b"x"))
    broker.tick(clock.now_ms())
    before = table_versions(tmp_path / "wh")
    broker.tick(clock.now_ms() + 1000)
    after = table_versions(tmp_path / "wh")
    assert {k for k in before if before[k] != after[k]} == {"job_runs"}


@pytest.mark.unit
def test_decide_matches_rocketmq_rules():
    from deltamq.jobs.sendback import decide

    kw = dict(max_reconsume=16, max_level=18, retry_policy=None, attempt_ts=1000)
    assert decide(reconsume_times=0, requested_level=0, reason=None, **kw).level == 3
    assert decide(reconsume_times=5, requested_level=0, reason=None, **kw).level == 8
    assert decide(reconsume_times=15, requested_level=0, reason=None, **kw).level == 18
    assert decide(reconsume_times=16, requested_level=0, reason=None, **kw).dlq_reason == "max_reconsume"
    assert decide(reconsume_times=0, requested_level=7, reason=None, **kw).level == 7
    assert decide(reconsume_times=0, requested_level=-1, reason=None, **kw).dlq_reason == "negative_level"
    # a timeout is retried like a failure (RocketMQ sends back what ran past consumeTimeout);
    # at the maximum its dead letter says how the last try ended
    assert decide(reconsume_times=0, requested_level=0, reason=FailReason.TIMEOUT, **kw).level == 3
    assert (
        decide(reconsume_times=16, requested_level=0, reason=FailReason.TIMEOUT, **kw).dlq_reason == "timeout"
    )
    # what a timed-out listener left untried goes back at level 1 and is never dead-lettered
    deferred = decide(reconsume_times=16, requested_level=0, reason=FailReason.DEFERRED, **kw)
    assert (deferred.target, deferred.level) == ("retry", 1)
    policy = {**kw, "retry_policy": {"base_ms": 100, "cap_ms": 250}}
    assert decide(reconsume_times=2, requested_level=0, reason=None, **policy).timer_ms == 1250
    unlimited = {**kw, "max_reconsume": -1}
    assert decide(reconsume_times=99, requested_level=0, reason=None, **unlimited).level == 18


@pytest.mark.unit
def test_what_a_timed_out_listener_left_holds_its_queue_above_what_was_handled():
    """A concurrent group's queue is spread over partitions: one partition's listener may
    time out while another handled later offsets of the same queue. Holding below those
    would hand them out again; the deferred ones below go the send-back way instead."""
    from deltamq.jobs.deliver_plan import held_from

    seen = {"q": range(10)}
    # 5-7 and 9 deferred, 8 handled by another partition: hold from 9, send back 5-7
    assert held_from({"q": {5, 6, 7, 9}}, seen) == {"q": 9}
    assert held_from({"q": {5, 6, 7, 8, 9}}, seen) == {"q": 5}  # the usual case: a tail
    assert held_from({"q": {3}}, seen) == {}  # all below handled ones: nothing held
    assert held_from({"q": {4}}, {}) == {"q": 4}


def _taken(broker, path: str):
    """A take of offsets 0-9 of one queue, from the files (a table) or through the engine
    (a view), and what a partition whose listener timed out reports of it."""
    import datetime

    import pyarrow as pa

    from deltamq.jobs.deliver_outcomes import taken_of

    rows = pa.table(
        {
            "consumer_group": ["g"] * 10,
            "client_id": [None] * 10,
            "topic": ["orders"] * 10,
            "queue_id": pa.array([1] * 10, pa.int32()),
            "queue_offset": pa.array(range(10), pa.int64()),
            "msg_id": [f"M{i}" for i in range(10)],
            "cl_date": [datetime.date(2026, 1, 1)] * 10,
            "cl_batch_id": pa.array([7] * 10, pa.int64()),
            "cl_batch_pos": pa.array(range(10), pa.int64()),
            "reconsume_times": pa.array([2] * 10, pa.int32()),
            "matched": [True] * 10,
        }
    )
    if path == "files":
        return taken_of("", [], rows)
    broker.engine.spark.createDataFrame(rows.to_pandas()).createOrReplaceTempView("taken_test")
    return taken_of("taken_test", [])


@pytest.mark.parametrize("path", ["files", "engine"])
def test_what_a_timed_out_listener_left_is_held_or_sent_back_from_offsets_alone(broker, path):
    """A partition reports what its timed-out listener left as offsets per queue (a
    hanging listener leaves whole partitions: a row per message came back before). The
    tail is held without reading a row; deferred messages below one another partition
    handled are read back whole, and only they, to be sent back untried."""
    from deltamq.jobs.deliver_outcomes import deferred, outcomes
    from deltamq.tables.offsets import QueueKey

    q = QueueKey("g", "", "orders", 1)
    report = [
        {
            "kind": "deferred",
            "consumer_group": "g",
            "client_id": None,
            "topic": "orders",
            "queue_id": 1,
            "offsets": [5, 6, 7],
        },
        {
            "kind": "deferred",
            "consumer_group": "g",
            "client_id": None,
            "topic": "orders",
            "queue_id": 1,
            "offsets": [9],
        },
        {"kind": "count", "consumer_group": "g", "n": 6, "nbytes": 60},
    ]
    consumed = outcomes(report, 10)
    assert consumed.deferred == {q: (5, 6, 7, 9)} and consumed.handed_over == 6 and not consumed.failures
    holds, sent = deferred(broker.context, _taken(broker, path), consumed.deferred)
    assert holds == {q: 9}  # 8 was handled by another partition
    assert sorted((f.delivered.queue_offset, f.delivered.msg_id, f.reason) for f in sent) == [
        (5, "M5", FailReason.DEFERRED),
        (6, "M6", FailReason.DEFERRED),
        (7, "M7", FailReason.DEFERRED),
    ]
    assert all(f.delivered.reconsume_times == 2 for f in sent)
    holds, sent = deferred(broker.context, _taken(broker, path), {q: (4, 5, 6, 7, 8, 9)})
    assert (holds, sent) == ({q: 4}, [])  # the usual tail: held, nothing read back


@pytest.mark.plan
def test_plan_sendback_builds_retry_and_dead_letter_rows(spark):
    from deltamq.jobs.sendback import FAILURE_SCHEMA, plan_sendback

    failures = spark.createDataFrame(
        [
            ("g", "orders", 1, 7, "M1", 10, 0, None, 5000, "retry", 4, None, None, 16, "boom", False),
            (
                "g",
                "%RETRY%g",
                0,
                3,
                "M2",
                11,
                0,
                None,
                5000,
                "dlq",
                None,
                None,
                "max_reconsume",
                16,
                None,
                False,
            ),
            # sent back untried (its listener timed out on an earlier message): the count stays
            ("g", "orders", 2, 9, "M1", 10, 0, None, 5000, "retry", 1, None, None, 16, None, True),
        ],
        FAILURE_SCHEMA,
    )
    bodies = spark.createDataFrame(
        [
            (10, 0, "M1", None, None, b"a", 0, {"UNIQ_KEY": "U1", "DELAY": "2"}, 1, 0, 0, "p"),
            (
                11,
                0,
                "M2",
                None,
                None,
                b"b",
                0,
                {
                    "UNIQ_KEY": "U2",
                    "RETRY_TOPIC": "orders",
                    "ORIGIN_MESSAGE_ID": "U2",
                    "RECONSUME_TIME": "16",
                },
                1,
                16,
                0,
                "p",
            ),
        ],
        "batch_id bigint, batch_pos bigint, msg_id string, tags string, keys string, body binary, flag int, "
        "properties map<string,string>, born_ts bigint, reconsume_times int, sys_flag int, "
        "producer_group string",
    )
    planned = plan_sendback(failures, bodies).collect()
    untried = [r for r in planned if r["properties"].get("DELAY") == "1"]
    assert [(r["reconsume_times"], r["properties"]["RECONSUME_TIME"]) for r in untried] == [(0, "0")]
    rows = {r["topic"]: r for r in planned if r not in untried}
    retry, dead = rows["%RETRY%g"], rows["%DLQ%g"]
    assert retry["properties"]["DELAY"] == "4" and retry["properties"]["RETRY_TOPIC"] == "orders"
    assert retry["properties"]["ORIGIN_MESSAGE_ID"] == "U1" and retry["reconsume_times"] == 1
    assert retry["properties"]["LAST_ERROR"] == "boom" and retry["store_ts"] == 5000
    assert dead["properties"]["DLQ_REASON"] == "max_reconsume" and "DELAY" not in dead["properties"]
    assert dead["reconsume_times"] == 17 and dead["properties"]["ORIGIN_MESSAGE_ID"] == "U2"
    assert retry["msg_id"][:16] == f"{(5000 << 20) | 0x2000:016X}"  # store time + kind prefix
    assert dead["msg_id"][:16] == f"{(5000 << 20) | 0x3000:016X}" and len(dead["msg_id"]) == 32


def test_status_shows_group_lag_and_dead_letters(setup, clock):
    broker, group = setup
    group("level_from_body")
    broker.producer("p").send_batch([Message("orders", "-1"), Message("orders", "-1")], queue_keys=["k", "k"])
    t = clock.now_ms()
    broker.tick(t)
    broker.producer("p").send(Message("orders", "5"), queue_key="k")
    broker.tick(t + 1)  # dispatches the new message and the dead letters; deliver consumes "5"
    broker.producer("p").send(Message("orders", "x"), queue_key="k")
    from deltamq.jobs import dispatch

    dispatch.run(broker.context, t + 2)  # indexed, not yet delivered: lag 1
    st = broker.status()
    lag = {(g["topic"], g["queue_id"]): g["lag"] for g in st["lag"] if g["group"] == "g"}
    assert sum(v for (topic, _), v in lag.items() if topic == "orders") == 1
    assert st["dead_letters"] == {"%DLQ%g": 2}


@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
@pytest.mark.story
def test_a_listener_given_as_an_import_path_runs_where_the_engine_runs(broker, clock, env_listener_log):
    """Embedded: in a worker of the broker's server, with the broker's environment. On a
    cluster (--engine remote): in a worker the cluster started, which imports the module
    from the cluster's own path and sees the cluster's environment (docs/storage.md)."""
    import uuid

    broker.create_topic("orders", queues=2)
    broker.create_group("g", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    run = uuid.uuid4().hex
    broker.producer("p").send_batch([Message("orders", f"{run}-{i}") for i in range(6)])
    result = broker.tick(clock.now_ms())
    assert result.job("deliver").status == "OK"
    seen = sorted(c["body"] for c in read_log(env_listener_log) if c["body"].startswith(run))
    assert seen == sorted(f"{run}-{i}" for i in range(6))


def test_listeners_see_the_broker_process_environment(broker, clock, tmp_path, monkeypatch):
    """Sail runs listener code in its own server process: the workers still get the
    environment and path the broker's process has when it delivers."""
    from support.listeners import EnvEcho

    log = tmp_path / "env.jsonl"
    broker.create_topic("t", queues=1)
    broker.create_group("g", EnvEcho(log, "DMQ_LISTENER_SEES"), consume_from="FIRST_OFFSET")
    broker.subscribe("g", "t")
    producer = broker.producer("p")
    for value in ("first", "second"):
        monkeypatch.setenv("DMQ_LISTENER_SEES", value)  # set after the server started
        producer.send(Message("t", value.encode()))
        broker.tick(clock.now_ms())
        clock.advance(seconds=1)
    assert [(c["body"], c["value"]) for c in read_log(log)] == [("first", "first"), ("second", "second")]


def test_each_stage_of_a_pass_runs_alone(broker, clock, warehouse_with):
    """plan → take → consume → decide, one at a time and nothing written: the plan takes the
    subscribed queue, the take filters by tag, the listener consumes, and a failure handed
    to decide goes the retry way at level 3 with the attempt's time."""
    from deltamq.jobs import deliver, dispatch

    log = warehouse_with("orders", queues=1, group="g", expression="a").log
    p = broker.producer("p")
    p.send(Message("orders", b"wanted", tags="a"))
    p.send(Message("orders", b"other", tags="b"))
    now = clock.now_ms()
    dispatch.run(broker.context, now)
    ctx = broker.context

    work = deliver.plan(ctx, now)
    assert [(t.group, t.topic, t.lo, t.hi) for t in work.takes] == [("g", "orders", 0, 2)]
    with ctx.engine.views() as views:
        taken = deliver.take(ctx, views, work, now)
        assert (taken.rows, taken.counts["g"]["filtered"], sum(r["n"] for r in taken.deliverable)) == (
            2,
            1,
            1,
        )
        assert taken.view.startswith("dmq_deliver_taken_")  # a view of this call only
        consumed = deliver.consume(ctx, work, taken)
        assert (consumed.failures, dict(consumed.consumed)) == ((), {"g": 1})
        assert [c["body"] for c in read_log(log)] == ["wanted"]

        row = broker.sql("SELECT * FROM consume_queue WHERE tags = 'a'").collect()[0].asDict()
        failed = deliver.Failed.of(
            {**row, "consumer_group": "g", "client_id": "", "level": 0, "error": "boom"}
        )
        assert failed.reason is None and failed.delivered.msg_id == row["msg_id"]
        decided = deliver.decide(ctx, work, taken, deliver.Consumed(failures=(failed,)), now)
    assert taken.view not in {t.name for t in broker.spark.catalog.listTables()}  # dropped with the scope
    (f,) = decided.failures
    assert (f.target, f.level, f.attempt_ts, f.error) == ("retry", 3, now, "boom")
    assert decided.errors == (("g", row["msg_id"], "boom"),)
    assert decided.counts == {"g": {"retried": 1}}
    # nothing was written: the group's offset has not moved and nothing was sent back
    offsets = (
        "SELECT coalesce(max(next_offset), 0) FROM offsets WHERE consumer_group = 'g' AND topic = 'orders'"
    )
    assert broker.sql(offsets).collect()[0][0] == 0
    assert broker.sql("SELECT count(*) FROM commit_log WHERE topic LIKE '%RETRY%'").collect()[0][0] == 0


@pytest.mark.unit
def test_size_takes_shares_a_budget_evenly_between_the_backlogs():
    from deltamq.jobs.deliver_plan import size_takes

    assert size_takes([100, 100, 100, 100], 200) == [50, 50, 50, 50]
    # a queue with less than its share takes all of it; the others share the rest
    assert size_takes([10, 1_000, 1_000], 300) == [10, 145, 145]
    assert size_takes([5, 7], 1_000) == [5, 7]
    # at least one each, even when the budget is smaller than the queues
    assert size_takes([9, 9, 9], 1) == [1, 1, 1]


def test_automatic_takes_follow_the_budget_and_the_body_size_learned(warehouse_with, clock):
    """pull_batch_size 0 (the default): the first pass takes up to 10 000 per queue and
    learns the body size; later passes hand over deliver_max_bytes of bodies in all; a fresh
    runner reads the size from the last deliver on record."""
    from deltamq.jobs import deliver

    wh = warehouse_with("orders", queues=2, group="g")
    broker = wh.broker
    assert broker.catalog.groups()["g"].pull_batch_size == 0
    broker.reconfigure(deliver_max_bytes=1_000)  # ten bodies of 100 bytes
    p = broker.producer("p")
    p.send_batch([Message("orders", b"x" * 100) for _ in range(4)])
    first = broker.tick(clock.now_ms()).delivered
    assert (first.consumed, first.handed_over, first.body_bytes) == (4, 4, 400)
    p.send_batch([Message("orders", b"y" * 100) for _ in range(30)])
    consumed = []
    for _ in range(4):
        clock.advance(seconds=1)
        consumed.append(broker.tick(clock.now_ms()).delivered.consumed)
    assert consumed == [10, 10, 10, 0]
    assert len(read_log(wh.log)) == 34
    fresh = deliver.Memory()
    assert deliver.auto_budget(broker.context, fresh, clock.now_ms()) == 10
    assert fresh.bytes_per_message == 100


def test_a_columnar_listener_gets_record_batches_and_its_ack_index_counts_rows(
    broker, clock, env_listener_log
):
    from deltamq.consumer import COLUMNAR_COLUMNS

    broker.create_topic("orders", queues=1)
    broker.create_group(
        "g",
        "support.listeners:columnar_fail_from_marker",
        consume_from="FIRST_OFFSET",
        consume_message_batch_max_size=10,
    )
    broker.subscribe("g", "orders")
    broker.producer("p").send_batch([Message("orders", b) for b in (b"a", b"b", b"fail", b"c", b"d")])
    first = broker.tick(clock.now_ms()).delivered
    assert (first.consumed, first.retried) == (2, 3)
    for _ in range(3):  # level 3: back 10 s later
        clock.advance(seconds=10)
        broker.tick(clock.now_ms())
    calls = read_log(env_listener_log)
    assert calls[0] == {
        "type": "RecordBatch",
        "columns": list(COLUMNAR_COLUMNS),
        "bodies": ["a", "b", "fail", "c", "d"],
    }
    assert sorted(b for c in calls[1:] for b in c["bodies"]) == ["c", "d", "fail"]
    lag = broker.sql("SELECT count(*) FROM commit_log WHERE topic = '%DLQ%g'").collect()[0][0]
    assert lag == 0


@pytest.mark.unit
def test_a_partition_is_handed_to_the_listener_as_it_arrives(tmp_path, monkeypatch):
    """Concurrent groups' rows are called in pieces as the engine's batches come (not
    gathered whole first: a million bodies held at once cost ~1.3 s more a partition);
    every row is called once, chunks stay within the batch size, the failures and the
    count cover every row; orderly groups still get their partition whole."""
    import pickle

    import pyarrow as pa

    from deltamq.jobs import consume_partition

    monkeypatch.setattr(consume_partition, "STREAM_ROWS", 10)
    n = 47
    rows = pa.table(
        {
            "consumer_group": ["g"] * n,
            "client_id": [""] * n,
            "topic": ["orders"] * n,
            "queue_id": pa.array([0] * n, pa.int32()),
            "queue_offset": pa.array(range(n), pa.int64()),
            "msg_id": [f"m{i}" for i in range(n)],
            "tags": [None] * n,
            "keys": [None] * n,
            "body": [f"b{i}".encode() for i in range(n)],
            "properties": pa.array([[]] * n, pa.map_(pa.string(), pa.string())),
            "born_ts": pa.array([1] * n, pa.int64()),
            "store_ts": pa.array([1] * n, pa.int64()),
            "reconsume_times": pa.array([0] * n, pa.int32()),
            "suspends": pa.array([0] * n, pa.int32()),
            "flag": pa.array([0] * n, pa.int32()),
            "sys_flag": pa.array([0] * n, pa.int32()),
            "cl_date": pa.array([None] * n, pa.date32()),
            "cl_batch_id": pa.array([1] * n, pa.int64()),
            "cl_batch_pos": pa.array(range(n), pa.int64()),
            "dkey": pa.array([None] * n, pa.string()),
        }
    )
    batches = rows.to_batches(max_chunksize=7)
    streamed = [4, 4, 4, 2, 4, 4, 4, 2, 4, 4, 4, 2, 4, 1]
    for orderly, calls in ((frozenset(), streamed), (frozenset({"g"}), None)):
        log = tmp_path / f"calls-{bool(orderly)}.jsonl"
        consumer = consume_partition.make_consumer(
            {"g": pickle.dumps(Recorder(log))}, {"g": 4}, {"g": 60.0}, 3, orderly
        )
        out = pa.Table.from_batches(list(consumer(iter(batches))))
        got = read_log(log)
        assert sorted(r["id"] for r in got) == sorted(f"m{i}" for i in range(n))  # each once
        sizes = [r["batch"] for r in got]
        assert all(s <= 4 for s in sizes)
        if calls is not None:  # pieces of 14 rows (two batches of 7 reach 10): chunks 4+4+4+2
            starts = [sizes[0]]
            i = sizes[0]
            while i < len(sizes):
                starts.append(sizes[i])
                i += sizes[i]
            assert starts == calls
        counts = out.filter(pa.compute.equal(out.column("kind"), "count"))
        assert sum(counts.column("n").to_pylist()) == n


def test_passes_that_fail_after_their_listeners_answered_dead_letter_nothing(
    broker, clock, tmp_path, monkeypatch
):
    """A pass whose store fails after the listeners answered (sending back, moving the
    offsets) is re-run; three of them in a row dead-lettered the queue's head as poison,
    though its listener had consumed it each time. The runner that saw the error does not
    count those attempts; the pass after the store is back delivers the rest."""
    from deltamq import faults

    broker.create_topic("orders", queues=1)
    log = tmp_path / "calls.jsonl"
    broker.create_group("g", Recorder(log), consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(3)])
    point = faults.point

    def store_down(name):
        if name == "deliver.after_listener":
            raise OSError("the store is unavailable")
        point(name)

    monkeypatch.setattr(faults, "point", store_down)
    t = clock.now_ms()
    for k in range(4):
        with pytest.raises(OSError, match="unavailable"):
            broker.tick(t + k * 1_000)
    monkeypatch.setattr(faults, "point", point)
    assert broker.tick(t + 5_000).delivered.consumed == 3
    assert broker.sql("SELECT count(*) FROM commit_log WHERE topic = '%DLQ%g'").collect()[0][0] == 0
    assert sorted({c["body"] for c in read_log(log)}) == ["m0", "m1", "m2"]
