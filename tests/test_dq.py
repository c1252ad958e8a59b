"""Data quality: the Great Expectations suites and the conservation check. A clean
multi-feature warehouse passes every suite; each invariant broken on purpose fails the
right expectation and names the rows."""

from __future__ import annotations

import shutil
from datetime import timedelta

import pytest
from support.listeners import Recorder

from deltamq import Broker, FakeClock, Message
from deltamq.dq.suites import run
from deltamq.errors import ConfigError

MINUTE = 60_000


@pytest.fixture(scope="module")
def busy_template(tmp_path_factory, _spark_source):
    """Normal, delayed, timed, failing (retried then consumed), dead-lettered,
    transactional, pulled, orderly and broadcast messages, ticked until settled — built
    once; each test breaks its own copy."""
    root = tmp_path_factory.mktemp("busy")
    clock = FakeClock(1_767_225_600_000)
    broker = Broker.init(root / "wh", clock=clock)
    broker.create_topic("orders", queues=2)
    broker.create_group("billing", Recorder(root / "b.jsonl", "fail_twice"), consume_from="FIRST_OFFSET")
    broker.subscribe("billing", "orders")
    broker.create_group(
        "strict", Recorder(root / "s.jsonl", "fail"), consume_from="FIRST_OFFSET", max_reconsume_times=1
    )
    broker.subscribe("strict", "orders", "dlq")
    broker.create_group(
        "fanout",
        Recorder(root / "f.jsonl"),
        mode="BROADCASTING",
        instances=["a", "b"],
        consume_from="FIRST_OFFSET",
    )
    broker.subscribe("fanout", "orders")
    broker.create_group("ledger", Recorder(root / "l.jsonl"), orderly=True, consume_from="FIRST_OFFSET")
    broker.subscribe("ledger", "orders")
    broker.create_group("pullers", consume_from="FIRST_OFFSET")
    broker.subscribe("pullers", "orders")
    p = broker.producer("shop")
    p.send_batch([Message("orders", f"m{i}".encode()) for i in range(4)])
    p.send(Message("orders", b"dead", tags="dlq"))
    p.send(Message("orders", b"later", delay_level=3))
    p.send(Message("orders", b"timed", delay=timedelta(seconds=45)))
    p.send_in_transaction(Message("orders", b"tx-commit"), lambda m, a: "COMMIT")
    p.send_in_transaction(Message("orders", b"tx-rollback"), lambda m, a: "ROLLBACK")
    broker.tick(clock.now_ms())
    consumer = broker.pull_consumer("pullers", "c1")
    for _ in range(12):
        clock.advance(seconds=10)
        got = consumer.pull(100, now=clock.now_ms())
        consumer.ack([m.receipt_handle for m in got], now=clock.now_ms())
        broker.tick(clock.now_ms())
    broker.close()
    return root / "wh", clock.now_ms()


@pytest.fixture
def busy(busy_template, tmp_path):
    template, now = busy_template
    shutil.copytree(template, tmp_path / "busy")
    broker = Broker.init(tmp_path / "busy", clock=FakeClock(now))
    yield broker
    broker.close()


def _names(result):
    return sorted(f"{r.suite}: {r.expectation}" for r in result.failures)


@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
def test_a_clean_multi_feature_warehouse_passes_every_suite(busy):
    result = run(busy.context)
    assert result.success, (_names(result), [(r.observed, r.sample_ids) for r in result.failures])
    assert len(result.results) > 100
    accounted = next(r for r in result.results if r.expectation == "every message accounted for per group")
    assert "billing: consumed=" in accounted.observed and "strict: " in accounted.observed
    assert "dead_lettered=1" in accounted.observed
    stored = busy.sql("SELECT count(*) AS n, min(CAST(success AS INT)) AS ok FROM dq_results").collect()[0]
    assert stored["n"] == len(result.results) and stored["ok"] == 1


def _write(broker, statement: str) -> None:
    broker.sql(statement, write=True).collect()


def _copy_index_rows(broker, where: str, **changes) -> None:
    """Append copies of consume_queue rows matching ``where`` with columns changed."""
    from pyspark.sql import functions as F

    df = broker.warehouse.read("consume_queue").where(where)
    for column, value in changes.items():
        df = df.withColumn(column, F.expr(value))
    broker.warehouse.append("consume_queue", df)


def test_a_duplicate_offset_and_a_gap_are_named(busy):
    cq = busy.warehouse.ref("consume_queue")
    _copy_index_rows(
        busy, "topic = 'orders' AND queue_id = 0 AND queue_offset = 1", msg_id="concat(msg_id, 'X')"
    )
    result = run(busy.context, tables=["consume_queue"], record=False)
    dup = result.failed("consume_queue", "(topic, queue_id, queue_offset) unique")
    assert dup is not None and dup.unexpected_count == 2
    assert "topic=orders,queue_id=0,queue_offset=1" in dup.sample_ids
    _write(busy, f"DELETE FROM {cq} WHERE topic = 'orders' AND queue_id = 1 AND queue_offset = 1")
    result = run(busy.context, tables=["consume_queue", "conservation"], record=False)
    gap = result.failed("consume_queue", "offsets dense per queue")
    assert gap is not None and "orders:1" in gap.sample_ids  # (orders:0 holds the duplicate)
    assert result.failed("conservation", "every stored message indexed once") is not None


