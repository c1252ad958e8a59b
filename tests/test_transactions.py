"""Transactional messages and check-back (docs/behaviour.md §5), on a fake clock."""

from __future__ import annotations

import pytest
from support.crash import crash_at
from support.listeners import Checks, read_log

from deltamq import Message
from deltamq.constants import TRANS_CHECK_MAX_TIME_TOPIC, Prop, TxState
from deltamq.errors import ConfigError, InvalidMessage, InvalidTransaction

MINUTE = 60_000


@pytest.fixture
def setup(warehouse_with):
    wh = warehouse_with("orders", queues=2, group="g", log="consumed.jsonl")
    return wh.broker, wh.log


def consumed(log) -> list[str]:
    return sorted(c["body"] for c in read_log(log))


def test_commit_is_consumed_once_and_never_checked(setup, clock):
    broker, log = setup
    checks = Checks()
    producer = broker.producer("shop", check_listener=checks)
    result = producer.send_in_transaction(Message("orders", b"paid"), lambda m, arg: TxState.COMMIT)
    assert result.state is TxState.COMMIT and result.error is None
    t = clock.now_ms()
    for k in range(4):
        broker.tick(t + k * MINUTE)
    assert consumed(log) == ["paid"]
    assert checks.calls == []
    [row] = broker.sql(
        "SELECT properties, sys_flag FROM commit_log WHERE topic = 'orders' AND sys_flag = 8"
    ).collect()
    assert row["properties"][Prop.TRAN_ID] == result.handle.tran_id


def test_rollback_is_never_consumed_and_never_checked(setup, clock):
    broker, log = setup
    checks = Checks()
    producer = broker.producer("shop", check_listener=checks)
    producer.send_in_transaction(Message("orders", b"cancelled"), lambda m, arg: "ROLLBACK")
    t = clock.now_ms()
    for k in range(4):
        broker.tick(t + k * MINUTE)
    assert consumed(log) == [] and checks.calls == []


@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
@pytest.mark.story(s3="slow")  # the S3 variant in the slow tier (the default tier stays under 6 min)
def test_unknown_is_checked_after_the_timeout_then_committed_and_consumed_once(setup, clock):
    broker, log = setup
    checks = Checks(default=TxState.COMMIT)
    producer = broker.producer("shop", check_listener=checks)
    result = producer.send_in_transaction(Message("orders", b"later"), lambda m, arg: TxState.UNKNOWN)
    t = clock.now_ms()
    broker.tick(t + 5_999)  # younger than 6 s: the walk stops at it
    assert checks.calls == [] and consumed(log) == []
    broker.tick(t + 60_000 + 5_999)
    assert checks.calls == [(result.handle.tran_id, "1")]
    broker.tick(t + 60_000 + 6_000)  # the committed message is dispatched and delivered
    for k in range(2, 5):
        broker.tick(t + k * MINUTE + 6_000)
    assert consumed(log) == ["later"]
    assert checks.count(result.handle.tran_id) == 1


def test_a_check_pass_resumed_after_a_kill_does_not_check_its_own_copies(setup, clock, monkeypatch):
    """A check pass killed after writing its copies is resumed at its own ``now``; a tick
    in between indexed those copies (stored at exactly that ``now``), and the resumed pass
    walked on into them: the listener was asked twice in one pass, the check count rose by
    two. Entries stored at the pass's ``now`` or later end the walk."""
    from deltamq import faults

    broker, _ = setup
    checks = Checks()  # always UNKNOWN
    producer = broker.producer("shop", check_listener=checks)
    result = producer.send_in_transaction(Message("orders", b"open"), lambda m, arg: TxState.UNKNOWN)
    t = clock.now_ms()
    broker.tick(t)
    real = faults.point

    def killed(name: str) -> None:
        if name == "check.after_output_commit":
            raise RuntimeError("killed after the copies were written")
        real(name)

    with monkeypatch.context() as m:
        m.setattr(faults, "point", killed)
        with pytest.raises(RuntimeError, match="killed"):
            broker.tick(t + MINUTE)
    run = broker.tick(t + MINUTE + 1).job("check_transactions")
    assert checks.calls == [(result.handle.tran_id, "1")], run.details


