"""Ambiguous commits: a commit whose PUT landed while its writer saw an error (the fault
proxy's ``lost_ack``, tests/support/fault_proxy.py, between deltamq and the S3 API
server). Sail then retries the PUT, finds the version taken, and writes the same
actions again at the next version: a blind append lands twice in the Delta log (the
table itself holds its file once). Whichever commit point it hits, every message must
be indexed once, with dense offsets, and consumed once."""

from __future__ import annotations

import uuid

import pytest

from deltamq import Broker, Message
from deltamq.config import BrokerConfig
from deltamq.dq.conservation import check_dispatch
from deltamq.errors import StorageError

# Each case opens a warehouse on the S3 server and ticks it to the end through the proxy:
# 20-30 s on 2 cores, so all of them run in the slow tier.
pytestmark = pytest.mark.slow


def _open(faults, s3_server, clock, name: str) -> Broker:
    location = f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}/wh"
    return Broker.init(location, clock=clock, config=BrokerConfig(storage_options=faults.options))


def _commit_of(table: str) -> str:
    return rf"/{table}/_delta_log/\d{{20}}\.json$"


def _consume_everything(b: Broker, clock, ticks: int = 4) -> int:
    consumed = 0
    for _ in range(ticks):
        r = b.tick()
        assert r.ok, str(r)
        consumed += sum(c.get("consumed", 0) for c in (r.delivered.by_group.values() if r.delivered else []))
        clock.advance(ms=20_000)
    return consumed


def _assert_indexed_once(b: Broker, sent: int) -> None:
    c = check_dispatch(b.warehouse)
    assert not c.duplicated and not c.duplicate_offsets and not c.gaps and not c.unindexed, c.describe()
    n = b.sql(
        "SELECT count(*) AS n, count(DISTINCT msg_id) AS d FROM consume_queue WHERE topic = 't'"
    ).collect()[0]
    assert n["n"] == n["d"] == sent


@pytest.mark.parametrize(
    "table",
    [
        "commit_log",
        "consume_queue",
        "offsets",
        "job_runs",
        "leases",
    ],
    ids=lambda t: f"lost-ack-{t}",
)
def test_a_lost_ack_at_a_commit_point_indexes_and_consumes_each_message_once(faults, s3_server, clock, table):
    b = _open(faults, s3_server, clock, f"ambiguous-{table}")
    try:
        b.create_topic("t", queues=1)
        b.create_group("g", "support.listeners:consume_all")
        b.subscribe("g", "t")
        p = b.producer("p")
        for i in range(3):
            p.send(Message("t", f"before-{i}".encode()))
        faults.set(once=[{"kind": "lost_ack", "method": "PUT", "path_regex": _commit_of(table)}])
        for i in range(3):
            p.send(Message("t", f"after-{i}".encode()))
        p.send(Message("t", b"later", delay_level=1))  # promote's copy: another commit_log append
        consumed = _consume_everything(b, clock)
        assert faults.state()["faulted"]["lost_ack"] == 1, "the fault never hit the commit point"
        faults.off()
        assert consumed == 7
        _assert_indexed_once(b, 7)
    finally:
        b.close()


def test_a_repeated_append_dispatched_in_a_later_pass_is_not_indexed_again(faults, s3_server, clock):
    """The repeat lands after a pass already indexed the original (the same rows appended
    again with the same ids: a writer that retried a commit it thought lost)."""
    b = _open(faults, s3_server, clock, "repeat")
    try:
        b.create_topic("t", queues=1)
        rows = b.spark.createDataFrame(
            [("t", b"x", "k1"), ("t", b"y", "k2")], "topic string, body binary, keys string"
        )
        p = b.producer("p")
        p.send_dataframe(rows)
        first = b.tick()
        assert first.job("dispatch").rows_out == 2
        stored = b.sql("SELECT * FROM commit_log")  # the same rows, ids and batch, again
        b.warehouse.append("commit_log", b.spark.createDataFrame(stored.collect(), stored.schema))
        second = b.tick()
        assert second.job("dispatch").rows_out == 0 and second.job("dispatch").details["repeated"] == 2
        _assert_indexed_once(b, 2)
    finally:
        b.close()


