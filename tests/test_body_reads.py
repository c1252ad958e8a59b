"""A large deliver pass whose listener workers read the bodies themselves
(deltamq/body_reads.py, ``file_reads.located``, ``deliver_files.consume``): the same
outcomes as through the engine, a worker that dies or hangs with the next chunk already
sent to it, a body file that cannot be read, and the reader's row groups."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.listeners import Recorder, read_log
from test_deliver_files import _scenario

from deltamq import Message
from deltamq.body_reads import FILE, ROW, BodyFiles, BodyReader
from deltamq.constants import Prop
from deltamq.jobs import deliver_files


@pytest.fixture
def by_workers(monkeypatch):
    """Every pass the files' way takes goes with where its bodies lie (none is below the
    limit, and the tests' small files count as a producer's large ones); counts the
    passes that did, and fails any that read the bodies here."""
    from deltamq import file_reads

    located = []
    real = file_reads.located

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        located.append(got is not None)
        return got

    def refused(*args, **kwargs):
        raise AssertionError("bodies read in the broker's process")

    monkeypatch.setattr(deliver_files, "MAX_MESSAGES", 0)
    monkeypatch.setattr(file_reads, "GROUPED_FROM", 1)  # the tests' small files count as grouped
    monkeypatch.setattr(file_reads, "located", spy)
    monkeypatch.setattr(file_reads, "bodies", refused)
    return located


def test_a_pass_read_by_the_workers_gives_the_engines_outcomes(
    broker, clock, warehouse_with, monkeypatch, by_workers
):
    by_files = _scenario(broker, clock, warehouse_with, "viaWorkers", "workers.jsonl")
    assert by_workers and all(by_workers)
    monkeypatch.setattr(deliver_files, "eligible", lambda *a: False)
    by_workers.clear()
    by_engine = _scenario(broker, clock, warehouse_with, "viaEngine", "engine.jsonl")
    assert not by_workers
    assert by_files == by_engine


def test_bodies_properties_and_bytes_arrive_as_sent(broker, clock, warehouse_with, by_workers):
    setup = warehouse_with("orders", queues=2, group="g", consume_message_batch_max_size=3)
    bodies = [f"body-{i}" * (i + 1) for i in range(20)]
    sent = [
        Message("orders", b, tags="t", keys=f"k{i}", properties={"color": "red"} if i < 5 else None)
        for i, b in enumerate(bodies)
    ]
    broker.producer("p").send_batch(sent[:10])
    broker.producer("p").send_batch(sent[10:])  # a second file
    r = broker.tick(clock.now_ms()).delivered
    assert all(by_workers) and r.consumed == 20
    seen = {c["body"]: c for c in read_log(setup.log)}
    assert set(seen) == set(bodies)
    assert {b for b, c in seen.items() if c["props"].get("color") == "red"} == set(bodies[:5])
    assert r.body_bytes == sum(len(b) for b in bodies)  # counted by the workers


@pytest.mark.parametrize("where", ["engine", "workers"])
def test_a_worker_that_dies_or_hangs_with_the_next_chunk_sent(
    broker, clock, warehouse_with, monkeypatch, where
):
    """Chunks of two, each led by the message the listener acts on: the first dies (its
    worker exits) while the second is already in the worker's pipe; the second hangs.
    The dying message is dead-lettered after three tries, the hanging one retried once,
    what follows it waits for the next pass, nothing lost or twice consumed."""
    if where == "workers":
        from deltamq import file_reads

        monkeypatch.setattr(deliver_files, "MAX_MESSAGES", 0)
        monkeypatch.setattr(file_reads, "GROUPED_FROM", 1)
    else:
        monkeypatch.setattr(deliver_files, "eligible", lambda *a: False)
    setup = warehouse_with("orders", queues=1)
    log = setup.log
    broker.create_group(
        "g",
        Recorder(log, "hostile"),
        consume_from="FIRST_OFFSET",
        consume_timeout_ms=4000,
        consume_message_batch_max_size=2,
    )
    broker.subscribe("g", "orders")
    bodies = ["exit", "ok1", "sleep", "ok2", "ok3"]
    broker.producer("p").send_batch([Message("orders", b) for b in bodies])
    t = clock.now_ms()
    started = time.monotonic()
    result = broker.tick(t).job("deliver").result
    # the hanging chunk's timeout and its message's (8 s), with room for a loaded machine;
    # a send that blocked behind the hang (the old protocol) took 30 s
    assert time.monotonic() - started < 4 * 4
    assert (result.consumed, result.retried, result.dead_lettered, result.poison) == (1, 1, 1, 1)
    calls = [c["body"] for c in read_log(log)]
    assert calls.count("exit") == 3 and calls.count("sleep") == 2 and "ok3" not in calls
    dlq = broker.sql("SELECT CAST(body AS STRING) AS b, properties FROM commit_log WHERE topic = '%DLQ%g'")
    assert [(r["b"], r["properties"][Prop.DLQ_REASON]) for r in dlq.collect()] == [("exit", "poison")]
    assert broker.tick(t + 1).job("deliver").result.consumed == 2
    assert [c["body"] for c in read_log(log)][-2:] == ["ok2", "ok3"]


def test_bodies_a_worker_cannot_read_hold_the_queue_and_say_why(broker, clock, warehouse_with, monkeypatch):
    """The files named to the workers cannot be read (gone under them): nothing is
    consumed, retried or dead-lettered, the pass says why, and the next pass, with the
    files readable, delivers everything once."""
    from deltamq import file_reads

    monkeypatch.setattr(deliver_files, "MAX_MESSAGES", 0)
    monkeypatch.setattr(file_reads, "GROUPED_FROM", 1)
    real = file_reads.located

    def gone(*args, **kwargs):
        rows, files = real(*args, **kwargs)
        missing = tuple(f"{p}.gone" for p in files.paths)
        return rows, BodyFiles(files.location, missing, files.schema)

    setup = warehouse_with("orders", queues=2, group="g")
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(6)])
    monkeypatch.setattr(file_reads, "located", gone)
    t = clock.now_ms()
    r = broker.tick(t).delivered
    assert (r.consumed, r.retried, r.dead_lettered) == (0, 0, 0)
    assert r.setup_errors and "bodies could not be read" in r.setup_errors[0][1]
    assert ".gone" in r.setup_errors[0][1]  # names the file
    assert read_log(setup.log) == []
    monkeypatch.setattr(file_reads, "located", real)
    assert broker.tick(t + 1).delivered.consumed == 6
    assert sorted(c["body"] for c in read_log(setup.log)) == [f"m{i}" for i in range(6)]


@pytest.mark.unit
def test_the_reader_takes_rows_across_row_groups_and_files_in_the_order_asked(tmp_path: Path):
    schema = pa.schema([("body", pa.binary()), ("born_ts", pa.int64())])
    paths = []
    for f in range(2):
        rows = pa.table(
            {"body": [b"f%d-r%d" % (f, i) for i in range(10)], "born_ts": list(range(10))}, schema
        )
        path = tmp_path / f"part-{f}.parquet"
        pq.write_table(rows, path, row_group_size=3)  # groups of rows 0-2, 3-5, 6-8, 9
        paths.append(str(path))
    files = BodyFiles(str(tmp_path), tuple(paths), schema)
    wanted = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 9), (1, 0), (0, 8), (0, 6), (1, 5)]
    chunk = pa.record_batch(
        {
            "msg_id": [f"m{k}" for k in range(len(wanted))],
            FILE: pa.array([f for f, _ in wanted], pa.int32()),
            ROW: pa.array([r for _, r in wanted], pa.int64()),
        }
    )
    reader = BodyReader(keep_bytes=1)  # keeps one group: the rest are read again
    got = reader.resolve(chunk, files, ("msg_id", "body", "born_ts"))
    assert got.schema.names == ["msg_id", "body", "born_ts"]
    assert got.column("body").to_pylist() == [b"f%d-r%d" % w for w in wanted]
    assert got.column("born_ts").to_pylist() == [r for _, r in wanted]
    assert got.column("msg_id").to_pylist() == chunk.column("msg_id").to_pylist()
    # consecutive rows of one group come as a slice of it (no copy of the bodies)
    kept = BodyReader()
    again = kept.resolve(chunk.slice(0, 2), files, ("body",))
    group = kept._groups[(paths[0], 0)].column("body").chunk(0)
    assert again.column("body").buffers()[2].address == group.buffers()[2].address


@pytest.mark.unit
def test_a_large_row_group_is_streamed_front_to_back_and_again_when_asked_behind(tmp_path: Path, monkeypatch):
    """Groups above STREAM_FROM rows are decoded STREAM_BATCH rows at a time: chunks
    asked in the files' order read each group once, holding only the rows from the
    current chunk on; a chunk behind the stream (a retry) starts it again; a chunk may
    span batches, skip rows, and take rows out of order within its span."""
    from deltamq import body_reads

    monkeypatch.setattr(body_reads, "STREAM_FROM", 4)
    monkeypatch.setattr(body_reads, "STREAM_BATCH", 3)
    schema = pa.schema([("body", pa.binary()), ("born_ts", pa.int64())])
    path = tmp_path / "part-0.parquet"
    pq.write_table(
        pa.table({"body": [b"r%d" % i for i in range(20)], "born_ts": list(range(20))}, schema), path
    )
    files = BodyFiles(str(tmp_path), (str(path),), schema, stream_from=body_reads.STREAM_FROM)
    opened = []
    real = body_reads._Stream

    class Counted(real):  # type: ignore[misc,valid-type]
        def __init__(self, batches, rows):
            opened.append(1)
            super().__init__(batches, rows)

    monkeypatch.setattr(body_reads, "_Stream", Counted)
    reader = BodyReader()

    def read(rows: list[int]) -> list[bytes]:
        chunk = pa.record_batch(
            {FILE: pa.array([0] * len(rows), pa.int32()), ROW: pa.array(rows, pa.int64())}
        )
        got = reader.resolve(chunk, files, ("body", "born_ts"))
        assert got.column("born_ts").to_pylist() == rows
        return got.column("body").to_pylist()

    assert read([0, 1, 2, 3, 4]) == [b"r%d" % i for i in range(5)]  # across two batches
    assert read([5, 6]) == [b"r5", b"r6"]
    held = reader._streams[(str(path), 0)]._held
    assert sum(b.num_rows for b in held) <= 6  # rows before the current batch are gone
    assert read([12, 9, 15]) == [b"r12", b"r9", b"r15"]  # rows skipped, out of order within
    assert len(opened) == 1
    assert read([1, 2]) == [b"r1", b"r2"]  # behind the stream: from the start again
    assert len(opened) == 2
    assert read([19]) == [b"r19"]
    assert reader._streams[(str(path), 0)]._batches is None  # read to the end: its file closed
    assert BodyReader().resolve(  # rows not in the files' order: the group decoded whole
        pa.record_batch({FILE: pa.array([0, 0], pa.int32()), ROW: pa.array([7, 2], pa.int64())}),
        BodyFiles(str(tmp_path), (str(path),), schema),
        ("body",),
    ).column("body").to_pylist() == [b"r7", b"r2"]
    assert len(opened) == 2
    with pytest.raises(IndexError):
        BodyReader().resolve(
            pa.record_batch({FILE: pa.array([0], pa.int32()), ROW: pa.array([25], pa.int64())}),
            files,
            ("body",),
        )


@pytest.mark.unit
def test_a_stream_of_a_file_gone_names_it(tmp_path: Path, monkeypatch):
    from deltamq import body_reads
    from deltamq.errors import StorageError

    monkeypatch.setattr(body_reads, "STREAM_FROM", 2)
    schema = pa.schema([("body", pa.binary())])
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"body": [b"a", b"b", b"c"]}, schema), path)
    files = BodyFiles(str(tmp_path), (str(path),), schema, stream_from=body_reads.STREAM_FROM)
    reader = BodyReader()
    chunk = pa.record_batch({FILE: pa.array([0], pa.int32()), ROW: pa.array([2], pa.int64())})
    reader._layout(files, str(path))  # the footer known, then the file gone
    path.unlink()
    with pytest.raises(StorageError, match="part-0.parquet"):
        reader.resolve(chunk, files, ("body",))


@pytest.mark.unit
def test_rows_go_by_place_each_file_to_one_table_in_group_file_and_row_order():
    """deliver_files.by_place: whole files dealt largest first to the emptiest table, each
    table's rows by group and instance, then file and row; a lone large file is cut into
    row ranges, a small one is not."""
    from deltamq.jobs.deliver_files import PLACE_ROWS, by_place

    def rows(places: list[tuple[str, int, int]]) -> pa.Table:
        return pa.table(
            {
                "consumer_group": [g for g, _, _ in places],
                "client_id": [""] * len(places),
                FILE: pa.array([f for _, f, _ in places], pa.int32()),
                ROW: pa.array([r for _, _, r in places], pa.int64()),
            }
        )

    # queue by queue, as a take gives them: queues interleaved in every file
    places = [("g", f, r) for q in range(2) for f in range(3) for r in range(q, 10 * (f + 1), 2)]
    places += [("a", 1, r) for r in range(5)]
    parts = by_place(rows(places), 2)
    assert sum(p.num_rows for p in parts) == len(places)
    seen_files = [set(p.column(FILE).to_pylist()) for p in parts]
    assert seen_files[0].isdisjoint(seen_files[1]) and set().union(*seen_files) == {0, 1, 2}
    assert seen_files[0] == {2}  # the largest file first, to the emptiest table
    for p in parts:
        groups = p.column("consumer_group").to_pylist()
        runs = [g for k, g in enumerate(groups) if k == 0 or groups[k - 1] != g]
        assert len(runs) == len(set(runs))  # each group's rows together
        for g in runs:
            places_of = zip(p.column(FILE).to_pylist(), p.column(ROW).to_pylist(), groups, strict=True)
            got = [(f, r) for f, r, h in places_of if h == g]
            assert got == sorted(got)
    one_large = by_place(rows([("g", 0, r) for r in range(2 * PLACE_ROWS)]), 2)
    assert [p.num_rows for p in one_large] == [PLACE_ROWS, PLACE_ROWS]
    assert one_large[0].column(ROW)[-1].as_py() < one_large[1].column(ROW)[0].as_py()
    assert [p.num_rows for p in by_place(rows([("g", 0, r) for r in range(100)]), 2)] == [100]
    tail = PLACE_ROWS + 10  # a second range would hold 10 rows: not cut
    assert [p.num_rows for p in by_place(rows([("g", 0, r) for r in range(tail)]), 2)] == [tail]


@pytest.mark.unit
def test_a_row_holding_another_message_than_the_index_says_is_refused_by_name(tmp_path: Path):
    schema = pa.schema([("body", pa.binary()), ("msg_id", pa.string())])
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"body": [b"a", b"b"], "msg_id": ["m0", "m1"]}, schema), path)
    files = BodyFiles(str(tmp_path), (str(path),), schema)

    def chunk(ids: list[str]) -> pa.RecordBatch:
        return pa.record_batch(
            {"msg_id": ids, FILE: pa.array([0, 0], pa.int32()), ROW: pa.array([0, 1], pa.int64())}
        )

    got = BodyReader().resolve(chunk(["m0", "m1"]), files, ("msg_id", "body"))
    assert got.column("body").to_pylist() == [b"a", b"b"]
    with pytest.raises(ValueError, match=r"part-0.parquet row 1 holds message m1, not mX"):
        BodyReader().resolve(chunk(["m0", "mX"]), files, ("msg_id", "body"))


@pytest.mark.parametrize("orderly", [True, False])
def test_files_of_large_row_groups_go_by_place_or_to_the_engine(
    broker, clock, warehouse_with, monkeypatch, by_workers, orderly
):
    """Each worker decodes whole row groups: files whose groups are larger than a
    producer's (an engine's send) are handed to the workers only when the rows can go
    by where they lie (concurrent groups: one worker per group, deliver_files.by_place);
    an orderly group's pass, whose partitions hold whole queues, is the engine's."""
    from deltamq import file_reads

    monkeypatch.setattr(file_reads, "LOCATED_GROUP_ROWS", 3)
    setup = warehouse_with("orders", queues=2)
    broker.create_group("g", Recorder(setup.log), consume_from="FIRST_OFFSET", orderly=orderly)
    broker.subscribe("g", "orders")
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(6)])  # one group of 6
    r = broker.tick(clock.now_ms()).delivered
    assert by_workers == [not orderly]  # located (by place), or the engine's pass
    assert r.consumed == 6 and sorted(c["body"] for c in read_log(setup.log)) == [f"m{i}" for i in range(6)]


def test_instances_of_a_broadcast_group_each_get_every_message_once_by_place(
    broker, clock, warehouse_with, by_workers
):
    """A concurrent pass of two instances over two topics whose messages lie in one file:
    the rows go by place in one table, each instance's rows together (the take lists
    them instance by instance within each topic), and each instance gets each message
    once, as itself."""
    setup = warehouse_with("A", queues=1)
    broker.create_topic("B", queues=1)
    broker.create_group(
        "g", Recorder(setup.log), mode="BROADCASTING", instances=["c1", "c2"], consume_from="FIRST_OFFSET"
    )
    broker.subscribe("g", "A")
    broker.subscribe("g", "B")
    broker.producer("p").send_batch([Message(t, f"{t}{i}") for t in ("A", "B") for i in range(4)])  # one file
    r = broker.tick(clock.now_ms()).delivered
    assert all(by_workers) and r.consumed == 16
    calls = [(c["instance"], c["body"]) for c in read_log(setup.log)]
    assert sorted(calls) == sorted((i, f"{t}{k}") for i in ("c1", "c2") for t in ("A", "B") for k in range(4))


def test_an_engines_large_row_groups_are_streamed_by_the_workers_each_message_once(
    broker, clock, warehouse_with, by_workers, monkeypatch
):
    """An engine's send writes large row groups with the queues interleaved: the listener
    workers stream those above STREAM_FROM rows (in their own processes: the broker
    tells them the threshold), and every message reaches the listener once with its own
    body."""
    import glob

    from deltamq import body_reads

    monkeypatch.setattr(body_reads, "STREAM_FROM", 4_096)  # Sail's groups of short rows are smaller
    n = 20_000
    setup = warehouse_with("orders", queues=3, group="g", consume_message_batch_max_size=500)
    rows = broker.engine.spark.range(n).selectExpr("'orders' AS topic", "CAST(id AS STRING) AS body")
    broker.producer("p").send_dataframe(rows.coalesce(1))
    groups = [
        pq.ParquetFile(f).metadata.row_group(0).num_rows
        for f in glob.glob(f"{broker.context.warehouse.uri('commit_log')}/**/*.parquet", recursive=True)
    ]
    assert max(groups) > body_reads.STREAM_FROM  # the pass meets a group it must stream
    r = broker.tick(clock.now_ms()).delivered
    assert all(by_workers) and r.consumed == n
    assert sorted(int(c["body"]) for c in read_log(setup.log)) == list(range(n))


def test_the_index_dispatch_appends_is_read_by_deliver_without_decoding(
    broker, clock, warehouse_with, monkeypatch
):
    """Dispatch hands the index files it wrote to the broker's snapshot of consume_queue
    (Warehouse.arrow_appender's on_written): deliver's take then decodes none of them."""
    from deltamq import delta_read, file_reads
    from deltamq.jobs import dispatch

    warehouse_with("orders", queues=2)
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(8)])
    wh = broker.context.warehouse
    wh.snapshot("consume_queue")  # known before the append (a tick's runner has it)
    assert dispatch.run(broker.context, clock.now_ms()).rows_out == 8
    decoded = []
    real = delta_read.FileSnapshot._decode

    def counted(self, f, *args, **kwargs):
        decoded.append(f.path)
        return real(self, f, *args, **kwargs)

    monkeypatch.setattr(delta_read.FileSnapshot, "_decode", counted)
    found = file_reads.index_by_range(
        wh, [("orders", 0, 0, 100), ("orders", 1, 0, 100)], ["msg_id", "queue_offset"]
    )
    assert found is not None and sum(t.num_rows for t in found) == 8
    assert not [p for p in decoded if "consume_queue" in p]


@pytest.fixture
def located_results(monkeypatch):
    """Every pass the files' way takes above no limit; what ``file_reads.located`` gave
    each (None: the pass went to the engine)."""
    from deltamq import file_reads

    monkeypatch.setattr(deliver_files, "MAX_MESSAGES", 0)
    results = []
    real = file_reads.located

    def spy(*args, **kwargs):
        results.append(real(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(file_reads, "located", spy)
    return results


def test_small_producer_files_leave_a_large_pass_to_the_engine(
    broker, clock, warehouse_with, located_results
):
    """Files under GROUPED_FROM rows hold their queues' rows mixed: every worker would
    decode all of them, once for each of its queues; such a pass is the engine's."""
    results = located_results
    setup = warehouse_with("orders", queues=2, group="g")
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(6)])
    assert broker.tick(clock.now_ms()).delivered.consumed == 6
    assert results == [None] and len(read_log(setup.log)) == 6


def test_a_small_send_beside_a_large_one_leaves_the_large_ones_pass_to_the_workers(
    broker, clock, warehouse_with, located_results
):
    """Another send's small file, close in batch id and position (the same second), is
    not the pass's and does not decide its way."""
    from deltamq.delta_append import GROUPED_FROM

    results = located_results
    warehouse_with("big", queues=2, group="g", consume_message_batch_max_size=1000)
    broker.create_topic("other", queues=1)
    p = broker.producer("p")
    p.send_batch([Message("big", f"m{i}") for i in range(GROUPED_FROM)])
    clock.advance(seconds=1)  # batch ids in send order: the small one's between the others
    p.send_batch([Message("other", "x")])  # a file under GROUPED_FROM rows, not taken,
    clock.advance(seconds=1)
    p.send_batch([Message("big", f"n{i}") for i in range(GROUPED_FROM)])  # between two that are
    assert broker.tick(clock.now_ms()).delivered.consumed == 2 * GROUPED_FROM
    assert results and all(r is not None for r in results)