def test_listener_that_raises_means_unknown_and_is_asked_again_next_interval(setup, clock):
    broker, log = setup
    checks = Checks(answers={"x": RuntimeError("db down")})
    producer = broker.producer("shop", check_listener=checks)
    result = producer.send_in_transaction(Message("orders", b"x"), lambda m, arg: 1 / 0)
    assert result.state is TxState.UNKNOWN and "ZeroDivisionError" in result.error
    t = clock.now_ms() + 10_000
    first = broker.tick(t).job("check_transactions")
    assert first.details["listener_errors"] == 1 and first.details["answer_unknown"] == 1
    broker.tick(t + 30_000)  # interval not elapsed
    assert checks.count(result.handle.tran_id) == 1
    checks.answers["x"] = TxState.COMMIT
    broker.tick(t + MINUTE)
    assert [times for _, times in checks.calls] == ["1", "2"]
    broker.tick(t + 2 * MINUTE)
    assert consumed(log) == ["x"]


def test_immunity_does_not_delay_the_plain_message_behind_it(setup, clock):
    broker, log = setup
    checks = Checks(default=TxState.COMMIT)
    producer = broker.producer("shop", check_listener=checks)
    unknown = lambda m, arg: TxState.UNKNOWN  # noqa: E731
    immune = producer.send_in_transaction(
        Message("orders", b"immune", properties={Prop.CHECK_IMMUNITY_TIME_IN_SECONDS: "3600"}), unknown
    )
    plain = producer.send_in_transaction(Message("orders", b"plain"), unknown)
    t = clock.now_ms()
    broker.tick(t + 7_000)
    assert checks.calls == [(plain.handle.tran_id, "1")]
    for k in range(1, 5):
        broker.tick(t + 7_000 + k * MINUTE)
    assert consumed(log) == ["plain"]
    assert checks.count(immune.handle.tran_id) == 0  # put back, unchecked, every pass
    broker.tick(t + 3_600_000 + 1)
    assert checks.count(immune.handle.tran_id) == 1
    broker.tick(t + 3_600_000 + MINUTE)
    assert consumed(log) == ["immune", "plain"]


@pytest.mark.slow
def test_always_unknown_is_checked_15_times_then_discarded(setup, clock):
    broker, log = setup
    checks = Checks()
    producer = broker.producer("shop", check_listener=checks)
    result = producer.send_in_transaction(Message("orders", b"limbo"), lambda m, arg: TxState.UNKNOWN)
    t = clock.now_ms() + 10_000
    for k in range(20):
        broker.tick(t + k * MINUTE)
    tran = result.handle.tran_id
    assert [times for _, times in checks.calls] == [str(n) for n in range(1, 16)]
    [discarded] = broker.sql(
        f"SELECT properties FROM consume_queue WHERE topic = '{TRANS_CHECK_MAX_TIME_TOPIC}'"
    ).collect()
    assert discarded["properties"][Prop.TRAN_ID] == tran
    assert discarded["properties"][Prop.TRANSACTION_CHECK_TIMES] == "15"
    assert discarded["properties"][Prop.REAL_TOPIC] == "orders"
    assert consumed(log) == []
    [status] = broker.status()["transactions"]
    assert status["pending"] == 0 and status["discarded"] == 1


