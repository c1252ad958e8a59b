"""Compaction (delta-rs behind the engine seam): fewer files, the same rows and query
results, time travel to an earlier version, dispatch unaffected; vacuum removes the files
no retained version needs."""

from __future__ import annotations

import os

import pytest
from deltalake import DeltaTable
from support.listeners import Recorder

from deltamq import Message
from deltamq.jobs import compact
from deltamq.tables.consume_queue import load_dispatch_state

DAY = 86_400_000


def _disk_files(wh, table: str) -> int:
    return sum(
        1
        for e in wh.storage.list(wh.uri(table), recursive=True)
        if not e.name.startswith("_delta_log") and e.name.endswith(".parquet")
    )


@pytest.mark.story(s3="slow")
def test_compaction_keeps_rows_and_time_travel_and_vacuum_frees_files(broker, clock):
    broker.reconfigure(compact=False)  # the ticks' retain passes must not compact
    broker.create_topic("orders", queues=2)
    broker.create_group("g", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    p = broker.producer("shop")
    for i in range(12):  # many small commits over two days
        p.send_batch([Message("orders", f"m{i}-{j}".encode(), keys=f"k{j}") for j in range(3)])
        broker.tick(clock.now_ms())
        clock.advance(minutes=240)
    wh = broker.warehouse
    queries = {
        "index": "SELECT topic, queue_id, queue_offset, msg_id FROM consume_queue ORDER BY 1, 2, 3",
        "bodies": "SELECT msg_id, CAST(body AS STRING) AS b, store_date FROM commit_log ORDER BY msg_id",
        "offsets": "SELECT consumer_group, topic, queue_id, next_offset FROM offsets ORDER BY 1, 2, 3",
        "ticks": "SELECT tick_id, job, status FROM job_runs ORDER BY 1, 2",
    }
    before = {k: broker.sql(q).collect() for k, q in queries.items()}
    live = {
        t: len(wh.delta_rs(t).file_uris()) for t in ("commit_log", "consume_queue", "job_runs", "offsets")
    }
    version = wh.delta_rs("consume_queue").version()
    result = compact.run(broker.context, clock.now_ms(), vacuum=False)
    after_live = {t: len(wh.delta_rs(t).file_uris()) for t in live}
    assert result.files_removed > result.files_added > 0
    assert (
        after_live["consume_queue"] < live["consume_queue"] and after_live["commit_log"] < live["commit_log"]
    )
    assert {k: broker.sql(q).collect() for k, q in queries.items()} == before
    # time travel to the version before compaction (through delta-rs: Sail's versionAsOf
    # fails for versions older than the newest checkpoint, compaction or not — engines.md)
    old = DeltaTable(
        wh.uri("consume_queue"), version=version, storage_options=wh.storage.delta_rs_options()
    ).to_pyarrow_table(columns=["msg_id"])
    assert sorted(old.column("msg_id").to_pylist()) == sorted(r["msg_id"] for r in before["index"])
    # dispatch skips the compaction commits: new messages are indexed once, old ones not again
    p.send(Message("orders", b"after"))
    assert broker.tick(clock.now_ms()).job("dispatch").rows_out == 1
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == len(before["index"]) + 1
    # vacuum (retention 0 here): only the files the latest versions reference stay on disk
    broker.reconfigure(vacuum_retention_ms=0)
    freed = compact.run(broker.context, clock.now_ms())
    assert freed.vacuumed > 0
    for t in ("consume_queue", "commit_log"):
        assert _disk_files(wh, t) == len(wh.delta_rs(t).file_uris())
    assert broker.sql(queries["bodies"]).count() == len(before["bodies"]) + 1


def _log_versions(path: str) -> list[int]:
    return sorted(int(n[:20]) for n in os.listdir(os.path.join(path, "_delta_log")) if n.endswith(".json"))


@pytest.mark.slow
def test_log_cleanup_drops_entries_below_the_checkpoint_but_keeps_what_dispatch_has_not_read(broker, clock):

    broker.reconfigure(compact=False)
    broker.create_topic("orders", queues=2)
    broker.create_group("g", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    p = broker.producer("shop")
    for i in range(14):  # > 10 commits per table: Sail has written checkpoints
        p.send(Message("orders", f"m{i}".encode()))
        clock.advance(seconds=30)
        broker.tick(clock.now_ms())
    wh = broker.warehouse
    dispatched = load_dispatch_state(wh).version
    for i in range(12):  # stored, not dispatched: dispatch still needs these entries
        p.send(Message("orders", f"late{i}".encode()))
    offsets_before = _log_versions(wh.path("offsets"))
    index = broker.sql(
        "SELECT topic, queue_id, queue_offset, msg_id FROM consume_queue ORDER BY 1, 2, 3"
    ).collect()

    # entries younger than log_retention_ms (wall clock) stay
    assert compact.run(broker.context, clock.now_ms(), vacuum=False).log_entries_removed == 0
    broker.reconfigure(log_retention_ms=0)
    removed = compact.run(broker.context, clock.now_ms(), vacuum=False).log_entries_removed
    assert removed > 0
    after = _log_versions(wh.path("offsets"))
    assert len(after) < len(offsets_before) and after[-1] >= offsets_before[-1]  # the newest stay
    # commit_log: every entry after dispatch's version is kept
    assert set(range(dispatched + 1, dispatched + 13)) <= set(_log_versions(wh.path("commit_log")))
    # tables read the same through Sail and delta-rs; dispatch indexes the late messages once
    assert (
        broker.sql(
            "SELECT topic, queue_id, queue_offset, msg_id FROM consume_queue ORDER BY 1, 2, 3"
        ).collect()
        == index
    )
    assert DeltaTable(wh.path("offsets")).to_pyarrow_table().num_rows > 0
    clock.advance(seconds=30)
    assert broker.tick(clock.now_ms()).job("dispatch").rows_out == 12
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == len(index) + 12


@pytest.mark.slow
def test_ticks_keep_the_delta_logs_short_between_retention_passes(broker, clock):
    import time

    broker.create_topic("orders")
    broker.create_group("g", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    p = broker.producer("shop")
    removed = 0
    for i in range(30):  # 30 s apart: the hourly retention pass never comes
        p.send(Message("orders", f"m{i}".encode()))
        clock.advance(seconds=30)
        r = broker.tick(clock.now_ms()).job("retain")
        assert r.status == "SKIPPED"
        removed += r.details["log_entries_removed"]
        if i == 14:  # from now on every entry below a checkpoint may go
            broker.reconfigure(log_retention_ms=0)
            time.sleep(1.0)  # the cleanup runs at most once a wall-clock second
    offsets = _log_versions(broker.warehouse.path("offsets"))
    assert removed > 0 and offsets[0] > 0  # the oldest entries are gone ...
    assert len(offsets) < 30  # ... and the log holds about one checkpoint interval
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == 30


def _newest_checkpoint_removes(path: str) -> int:
    import glob

    import pyarrow.parquet as pq

    newest = sorted(glob.glob(os.path.join(path, "_delta_log", "*.checkpoint.parquet")))[-1]
    t = pq.read_table(newest, columns=["remove"])
    return t.num_rows - t.column("remove").null_count


@pytest.mark.slow
def test_checkpoints_drop_the_tombstones_of_rewritten_files(broker, clock, tmp_path):
    import time

    from deltamq.jobs.compact import TOMBSTONE_RETENTION

    broker.create_topic("orders")
    broker.create_group("g", Recorder(tmp_path / "g.jsonl"), consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    p = broker.producer("shop")

    def busy_ticks(n: int, pause_s: float = 0.0) -> None:
        for i in range(n):
            p.send(Message("orders", f"m{i}".encode()))
            clock.advance(seconds=30)
            broker.tick(clock.now_ms())
            time.sleep(pause_s)

    busy_ticks(3)
    offsets = broker.warehouse.path("offsets")
    # created with the default (log_retention_ms, 60 s); a retention pass sets a changed one
    assert DeltaTable(offsets).metadata().configuration[TOMBSTONE_RETENTION] == "interval 60 seconds"
    assert compact.set_tombstone_retention(broker.context) == 0
    broker.reconfigure(log_retention_ms=1_000)
    assert compact.set_tombstone_retention(broker.context) >= 10  # every table
    assert DeltaTable(offsets).metadata().configuration[TOMBSTONE_RETENTION] == "interval 1 seconds"
    time.sleep(1.2)
    before = DeltaTable(offsets).version()
    # at most five ticks a second (a busy tick can take a tenth of one): the rewrites span
    # four seconds or more, so those of the last second are well under half of them
    busy_ticks(20, pause_s=0.2)
    rewrites = DeltaTable(offsets).version() - before
    # every MERGE into offsets (two a busy tick: the attempt record carrying dispatch's
    # hint, then deliver's offsets) removed a file, yet the newest checkpoint keeps only
    # the tombstones of about the last second
    assert rewrites >= 40 and _newest_checkpoint_removes(offsets) < rewrites // 2
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == 23


def test_a_day_dispatch_has_not_read_is_not_compacted_until_it_has(broker, clock):
    """Dispatch reads the files each commit added: a closed day of commit_log that still
    holds commits it has not read stays as written (compacted away and then vacuumed, its
    files would be gone when dispatch comes to them); once dispatched, it is compacted."""
    broker.reconfigure(compact=False)
    broker.create_topic("orders", queues=2)
    broker.create_group("g", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    p = broker.producer("shop")
    for i in range(4):  # small commits, none dispatched
        p.send_batch([Message("orders", f"m{i}-{j}".encode()) for j in range(3)])
    wh = broker.warehouse
    files = len(wh.delta_rs("commit_log").file_uris())
    later = clock.now_ms() + 2 * DAY
    compact.run(broker.context, later)
    assert len(wh.delta_rs("commit_log").file_uris()) == files  # waiting for dispatch
    broker.tick(later)  # dispatches (and delivers) them
    assert (
        broker.sql("SELECT count(*) AS n FROM consume_queue WHERE topic = 'orders'").collect()[0]["n"] == 12
    )
    compact.run(broker.context, later + 1)
    assert len(wh.delta_rs("commit_log").file_uris()) < files
