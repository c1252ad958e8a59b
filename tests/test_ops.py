"""Operator tooling: dead letters listed and resent, message traces, rebuilding the index."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support.listeners import Recorder, read_log

from deltamq import Message
from deltamq.errors import ConfigError, UnknownTopic

MINUTE = 60_000


def _run_retries(broker, clock, minutes: int) -> None:
    """Tick through ``minutes`` of retry back-off, 10 s at a time."""
    for _ in range(minutes * 6):
        clock.advance(seconds=10)
        broker.tick(clock.now_ms())


def test_trace_of_a_message_retried_twice_then_consumed(broker, clock, tmp_path):
    broker.create_topic("orders", queues=2)
    broker.create_group("billing", Recorder(tmp_path / "b.jsonl", "fail_twice"), consume_from="FIRST_OFFSET")
    broker.subscribe("billing", "orders")
    broker.create_group("audit", Recorder(tmp_path / "a.jsonl"), consume_from="FIRST_OFFSET")
    broker.subscribe("audit", "orders")
    mid = broker.producer("shop").send(Message("orders", b"order-1", keys="o-1"))
    broker.tick(clock.now_ms())
    _run_retries(broker, clock, 2)  # level 3 (10 s), then level 4 (30 s)
    assert [c["reconsume"] for c in read_log(tmp_path / "b.jsonl")] == [0, 1, 2]
    events = broker.trace(mid)
    assert [e["event"] for e in events] == [
        "sent",
        "retry 1 waiting, delayed (level 3)",
        "retry 1 for billing",
        "retry 2 waiting, delayed (level 4)",
        "retry 2 for billing",
    ]
    audit, billing = events[0]["groups"]
    assert audit == "audit: consumed" and billing.startswith("billing: sent back (retry 1, due ")
    (billing,) = events[2]["groups"]
    assert billing.startswith("billing: sent back (retry 2, due ")
    assert events[4]["groups"] == ["billing: consumed"]
    assert all(e["msg_id"] == mid for e in events[:1]) and len({e["msg_id"] for e in events}) == 5
    assert events[0]["store_ts"] <= events[1]["store_ts"] < events[2]["store_ts"] <= events[3]["store_ts"]
    assert broker.find_by_key("o-1") == [mid]
    assert broker.find_by_key("o-2") == []


def test_dead_letters_listed_and_resent_back_to_their_topic(broker, clock, tmp_path):
    log = tmp_path / "w.jsonl"
    (tmp_path / "w.jsonl.broken").write_text("down")
    broker.create_topic("orders", queues=2)
    broker.create_group(
        "worker", Recorder(log, "fail_while_broken"), consume_from="FIRST_OFFSET", max_reconsume_times=1
    )
    broker.subscribe("worker", "orders")
    p = broker.producer("shop")
    ids = [
        p.send(Message("orders", f"job-{i}".encode(), keys=f"k{i}", properties={"x": str(i)}))
        for i in range(3)
    ]
    broker.tick(clock.now_ms())
    _run_retries(broker, clock, 1)
    letters = broker.dead_letters(group="worker").orderBy("keys").collect()
    assert [(r["origin_id"], r["original_topic"], r["reason"]) for r in letters] == [
        (i, "orders", "max_reconsume") for i in ids
    ]
    assert broker.dead_letters(group="worker", where="keys = 'k1'").count() == 1
    assert broker.dead_letters(msg_ids=[ids[2]]).count() == 1
    with pytest.raises(ConfigError, match="not a predicate"):
        broker.dead_letters(where="no_such_column = 1")
    # the outage is fixed: resend two of them, at most 100 per second
    (tmp_path / "w.jsonl.broken").unlink()
    done = broker.resend_dead_letters(group="worker", where="keys <> 'k2'", rate_per_s=100)
    assert (done.selected, done.resent, done.already_resent) == (2, 2, 0)
    again = broker.resend_dead_letters(group="worker", where="keys <> 'k2'")
    assert (again.resent, again.already_resent) == (0, 2)  # never twice
    clock.advance(seconds=1)
    broker.tick(clock.now_ms())
    consumed = [c for c in read_log(log) if c["reconsume"] == 0 and c["props"].get("RESENT_FROM")]
    assert sorted((c["body"], c["props"]["x"]) for c in consumed) == [("job-0", "0"), ("job-1", "1")]
    assert {c["props"]["RESENT_FROM"] for c in consumed} == {
        r["msg_id"] for r in letters if r["keys"] != "k2"
    }
    assert broker.trace(done.msg_ids[0])[0]["event"].startswith("resent from the DLQ (")
    chain = broker.trace(ids[0])  # the original's trace ends with its resend, consumed
    assert [e["event"].split(" (")[0] for e in chain][-2:] == [
        "dead-lettered by worker",
        "resent from the DLQ",
    ]
    assert chain[-1]["groups"] == ["worker: consumed"]


@pytest.mark.slow
def test_rebuild_index_reproduces_the_index(broker, clock, tmp_path):
    broker.create_topic("orders", queues=3)
    broker.create_group("worker", Recorder(tmp_path / "w.jsonl", "fail_twice"), consume_from="FIRST_OFFSET")
    broker.subscribe("worker", "orders")
    p = broker.producer("shop")
    p.send_batch([Message("orders", f"m{i}".encode()) for i in range(5)])
    p.send(Message("orders", b"later", delay_level=2))
    p.send(Message("orders", b"timer", delay=timedelta(seconds=90)))
    p.send_in_transaction(Message("orders", b"tx"), lambda m, a: "COMMIT")
    broker.tick(clock.now_ms())
    _run_retries(broker, clock, 2)
    cols = "topic, queue_id, queue_offset, msg_id, due_ts, reconsume_times, cl_version, cl_batch_id"
    before = sorted(tuple(r) for r in broker.sql(f"SELECT {cols} FROM consume_queue").collect())
    heads = broker.status()["queues"]
    done = broker.rebuild_index(clock.now_ms())
    after = sorted(tuple(r) for r in broker.sql(f"SELECT {cols} FROM consume_queue").collect())
    assert after == before and done["rows_after"] == done["rows_before"] == len(before)
    assert broker.status()["queues"] == heads
    clock.advance(seconds=1)
    assert broker.tick(clock.now_ms()).job("deliver").rows_in == 0  # consumers carry on, nothing repeated


def test_rebuild_index_refuses_once_retention_rewrote_the_commit_log(broker, clock):
    from deltamq.errors import OperationError

    broker.create_topic("orders")
    p = broker.producer("shop")
    p.send(Message("orders", b"old"))
    broker.tick(clock.now_ms())
    clock.advance(timedelta(days=4))  # past file_reserved_time: the retention pass deletes the old day
    p.send(Message("orders", b"new"))
    assert broker.tick(clock.now_ms()).job("retain").details["body_rows"] >= 1
    index = broker.sql("SELECT msg_id FROM consume_queue ORDER BY msg_id").collect()
    with pytest.raises(OperationError, match=r"removed files \(retention or compaction\)"):
        broker.rebuild_index(clock.now_ms())
    assert broker.sql("SELECT msg_id FROM consume_queue ORDER BY msg_id").collect() == index


def test_report_charts_lag_and_throughput_from_job_runs(broker, clock, tmp_path):
    import json
    import re

    from deltamq.report import write_html

    broker.create_topic("orders", queues=2)
    broker.create_group(
        "worker", Recorder(tmp_path / "w.jsonl"), consume_from="FIRST_OFFSET", pull_batch_size=3
    )
    broker.subscribe("worker", "orders")
    p = broker.producer("shop")
    for i in range(4):
        p.send_batch([Message("orders", f"m{i}-{j}".encode()) for j in range(10)])
        clock.advance(seconds=1)
        broker.tick(clock.now_ms())
    page = tmp_path / "report.html"
    data = write_html(broker.context, str(page))
    text = page.read_text()
    assert data["totals"]["indexed"] == 40
    assert data["totals"]["consumed"] == 4 * 6  # 3 per queue per tick
    assert data["series"]["backlog"] == [10, 14, 18, 22]  # the push group falls behind
    embedded = re.search(r'<script type="application/json" id="deltamq-data">(.*?)</script>', text, re.S)
    assert json.loads(embedded.group(1)) == data
    assert data["backlog_by_group"] == {"worker": [10, 14, 18, 22]}  # deliver records it per group
    # the charts themselves are checked in a browser: tests/test_report.py


def test_a_trace_of_no_message_id_says_why_once(broker):
    with pytest.raises(ConfigError) as e:
        broker.trace("NOSUCHID")
    assert str(e.value) == "'NOSUCHID' is not a deltamq message id (24 or 32 upper-case hex digits)"


def test_a_resend_refused_for_a_topic_names_the_dead_letters_going_there(broker, clock, tmp_path):
    """One dead letter whose topic cannot be written refuses the resend: the error named
    the topic only, not which letters or how many, nor how to leave them out."""
    broker.create_topic("orders", queues=1)
    broker.create_topic("old", queues=1)
    broker.create_group("worker", Recorder(tmp_path / "w.jsonl", "fail"), max_reconsume_times=0)
    broker.subscribe("worker", "orders")
    broker.subscribe("worker", "old")
    p = broker.producer("shop")
    p.send(Message("orders", b"a"))
    lost = p.send(Message("old", b"b"))
    broker.tick(clock.now_ms())
    broker.tick(clock.now_ms() + 1000)
    assert broker.dead_letters(group="worker").count() == 2
    broker.delete_topic("old", force=True)
    refused = r"1 of the 2 dead letters to resend go back to topic 'old'.*nothing.*RETRY_TOPIC"
    with pytest.raises(UnknownTopic, match=refused):
        broker.resend_dead_letters(group="worker")
    letters = broker.dead_letters(group="worker").collect()
    assert [r["origin_id"] for r in letters if r["original_topic"] == "old"] == [lost]
    done = broker.resend_dead_letters(group="worker", where="properties['RETRY_TOPIC'] <> 'old'")
    assert (done.resent, done.already_resent) == (1, 0)