def test_commit_arriving_after_a_put_back_is_not_checked_again(setup, clock):
    broker, log = setup
    checks = Checks()
    producer = broker.producer("shop", check_listener=checks)
    result = producer.send_in_transaction(Message("orders", b"slow"), lambda m, arg: TxState.UNKNOWN)
    t = clock.now_ms() + 10_000
    broker.tick(t)  # checked once: UNKNOWN, written again at the end of the half queue
    assert checks.count(result.handle.tran_id) == 1
    producer.end_transaction(result.handle, TxState.COMMIT)
    for k in range(1, 6):
        broker.tick(t + k * MINUTE)
    assert checks.count(result.handle.tran_id) == 1
    assert consumed(log) == ["slow"]
    ops = broker.sql("SELECT count(*) AS n FROM commit_log WHERE topic = 'RMQ_SYS_TRANS_OP_HALF_TOPIC'")
    assert ops.collect()[0]["n"] == 1
    state = broker.sql(
        "SELECT topic, next_offset FROM offsets WHERE consumer_group = '%TRANSACTION%' ORDER BY topic"
    ).collect()
    heads = {r["topic"]: r["next_offset"] for r in state}
    assert heads == {"RMQ_SYS_TRANS_HALF_TOPIC": 2, "RMQ_SYS_TRANS_OP_HALF_TOPIC": 1}  # nothing sticks


def test_born_more_than_72h_ago_is_discarded_unchecked(setup, clock):
    broker, log = setup
    checks = Checks(default=TxState.COMMIT)
    producer = broker.producer("shop", check_listener=checks)
    old = clock.now_ms() - 72 * 3_600_000 - 1
    producer.send_in_transaction(Message("orders", b"ancient", born_ts=old), lambda m, arg: TxState.UNKNOWN)
    broker.tick(clock.now_ms())
    broker.tick(clock.now_ms() + MINUTE)
    assert checks.calls == [] and consumed(log) == []
    n = broker.sql(f"SELECT count(*) AS n FROM commit_log WHERE topic = '{TRANS_CHECK_MAX_TIME_TOPIC}'")
    assert n.collect()[0]["n"] == 1


def test_table_check_resolves_a_mixed_batch_of_1000_in_one_pass(setup, clock, tmp_path, spark):
    broker, log = setup
    rows = [(f"o{i}", ["PAID", "CANCELLED", "PENDING", None][i % 4]) for i in range(1000)]
    state_path = str(tmp_path / "order_state")
    spark.createDataFrame(rows, "order_id string, status string").write.format("delta").save(state_path)
    broker.check_with_table(
        "shop",
        state_path,
        "order_id",
        "CASE WHEN status = 'PAID' THEN 'COMMIT' WHEN status = 'CANCELLED' THEN 'ROLLBACK' END",
    )
    producer = broker.producer("shop")
    df = spark.createDataFrame(
        [("orders", f"body-{i}", {"order_id": f"o{i}"}) for i in range(1000)],
        "topic string, body string, properties map<string,string>",
    )
    producer.send_dataframe_in_transaction(df)
    t = clock.now_ms() + 10_000
    run = broker.tick(t).job("check_transactions")
    assert run.details["check"] == 1000
    assert run.details["answer_commit"] == 250 and run.details["answer_rollback"] == 250
    assert run.details["answer_unknown"] == 500
    broker.tick(t + 1)
    assert len(consumed(log)) == 250
    assert all(int(b.split("-")[1]) % 4 == 0 for b in consumed(log))
    [status] = broker.status()["transactions"]
    assert status["producer_group"] == "shop" and status["pending"] == 500 and status["max_checks"] == 1