def test_a_deleted_retrying_message_is_unaccounted(broker, clock, tmp_path):
    broker.create_topic("orders", queues=1)
    broker.create_group("billing", Recorder(tmp_path / "b.jsonl", "fail"), consume_from="FIRST_OFFSET")
    broker.subscribe("billing", "orders")
    mid = broker.producer("shop").send(Message("orders", b"x"))
    broker.tick(clock.now_ms())  # fails: retry 1 held at level 3 (10 s)
    clock.advance(seconds=10)
    broker.tick(clock.now_ms())  # promoted into %RETRY%billing, delivered, failed again
    assert run(broker.context, tables=["conservation"], record=False).success
    for table in ("consume_queue", "commit_log"):
        _write(
            broker,
            f"DELETE FROM {broker.warehouse.ref(table)} "
            "WHERE topic = '%RETRY%billing' AND reconsume_times = 1",
        )
    result = run(broker.context, tables=["conservation"], record=False)
    lost = result.failed("conservation", "every message accounted for")
    assert lost is not None and lost.unexpected_count == 1
    assert lost.sample_ids == (
        f"billing {mid}: retry 1 of billing promoted from SCHEDULE_TOPIC_XXXX but not in %RETRY%billing",
    )


def test_a_dead_letter_with_too_few_retries_and_an_offset_past_the_end(busy):
    cq, offs = busy.warehouse.ref("consume_queue"), busy.warehouse.ref("offsets")
    dead = busy.sql("SELECT msg_id FROM consume_queue WHERE topic = '%DLQ%strict'").collect()[0]["msg_id"]
    _write(busy, f"UPDATE {cq} SET reconsume_times = 1 WHERE msg_id = '{dead}'")
    _write(
        busy,
        f"UPDATE {offs} SET next_offset = 999 "
        "WHERE consumer_group = 'billing' AND topic = 'orders' AND queue_id = 0",
    )
    result = run(busy.context, tables=["consume_queue", "offsets"], record=False)
    assert result.failed("consume_queue", "dead letters carry a DLQ_REASON").sample_ids == (dead,)
    past = result.failed("offsets", "group offsets within")
    assert past.sample_ids == ("billing orders:0 next_offset=999",)
    assert {r.suite for r in result.failures} == {"consume_queue", "offsets"} and len(result.failures) == 2


def test_a_half_message_leaked_into_a_user_topic_and_bad_due_times(busy):
    cq = busy.warehouse.ref("consume_queue")
    half = busy.sql(
        "SELECT msg_id FROM consume_queue WHERE topic = 'RMQ_SYS_TRANS_HALF_TOPIC' ORDER BY queue_offset"
    ).collect()[1]["msg_id"]
    head = busy.sql(
        "SELECT max(queue_offset) + 1 AS n FROM consume_queue WHERE topic = 'orders' AND queue_id = 0"
    )
    nxt = head.collect()[0]["n"]
    _copy_index_rows(
        busy,
        f"msg_id = '{half}'",
        topic="'orders'",
        queue_id="0",
        queue_offset=f"CAST({nxt} AS BIGINT)",
        slot="0",
    )
    _write(busy, f"UPDATE {cq} SET due_ts = store_ts - 1 WHERE topic = 'SCHEDULE_TOPIC_XXXX'")
    result = run(busy.context, tables=["consume_queue"], record=False)
    assert result.failed("consume_queue", "no half message in a user topic").sample_ids == (half,)
    due = result.failed("consume_queue", "schedule entries due at or after store")
    assert due is not None and due.unexpected_count >= 1


def test_bad_types_topics_and_retry_counts_fail_their_table_expectations(busy):
    cl = busy.warehouse.ref("commit_log")
    _write(busy, f"UPDATE {cl} SET topic = 'bad topic!' WHERE topic = 'orders' AND batch_pos = 0")
    _write(
        busy, f"UPDATE {busy.warehouse.ref('consume_queue')} SET reconsume_times = 99 WHERE topic = 'orders'"
    )
    result = run(busy.context, tables=["commit_log", "consume_queue"], record=False)
    assert result.failed("commit_log", "topic valid").sample_ids[0] == "bad topic!"
    assert result.failed("consume_queue", "reconsume_times within").unexpected_count > 0


def test_the_dq_command_and_check_quality(broker, tmp_path, capsys):
    from deltamq.cli import main

    broker.create_topic("orders", queues=1)
    broker.producer("shop").send(Message("orders", b"a"))
    broker.tick()
    broker.create_group("billing")
    broker.subscribe("billing", "orders")
    wh = str(tmp_path / "wh")
    assert main(["dq", "--table", "offsets", "--table", "conservation", "--fail-on-error", "-w", wh]) == 0
    assert "0 failed" in capsys.readouterr().out
    _write(
        broker,
        f"UPDATE {broker.warehouse.ref('offsets')} SET next_offset = 5 WHERE consumer_group = 'billing'",
    )
    assert main(["dq", "--table", "offsets", "--fail-on-error", "-w", wh]) == 1
    out = capsys.readouterr().out
    assert "group offsets within [min, max + 1]" in out and "billing orders:0 next_offset=5" in out
    assert main(["dq", "--table", "offsets", "-w", wh]) == 0  # reported, not failed, without the flag
    result = broker.check_quality(["offsets"], record=False)
    assert not result.success and result.failures[0].sample_ids == ("billing orders:0 next_offset=5",)
    runs = broker.sql("SELECT count(DISTINCT run_id) AS n FROM dq_results").collect()[0]["n"]
    assert runs == 3  # each CLI run recorded; the record=False run not
    with pytest.raises(ConfigError, match="no suite for 'nope'"):
        broker.check_quality(["nope"])
    one = broker.check_quality("offsets", record=False)  # one name, not its letters
    assert {r.suite for r in one.results} == {"offsets"} and not one.success
    with pytest.raises(ConfigError, match=r"tables=\[\] selects no suite"):
        broker.check_quality([])