def test_a_lost_ack_on_the_pull_log_hands_each_message_out_once(faults, s3_server, clock):
    """The pull's append of its deliveries (INFLIGHT rows) is answered 500 after it landed:
    the rows are in the log twice; each message is still handed out once and acked once."""
    b = _open(faults, s3_server, clock, "ambiguous-deliveries")
    try:
        b.create_topic("t", queues=1)
        b.create_group("pullers", consume_from="FIRST_OFFSET")
        b.subscribe("pullers", "t")
        b.producer("p").send_batch([Message("t", f"m{i}".encode()) for i in range(6)])
        assert b.tick().ok
        c = b.pull_consumer("pullers", "c1")
        faults.set(once=[{"kind": "lost_ack", "method": "PUT", "path_regex": _commit_of("deliveries")}])
        first = c.pull(3)
        assert faults.state()["faulted"]["lost_ack"] == 1, "the fault never hit the pull log"
        faults.off()
        assert [m.body for m in first] == [b"m0", b"m1", b"m2"]
        assert c.ack([m.receipt_handle for m in first]) == 3
        rest = c.pull(10)
        assert [m.body for m in rest] == [b"m3", b"m4", b"m5"]
        assert c.ack([m.receipt_handle for m in rest]) == 3
        clock.advance(ms=b.config.client_timeout_ms)
        assert b.tick().ok  # the fold
        assert c.pull(10) == []
        got = b.sql(
            "SELECT next_offset FROM offsets WHERE consumer_group = 'pullers' AND topic = 't'"
        ).collect()
        assert [r["next_offset"] for r in got] == [6]
    finally:
        b.close()


def test_a_lost_ack_on_a_spark_free_send_indexes_it_once(faults, s3_server, clock):
    """The Spark-free producer gets a 500 for a commit entry that landed: its retry finds
    the version taken by an entry holding its own transaction id, and the send returns
    (stored once, indexed once)."""
    from deltamq.lite import Producer

    b = _open(faults, s3_server, clock, "ambiguous-lite")
    try:
        b.create_topic("t", queues=1)
        b.create_group("g", "support.listeners:consume_all")
        b.subscribe("g", "t")
        lite = Producer(b.warehouse.location, "lite", config=BrokerConfig(storage_options=faults.options))
        faults.set(once=[{"kind": "lost_ack", "method": "PUT", "path_regex": _commit_of("commit_log")}])
        lite.send_batch([Message("t", f"m{i}".encode()) for i in range(3)])
        sent = 3
        assert faults.state()["faulted"]["lost_ack"] == 1, "the fault never hit the commit"
        faults.off()
        consumed = _consume_everything(b, clock)
        stored = b.sql("SELECT count(DISTINCT msg_id) AS n FROM commit_log WHERE topic = 't'").collect()[0][
            "n"
        ]
        assert stored == sent
        assert consumed == stored
        _assert_indexed_once(b, stored)
    finally:
        b.close()