def test_a_check_table_that_cannot_be_read_leaves_only_its_group_unanswered(setup, clock, tmp_path, spark):
    """A check table dropped after it was configured fails its own group's checks (asked
    again next pass, counted as a check, named in the job's error), not the pass: the
    other producer groups are asked and the rest of the tick runs."""
    import shutil

    broker, log = setup
    path = str(tmp_path / "order_state")
    spark.createDataFrame([("o1", "PAID")], "order_id string, status string").write.format("delta").save(path)
    broker.check_with_table("tables", path, "order_id", "CASE WHEN status = 'PAID' THEN 'COMMIT' END")
    checks = Checks(default=TxState.COMMIT)
    broker.producer("tables").send_in_transaction(
        Message("orders", b"by-table", properties={"order_id": "o1"}), lambda m, a: TxState.UNKNOWN
    )
    broker.producer("shop", check_listener=checks).send_in_transaction(
        Message("orders", b"by-listener"), lambda m, a: TxState.UNKNOWN
    )
    shutil.rmtree(path)
    t = clock.now_ms() + 10_000
    result = broker.tick(t)
    run = result.job("check_transactions")
    assert run.status == "OK" and run.details["check"] == 2
    assert run.details["answer_commit"] == 1 and run.details["answer_unknown"] == 1
    assert run.details["listener_errors"] == 1
    assert "producer group tables: 1 unanswered" in run.error and path in run.error
    assert result.job("retain").status in ("OK", "SKIPPED")  # the tick went on
    assert len(checks.calls) == 1
    broker.tick(t + 1)
    assert consumed(log) == ["by-listener"]
    stored = broker.sql("SELECT error FROM job_runs WHERE job = 'check_transactions' AND error IS NOT NULL")
    assert "cannot be read" in stored.collect()[0]["error"]


def test_a_dataframe_half_sets_its_own_transaction_properties_as_a_single_half_does(setup, clock, spark):
    """Properties the transaction sets (check count, transaction id, producer group) are
    the send's, not the caller's, in both sends: a given TRANSACTION_CHECK_TIMES of 15
    discarded the half unchecked, a given TRAN_ID failed the send with an engine error."""
    broker, log = setup
    checks = Checks(default=TxState.COMMIT)
    producer = broker.producer("shop", check_listener=checks)
    given = {Prop.TRANSACTION_CHECK_TIMES: "15", Prop.TRAN_ID: "X", Prop.PGROUP: "other", "order": "o1"}
    df = spark.createDataFrame(
        [("orders", "bulk", given)], "topic string, body string, properties map<string,string>"
    )
    [half] = producer.send_dataframe_in_transaction(df).collect()
    single = producer.send_in_transaction(Message("orders", b"single", properties=given), lambda m, a: None)
    stored = {
        r["b"]: dict(r["properties"])
        for r in broker.sql("SELECT CAST(body AS STRING) AS b, properties FROM commit_log").collect()
    }
    for body, tran_id in (("bulk", half["msg_id"]), ("single", single.msg_id)):
        props = stored[body]
        assert Prop.TRANSACTION_CHECK_TIMES not in props and props["order"] == "o1"
        assert props[Prop.TRAN_ID] == tran_id and props[Prop.PGROUP] == "shop"
    t = clock.now_ms() + 10_000
    run = broker.tick(t).job("check_transactions")
    assert run.details["check"] == 2 and run.details["discard"] == 0
    broker.tick(t + 1)
    assert consumed(log) == ["bulk", "single"]


def test_bulk_end_and_validation(setup, clock):
    broker, log = setup
    producer = broker.producer("shop")
    halves = [
        producer.send_in_transaction(Message("orders", f"b{i}".encode()), lambda m, a: None) for i in range(3)
    ]
    assert all(h.state is TxState.UNKNOWN for h in halves)
    with pytest.raises(InvalidTransaction, match="MAYBE.*is not a transaction state.*allowed: COMMIT"):
        producer.end_transactions({halves[0].msg_id: "MAYBE"})
    with pytest.raises(InvalidTransaction, match="not a deltamq message id"):
        producer.end_transactions({"nope": "COMMIT"})
    with pytest.raises(InvalidTransaction, match="other producer groups"):
        broker.producer("other").end_transaction(halves[0].handle, "COMMIT")
    with pytest.raises(InvalidMessage, match="cannot be delayed"):
        producer.send_in_transaction(Message("orders", b"d", delay_level=2), lambda m, a: "COMMIT")
    sent = producer.send(Message("orders", b"plain"))
    with pytest.raises(InvalidTransaction, match="not stored half messages"):
        producer.end_transactions({sent: "COMMIT"})
    counts = producer.end_transactions(
        {halves[0].msg_id: "COMMIT_MESSAGE", halves[1].msg_id: "ROLLBACK", halves[2].msg_id: TxState.UNKNOWN}
    )
    assert counts == {"COMMIT": 1, "ROLLBACK": 1, "UNKNOWN": 1}
    broker.tick(clock.now_ms())
    assert consumed(log) == ["b0", "plain"]