def test_a_lost_ack_on_retentions_delete_is_repaired_by_the_next_pass(faults, s3_server, clock):
    """Retention deletes a closed day of commit_log with delta-rs; the commit's answer is
    lost. The tick either succeeds or fails naming the store; the next pass leaves the
    day deleted and the newer messages untouched."""
    from deltamq.jobs import retain

    b = _open(faults, s3_server, clock, "ambiguous-retain")
    try:
        b.create_topic("t", queues=1)
        b.create_group("g", "support.listeners:consume_all")
        b.subscribe("g", "t")
        p = b.producer("p")
        p.send_batch([Message("t", f"old{i}".encode()) for i in range(3)])
        assert _consume_everything(b, clock, ticks=2) == 3
        clock.advance(ms=4 * 86_400_000)
        p.send_batch([Message("t", f"new{i}".encode()) for i in range(2)])
        # the tick's retain step deletes the old day: the first commit to commit_log in it
        faults.set(once=[{"kind": "lost_ack", "method": "PUT", "path_regex": _commit_of("commit_log")}])
        try:
            assert b.tick().job("retain").status == "OK"
        except StorageError as e:
            assert s3_server.bucket in str(e), e
        assert faults.state()["faulted"]["lost_ack"] == 1, "the fault never hit retention's commit"
        faults.off()
        retain.run(b.context, clock.now_ms(), force=True)
        left = b.sql(
            "SELECT CAST(body AS STRING) AS b FROM commit_log WHERE topic = 't' ORDER BY 1"
        ).collect()
        assert [r["b"] for r in left] == ["new0", "new1"]
        check = check_dispatch(b.warehouse)
        assert not check.duplicated and not check.duplicate_offsets, check.describe()
    finally:
        b.close()


def test_an_outage_is_named_and_the_loop_catches_up_after_it(faults, s3_server, clock):
    """The store answers every request 503 SlowDown for a while: a send and a tick fail
    with an error naming the warehouse and the cause (after the engine's own retries and
    deltamq's), nothing is half-written, and once the store answers again the same calls
    go through and the message is consumed once."""
    b = _open(faults, s3_server, clock, "outage")
    try:
        b.create_topic("t", queues=1)
        b.create_group("g", "support.listeners:consume_all")
        b.subscribe("g", "t")
        b.reconfigure(commit_retries=1, commit_backoff_ms=10)
        faults.set(rates={"slowdown": 1.0})
        with pytest.raises(StorageError, match=rf"{b.warehouse.location}.*the store failed the request"):
            b.producer("p").send(Message("t", b"during"))
        with pytest.raises(StorageError, match=rf"{b.warehouse.location}.*the store failed the request"):
            b.tick()
        faults.off()
        b.producer("p").send(Message("t", b"after"))
        assert _consume_everything(b, clock, ticks=2) == 1
        _assert_indexed_once(b, 1)
    finally:
        b.close()


@pytest.mark.parametrize("table", ["deliveries", "queue_lock", "clients"], ids=lambda t: f"lost-ack-{t}")
def test_a_spark_free_pull_client_hands_each_message_out_once_through_a_lost_ack(
    faults, s3_server, clock, table
):
    """The Spark-free pull client (deltamq/pull_files.py) on S3: its log append (the blind
    appender) or its lock or heartbeat MERGE (delta-rs) is answered 500 after it landed.
    Each message is still handed out once and acked once, and the fold ends at the head."""
    from deltamq.lite import PullConsumer

    b = _open(faults, s3_server, clock, f"lite-pull-{table}")
    try:
        b.create_topic("t", queues=2)
        b.create_group("pullers", consume_from="FIRST_OFFSET")
        b.subscribe("pullers", "t")
        b.producer("p").send_batch([Message("t", f"m{i}".encode()) for i in range(8)])
        assert b.tick().ok
        c = PullConsumer(
            b.warehouse.location,
            "pullers",
            "lite",
            config=BrokerConfig(storage_options=faults.options),
            clock=clock,
        )
        faults.set(once=[{"kind": "lost_ack", "method": "PUT", "path_regex": _commit_of(table)}])
        got = c.pull(5)
        assert faults.state()["faulted"]["lost_ack"] == 1, f"the fault never hit {table}"
        faults.off()
        assert c.ack([m.receipt_handle for m in got]) == len(got)
        for _ in range(4):
            more = c.pull(10)
            assert c.ack([m.receipt_handle for m in more]) == len(more)
            got += more
        assert sorted(m.body for m in got) == sorted(f"m{i}".encode() for i in range(8))
        clock.advance(ms=1)
        assert b.tick().ok  # the fold
        done = b.sql(
            "SELECT sum(next_offset) AS n FROM offsets WHERE consumer_group = 'pullers' AND topic = 't'"
        )
        assert done.collect()[0]["n"] == 8
    finally:
        b.close()