def test_check_table_configuration_errors_name_the_problem(broker, tmp_path, spark):
    path = str(tmp_path / "st")
    spark.createDataFrame([("o1", "PAID")], "order_id string, status string").write.format("delta").save(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        broker.check_with_table("shop", str(tmp_path / "missing"), "order_id", "'COMMIT'")
    with pytest.raises(ConfigError, match="no key column 'oid'"):
        broker.check_with_table("shop", path, "oid", "'COMMIT'")
    with pytest.raises(ConfigError, match="does not evaluate"):
        broker.check_with_table("shop", path, "order_id", "CASE WHEN nosuch = 1 THEN 'COMMIT' END")
    for relative in ("./st", "state/st", "../st"):  # a tick may run in another folder
        with pytest.raises(ConfigError, match=f"'{relative}' is a relative path; give an absolute path"):
            broker.check_with_table("shop", relative, "order_id", "'COMMIT'")
    from deltamq.transactions import _is_path

    names = (path, f"file:{path}", "s3://b/st", "hdfs:/st", "shop.state", "delta.`/st`")
    assert [_is_path(t) for t in names] == [True, True, True, True, False, False]
    assert broker.check_configs() == {}


@pytest.mark.plan
def test_plan_classes_applies_the_rules_in_order(spark):
    from deltamq.jobs.check_transactions import plan_classes

    now = 10_000_000
    imm = {Prop.CHECK_IMMUNITY_TIME_IN_SECONDS: "3600"}
    rows = [
        # offset, msg id, properties, born, store
        (0, "A", {Prop.TRAN_ID: "A"}, now - 60_000, now - 60_000),  # settled by an op record
        (1, "B", {Prop.TRANSACTION_CHECK_TIMES: "15"}, now - 60_000, now - 1),  # checked 15 times
        (2, "C", {}, now - 72 * 3_600_000 - 1, now - 1),  # born > 72 h ago
        (3, "D", imm, now - 7_000, now - 7_000),  # own immunity, younger: put back
        (4, "E", {}, now - 7_000, now - 7_000),  # old enough: checked
        (5, "F", {Prop.TRAN_ID: "X", Prop.CHECK_IMMUNITY_TIME_IN_SECONDS: "bad"}, now - 7_000, now - 1),
        (6, "G", {}, now + 5_000, now - 1),  # born in the future (producer clock ahead): checked
        (7, "H", {}, now - 100, now - 100),  # younger than 6 s, no immunity: stop
        (8, "I", {}, now - 1, now + 1),  # stored after the pass began: stop
        (9, "J", {}, now - 7_000, now),  # stored at the pass's now (its own copy, resumed): stop
        (10, "K", {}, now + 600_000, now + 600_000),  # a producer clock 10 min ahead: checked
        (11, "L", {}, now + 3_000, now + 3_000),  # 3 s ahead, under the timeout: stop
        (12, "M", imm, now + 600_000, now + 600_000),  # 10 min ahead, own immunity: put back
    ]
    half = spark.createDataFrame(
        rows,
        "queue_offset bigint, msg_id string, properties map<string,string>, born_ts bigint, store_ts bigint",
    )
    ops = spark.createDataFrame([("A",), ("Z",)], "tran_id string")
    out = {
        r["msg_id"]: (r["cls"], r["tran_id"], r["times"])
        for r in plan_classes(
            half, ops, now, timeout_ms=6_000, check_max=15, retention_ms=72 * 3_600_000
        ).collect()
    }
    assert out == {
        "A": ("settled", "A", 0),
        "B": ("discard", "B", 15),
        "C": ("discard", "C", 0),
        "D": ("putback", "D", 0),
        "E": ("check", "E", 0),
        "F": ("check", "X", 0),  # unparsable immunity = the timeout (RocketMQ's getImmunityTime)
        "G": ("check", "G", 0),
        "H": ("stop", "H", 0),
        "I": ("stop", "I", 0),
        "J": ("stop", "J", 0),
        "K": ("check", "K", 0),
        "L": ("stop", "L", 0),
        "M": ("putback", "M", 0),
    }


def test_a_resumed_pass_keeps_its_now_and_never_settles_an_entry_twice(setup, clock):
    from deltamq.jobs import check_transactions

    broker, log = setup
    checks = Checks(default=TxState.COMMIT)
    producer = broker.producer("shop", check_listener=checks)
    first = producer.send_in_transaction(Message("orders", b"one"), lambda m, a: TxState.UNKNOWN)
    broker.tick(clock.now_ms() + 1_000)  # indexed; too young to check
    t = clock.now_ms() + 62_000
    with pytest.raises(RuntimeError, match="killed"), crash_at("check.after_output_commit"):
        check_transactions.run(broker.context, t)
    checks.default = TxState.ROLLBACK  # the listener changed its mind: must not matter
    clock.set(t + 1_000)
    second = producer.send_in_transaction(Message("orders", b"two"), lambda m, a: TxState.UNKNOWN)
    # resumed before dispatch indexed the first attempt's op record: the entry is still
    # "to check", but its outputs are stored, so it is skipped whole
    resumed = check_transactions.run(broker.context, t + 90_000)
    assert resumed.ran and resumed.resumed and resumed.pass_now == t
    assert resumed.counts["check"] == 1 and resumed.written == 0 and resumed.already_stored == 2
    assert resumed.answers == {"COMMIT": 1, "ROLLBACK": 0, "UNKNOWN": 0}
    assert checks.count(first.handle.tran_id) == 1 and checks.count(second.handle.tran_id) == 0
    broker.tick(t + 90_001)
    broker.tick(t + 90_002)
    assert consumed(log) == ["one"]
    ops = broker.sql(
        "SELECT properties['TRAN_ID'] AS tran, properties['TRAN_STATE'] AS state FROM commit_log "
        "WHERE topic = 'RMQ_SYS_TRANS_OP_HALF_TOPIC' ORDER BY store_ts"
    ).collect()
    assert [(r["tran"], r["state"]) for r in ops] == [
        (first.handle.tran_id, "COMMIT"),
        (second.handle.tran_id, "ROLLBACK"),  # the next pass (interval elapsed) asked about "two"
    ]


def test_a_transaction_committed_by_both_producer_and_check_is_visible_once(setup, clock):
    from deltamq.dq.conservation import check_dispatch

    broker, log = setup
    checks = Checks(default=TxState.COMMIT)
    producer = broker.producer("shop", check_listener=checks)
    slow = producer.send_in_transaction(Message("orders", b"raced"), lambda m, a: TxState.UNKNOWN)
    twice = producer.send_in_transaction(Message("orders", b"twice"), lambda m, a: TxState.UNKNOWN)
    t = clock.now_ms() + 10_000
    broker.tick(t)  # the check commits both (its outputs are not dispatched yet)
    assert checks.count(slow.handle.tran_id) == 1
    # the producer's own end lands after the check answered: a second commit of each
    producer.end_transaction(slow.handle, TxState.COMMIT)
    producer.end_transactions({twice.msg_id: "COMMIT"})
    first = broker.tick(t + 1).job("dispatch")
    assert first.details["duplicate_commits"] == 2
    producer.end_transaction(slow.handle, TxState.COMMIT)  # once more, in a later dispatch
    assert broker.tick(t + 2).job("dispatch").details["duplicate_commits"] == 1
    broker.tick(t + 3)
    assert consumed(log) == ["raced", "twice"]
    report = check_dispatch(broker.warehouse)
    assert report.ok and report.duplicate_commits == 3, report.describe()


def test_import_path_check_listener_is_found_by_another_process(setup, clock, tmp_path):
    from deltamq import Broker

    broker, log = setup
    producer = broker.producer("shop", check_listener="support.listeners:check_by_body")
    # a check listener whose module was importable when registered and is gone now (a path
    # that cannot be imported is refused when registered: test_first_hour.py)
    broker.catalog._set_check("lost", listener="support.listeners:no_such_function")
    assert broker.check_configs()["shop"].listener == "support.listeners:check_by_body"
    for body in ("COMMIT", "ROLLBACK", "maybe"):
        producer.send_in_transaction(Message("orders", body), lambda m, a: TxState.UNKNOWN)
    broker.producer("lost").send_in_transaction(Message("orders", "COMMIT"), lambda m, a: None)
    other = Broker.open(tmp_path / "wh", clock=clock)  # no listener registered in this one
    run = other.tick(clock.now_ms() + 10_000).job("check_transactions")
    assert run.details["answer_commit"] == 1 and run.details["answer_rollback"] == 1
    assert run.details["answer_unknown"] == 2  # "maybe" is no state; "lost" cannot be imported
    assert run.details["listener_errors"] == 2
    other.runner.release()
    broker.tick(clock.now_ms() + 10_001)  # the consumer's listener lives in this process
    assert consumed(log) == ["COMMIT"]


def test_a_committed_message_that_fails_is_retried_like_any_other(broker, clock, warehouse_with):
    """Its retry copies keep TRAN_ID and the committed sys_flag; dispatch must index them
    (only a second commit of the same transaction in its real topic is a duplicate)."""
    log = warehouse_with("orders", queues=1, group="billing", recorder="fail_twice", log="b.jsonl").log
    broker.producer("shop").send_in_transaction(Message("orders", b"paid"), lambda m, a: "COMMIT")
    broker.tick(clock.now_ms())
    for _ in range(6):
        clock.advance(seconds=10)
        broker.tick(clock.now_ms())
    assert [c["reconsume"] for c in read_log(log)] == [0, 1, 2]


def test_a_commit_after_a_rollback_is_not_delivered_the_first_end_wins(setup, clock):
    """A transaction rolled back (by its producer, or by a check pass) and then committed
    before dispatch reached either end: the rollback came first, so the COMMIT's message
    is never indexed nor delivered (it was, when both ends were in one dispatch pass), and
    the conservation check counts it as a duplicate end, not a lost message."""
    from deltamq.dq.conservation import check_dispatch

    broker, log = setup
    producer = broker.producer("shop", check_listener=Checks(default=TxState.ROLLBACK))
    cancelled = producer.send_in_transaction(Message("orders", b"cancelled"), lambda m, a: TxState.ROLLBACK)
    checked = producer.send_in_transaction(Message("orders", b"checked"), lambda m, a: TxState.UNKNOWN)
    kept = producer.send_in_transaction(Message("orders", b"kept"), lambda m, a: TxState.COMMIT)
    t = clock.now_ms() + 70_000
    broker.tick(t)  # the check pass rolls "checked" back; its op record is not dispatched yet
    producer.end_transaction(cancelled.handle, TxState.COMMIT)
    producer.end_transaction(checked.handle, TxState.COMMIT)
    producer.end_transaction(kept.handle, TxState.ROLLBACK)  # too late: it was committed first
    dispatch = broker.tick(t + 1).job("dispatch")
    assert dispatch.details["duplicate_commits"] >= 1
    broker.tick(t + 2)
    broker.tick(t + 3)
    assert consumed(log) == ["kept"]
    visible = broker.sql("SELECT count(*) AS n FROM messages WHERE state = 'visible' AND topic = 'orders'")
    assert visible.collect()[0]["n"] == 1
    ends = broker.sql("SELECT CAST(body AS STRING) AS b, transaction FROM messages WHERE topic = 'orders'")
    assert sorted((r["b"], r["transaction"]) for r in ends.collect()) == [
        ("cancelled", "ROLLBACK"),
        ("checked", "ROLLBACK"),
        ("kept", "COMMIT"),  # its first end; the ROLLBACK after it changes nothing
    ]
    report = check_dispatch(broker.warehouse)
    assert report.ok and report.duplicate_commits == 2, report.describe()


def test_a_rollback_stored_by_a_producer_whose_clock_is_behind_still_wins(setup, clock):
    """An op record's batch id carries the clock of whoever ended the transaction. A
    ROLLBACK stored by a producer instance whose clock was behind the half's (another
    machine) fell before the transaction's start, where dispatch no longer looked for
    ends already indexed: a COMMIT arriving in a later pass was indexed and delivered."""
    broker, log = setup
    producer = broker.producer("shop", check_listener=Checks())
    t = clock.now_ms()
    h = producer.send_in_transaction(Message("orders", b"rolled back"), lambda m, a: TxState.UNKNOWN)
    clock.set(t - 5_000)  # the other instance's clock, 5 s behind
    broker.producer("shop").end_transaction(h.handle, TxState.ROLLBACK)
    clock.set(t + 1_000)
    broker.tick(clock.now_ms())  # the rollback's op record indexed
    producer.end_transaction(h.handle, TxState.COMMIT)  # a late second end
    dispatch = broker.tick(clock.now_ms() + 1).job("dispatch")
    broker.tick(clock.now_ms() + 2)
    assert consumed(log) == []
    assert dispatch.details.get("duplicate_commits") == 1, dispatch.details


def test_a_half_stored_by_a_clock_ahead_does_not_hold_up_the_halves_behind_it(setup, clock):
    """A store time comes from the producer's clock: a half stored 10 minutes ahead of the
    runner's clock once stopped every pass at it, so the halves behind it went unchecked
    for those 10 minutes. Ahead by more than the transaction timeout it is not waited for,
    and is checked by its (negative) age, as RocketMQ does."""
    broker, log = setup
    checks = Checks(default=TxState.COMMIT)
    t = clock.now_ms()
    clock.set(t + 10 * MINUTE)  # one producer instance's clock
    broker.producer("shop", check_listener=checks).send_in_transaction(
        Message("orders", b"ahead"), lambda m, a: TxState.UNKNOWN
    )
    clock.set(t)
    behind = broker.producer("shop", check_listener=checks).send_in_transaction(
        Message("orders", b"on time"), lambda m, a: TxState.UNKNOWN
    )
    broker.tick(t + MINUTE)
    assert checks.count(behind.handle.tran_id) == 1
    broker.tick(t + MINUTE + 1)
    assert consumed(log) == ["ahead", "on time"]


def test_status_counts_a_transaction_between_its_check_and_the_next_dispatch(setup, clock):
    """A check pass answered UNKNOWN writes the half again (a new commit_log row, indexed by
    the next tick's dispatch): status still counts the transaction as pending then, with
    the checks made so far."""
    broker, _ = setup
    producer = broker.producer("shop", check_listener=Checks())
    producer.send_in_transaction(Message("orders", b"limbo"), lambda m, arg: TxState.UNKNOWN)
    t = clock.now_ms() + 10_000
    assert broker.tick(t).job("check_transactions").details["answer_unknown"] == 1
    [status] = broker.status()["transactions"]
    assert status["pending"] == 1, status
    assert status["max_checks"] == 1, status
    broker.tick(t + 1_000)  # dispatch indexes the half written again
    [status] = broker.status()["transactions"]
    assert (status["pending"], status["max_checks"]) == (1, 1), status
