"""Reads without an engine (deltamq/delta_read.py): a snapshot of a table's files kept
between reads and brought up to date from new log entries only; what it reads matches
delta-rs after appends, rewrites and log cleanup; partition values typed; statistics
pick files; tables it cannot read plainly are refused. Plain delta-rs tables on a local
disk; the pull client reading through it is in tests/test_pull.py."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from deltamq.delta_append import BlindAppender, Unsupported
from deltamq.delta_read import FileSnapshot, _check_protocol
from deltamq.storage import Storage

pytestmark = pytest.mark.unit

SCHEMA = pa.schema([("topic", pa.string()), ("off", pa.int64()), ("day", pa.date32()), ("body", pa.binary())])


def _rows(offs: range, topic: str = "orders", day: date = date(2026, 11, 26)) -> pa.Table:
    n = len(offs)
    return pa.table(
        {"topic": [topic] * n, "off": list(offs), "day": [day] * n, "body": [b"x%d" % i for i in offs]},
        schema=SCHEMA,
    )


def _table(tmp_path: Path) -> tuple[Storage, str]:
    uri = str(tmp_path / "t")
    write_deltalake(uri, _rows(range(0)), partition_by=["topic", "day"])
    return Storage(str(tmp_path)), uri


def _all(snap: FileSnapshot) -> list[dict]:
    return snap.read(snap.files(), ["topic", "off", "day", "body"]).sort_by("off").to_pylist()


def _delta_rs(uri: str) -> list[dict]:
    return (
        DeltaTable(uri).to_pyarrow_table().select(["topic", "off", "day", "body"]).sort_by("off").to_pylist()
    )


def test_a_snapshot_follows_appends_by_reading_only_the_new_entries(tmp_path):
    storage, uri = _table(tmp_path)
    snap = FileSnapshot(storage, uri)
    assert snap.refresh() == 0 and _all(snap) == []
    write_deltalake(uri, _rows(range(3)), mode="append")
    write_deltalake(uri, _rows(range(3, 5), topic="%RETRY%g x", day=date(2026, 11, 27)), mode="append")
    assert snap.refresh() == 2
    assert _all(snap) == _delta_rs(uri)
    # typed partition values, a topic with characters Hive-escaped and URI-encoded
    assert {(r["topic"], r["day"]) for r in _all(snap)} == {
        ("orders", date(2026, 11, 26)),
        ("%RETRY%g x", date(2026, 11, 27)),
    }
    # nothing new: one look-up of the next entry, the same version
    assert snap.refresh() == 2


def test_files_removed_by_a_rewrite_leave_the_snapshot(tmp_path):
    storage, uri = _table(tmp_path)
    for i in range(4):
        write_deltalake(uri, _rows(range(i * 10, i * 10 + 10)), mode="append")
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    assert len(snap.files()) == 4
    DeltaTable(uri).optimize.compact()  # removes the four files, adds one
    DeltaTable(uri).delete("off < 5")
    snap.refresh()
    assert _all(snap) == _delta_rs(uri)
    assert [r["off"] for r in _all(snap)] == list(range(5, 40))


def test_statistics_pick_the_files_of_a_range_and_the_filter_the_rows(tmp_path):
    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    for i in range(5):
        appender.append(_rows(range(i * 100, i * 100 + 100)))
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    picked = snap.files(lambda f: f.overlaps("off", 250, 320))
    assert len(picked) == 2
    got = snap.read(picked, ["off", "body"], (pc.field("off") >= 250) & (pc.field("off") <= 320)).sort_by(
        "off"
    )
    assert got.column("off").to_pylist() == list(range(250, 321))
    assert got.column("body").to_pylist()[0] == b"x250"
    assert snap.files(lambda f: f.overlaps("off", 1000, 2000)) == []


def test_a_reader_behind_log_cleanup_loads_the_table_afresh(tmp_path):
    storage, uri = _table(tmp_path)
    snap = FileSnapshot(storage, uri, recheck_s=0.0)
    snap.refresh()
    for i in range(6):
        write_deltalake(uri, _rows(range(i, i + 1)), mode="append")
    DeltaTable(uri).create_checkpoint()
    for p in sorted((Path(uri) / "_delta_log").glob("*.json"))[:-1]:
        p.unlink()  # cleanup: only the newest entry and the checkpoint remain
    assert snap.refresh() == 6
    assert [r["off"] for r in _all(snap)] == list(range(6))


def test_a_decoded_file_is_kept_and_the_cache_stays_within_its_bound(tmp_path):
    storage, uri = _table(tmp_path)
    for i in range(3):
        write_deltalake(uri, _rows(range(i * 1000, i * 1000 + 1000)), mode="append")
    snap = FileSnapshot(storage, uri, cache_bytes=1)
    snap.refresh()
    assert len(_all(snap)) == 3000
    assert len(snap._cache) == 1  # the bound evicts all but the latest file
    big = FileSnapshot(storage, uri)
    big.refresh()
    _all(big)
    first = next(iter(big._cache.values()))
    _all(big)
    assert any(t is first for t in big._cache.values())  # read once, then kept


def test_a_few_columns_are_read_alone_unless_the_file_is_kept(tmp_path):
    storage, uri = _table(tmp_path)
    write_deltalake(uri, _rows(range(5), day=date(2026, 11, 27)), mode="append")
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    (f,) = snap.files()
    narrow = snap.columns(f, ["off", "topic", "day"])
    assert narrow.column_names == ["off", "topic", "day"] and not snap._cache  # not decoded whole
    assert narrow.to_pylist() == snap.whole(f).select(["off", "topic", "day"]).to_pylist()
    assert snap.columns(f, ["off"]).column("off").to_pylist() == list(range(5))  # from the kept file now


def test_sorted_keys_find_rows_by_binary_search():
    import numpy as np

    from deltamq.delta_read import SortedKeys

    keys = np.array([7, 3, 9, 3, 1], dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    sk = SortedKeys(keys[order], order)
    hit, rows = sk.rows_equal(np.array([3, 4, 9, 10, 1], dtype=np.int64))
    assert hit.tolist() == [True, False, True, False, True]
    assert [int(r) for r, h in zip(rows, hit, strict=True) if h] == [1, 2, 4]
    assert sorted(sk.rows_between(3, 9).tolist()) == [0, 1, 3]  # keys 3, 3, 7
    assert sk.rows_between(10, 20).tolist() == []


def test_index_rows_found_by_key_are_the_filters_rows(tmp_path):
    """``file_reads.index_rows`` finds a range's rows by binary search over (queue, offset)
    keys; a file whose values do not fit the key is filtered instead: both give the rows a
    filter gives."""
    from deltamq import file_reads

    storage = Storage(str(tmp_path))
    uri = str(tmp_path / "consume_queue")
    rows = pa.table(
        {
            "topic": ["orders"] * 8 + ["other"] * 2,
            "queue_id": pa.array([0, 1, 0, 1, 0, 1, 2, 2, 0, 0], pa.int32()),
            "queue_offset": pa.array([0, 0, 1, 1, 2, 2, 0, (1 << 41), 0, 1], pa.int64()),
            "msg_id": [f"m{i}" for i in range(10)],
        }
    )
    write_deltalake(uri, rows.slice(0, 6), partition_by=["topic"])
    write_deltalake(uri, rows.slice(6), mode="append")  # offsets past 2^40: filtered
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    wh = SimpleNamespace(snapshot=lambda table: snap)
    ranges = [("orders", 0, 1, 3), ("orders", 1, 0, 1), ("orders", 2, 0, 1 << 42), ("other", 0, 1, 2)]
    got = file_reads.index_rows(wh, ranges, ["msg_id"])
    assert sorted(got.column("msg_id").to_pylist()) == ["m1", "m2", "m4", "m6", "m7", "m9"]
    overlapping = [("orders", 0, 0, 2), ("orders", 0, 1, 3)]  # two groups' takes of one queue
    got = file_reads.index_rows(wh, overlapping, ["msg_id"])
    assert sorted(got.column("msg_id").to_pylist()) == ["m0", "m2", "m4"]  # each row once


def test_deletion_vectors_and_column_mapping_are_refused(tmp_path):
    storage, uri = _table(tmp_path)
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    entry = {
        "add": {
            "path": "topic=orders/day=2026-11-26/x.parquet",
            "partitionValues": {"topic": "orders", "day": "2026-11-26"},
            "size": 1,
            "modificationTime": 0,
            "dataChange": True,
            "deletionVector": {"storageType": "i", "pathOrInlineDv": "x", "sizeInBytes": 1, "cardinality": 1},
        }
    }
    (Path(uri) / "_delta_log" / f"{1:020d}.json").write_text(json.dumps(entry) + "\n")
    with pytest.raises(Unsupported, match="deletion vectors"):
        snap.refresh()
    for version, features in ((2, []), (3, ["deletionVectors"]), (3, ["columnMapping"])):
        protocol = SimpleNamespace(min_reader_version=version, reader_features=features)
        with pytest.raises(Unsupported, match=f"reader protocol {version}"):
            _check_protocol(uri, protocol)
    _check_protocol(uri, SimpleNamespace(min_reader_version=3, reader_features=["timestampNtz"]))


def test_messages_built_column_by_column_match_the_row_by_row_rule():
    """deltamq.message.messages_of (pull clients, listeners) against stored_fields, the
    one-row rule: retried messages show their original topic and id, suspends count as
    reconsumes, NULL flags read 0; extra fields per row."""
    from deltamq.constants import Prop
    from deltamq.message import StoredMessage, messages_of, stored_fields

    rows = [
        {
            "topic": "orders",
            "msg_id": "a",
            "properties": [(Prop.UNIQ_KEY, "u1")],
            "suspends": 2,
            "flag": None,
        },
        {
            "topic": "%RETRY%g",
            "msg_id": "b",
            "properties": [(Prop.RETRY_TOPIC, "orders"), (Prop.ORIGIN_MESSAGE_ID, "o1")],
            "suspends": None,
            "flag": 3,
        },
        {"topic": "%RETRY%g", "msg_id": "c", "properties": None, "suspends": 0, "flag": 0},
    ]
    common = {"queue_id": 1, "queue_offset": 7, "body": b"x", "tags": "T", "keys": None, "born_ts": 5}
    full = [r | common | {"store_ts": 9, "reconsume_times": 1, "sys_flag": None} for r in rows]
    table = pa.Table.from_pylist(
        full,
        schema=pa.schema(
            [
                ("topic", pa.string()),
                ("msg_id", pa.string()),
                ("properties", pa.map_(pa.string(), pa.string())),
                ("suspends", pa.int32()),
                ("flag", pa.int32()),
                ("queue_id", pa.int32()),
                ("queue_offset", pa.int64()),
                ("body", pa.binary()),
                ("tags", pa.string()),
                ("keys", pa.string()),
                ("born_ts", pa.int64()),
                ("store_ts", pa.int64()),
                ("reconsume_times", pa.int32()),
                ("sys_flag", pa.int32()),
            ]
        ),
    )
    got = messages_of(table, StoredMessage)
    assert got == [StoredMessage(**stored_fields(r)) for r in full]
    assert [m.msg_id for m in got] == ["u1", "o1", "c"] and got[1].topic == "orders"
    assert got[0].reconsume_times == 3 and got[0].flag == 0
    ticketed = messages_of(table, StoredMessage, seen=["p", "q", "r"])
    assert [m.__dict__["seen"] for m in ticketed] == ["p", "q", "r"]


def test_files_written_before_a_column_was_added_read_it_as_null(tmp_path):
    """An upgrade adds columns with a schema-merging append: older files lack them."""
    storage, uri = _table(tmp_path)
    write_deltalake(uri, _rows(range(2)), mode="append")
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    assert len(_all(snap)) == 2  # decoded and cached with the old schema
    wider = _rows(range(2, 3)).append_column("extra", pa.array([7], pa.int64()))
    write_deltalake(uri, wider, mode="append", schema_mode="merge")
    snap.refresh()  # a metaData change: loaded again, the cache dropped
    got = snap.read(snap.files(), ["off", "extra"]).sort_by("off").to_pylist()
    assert got == [{"off": 0, "extra": None}, {"off": 1, "extra": None}, {"off": 2, "extra": 7}]


def test_a_message_stored_twice_with_the_same_ids_is_joined_once():
    """commit_log can hold a message twice (an ambiguous commit written again): the
    bodies' join hands each index row out once, whichever copy it takes."""
    from deltamq.file_reads import join_bodies

    index = pa.table(
        {"cl_batch_id": [1, 1], "cl_batch_pos": [0, 1], "msg_id": ["a", "b"], "queue_offset": [5, 6]}
    )
    part = pa.table({"batch_id": [1, 1], "batch_pos": [0, 1], "msg_id": ["a", "b"], "body": [b"A", b"B"]})
    again = pa.table({"batch_id": [1], "batch_pos": [0], "msg_id": ["a"], "body": [b"A"]})
    got = join_bodies(index, [part, again], ["body"]).sort_by("queue_offset").to_pylist()
    assert [(r["msg_id"], r["body"]) for r in got] == [("a", b"A"), ("b", b"B")]
    twice_in_one = pa.concat_tables([part, again])
    assert join_bodies(index, [twice_in_one], ["body"]).num_rows == 2


def _commit_log_like(tmp_path: Path, rows: int, queues: int) -> tuple[Storage, str]:
    """A table of commit_log's key columns written by the producers' appender: files of
    many rows in row groups by topic and queue (deltamq/delta_append.py)."""
    uri = str(tmp_path / "cl")
    schema = pa.schema(
        [("topic", pa.string()), ("queue_id", pa.int32()), ("batch_id", pa.int64()),
         ("batch_pos", pa.int64()), ("msg_id", pa.string()), ("body", pa.binary())]
    )  # fmt: skip
    write_deltalake(uri, schema.empty_table())
    storage = Storage(str(tmp_path))
    data = pa.table(
        {
            "topic": ["orders"] * rows,
            "queue_id": pa.array([i % queues for i in range(rows)], pa.int32()),
            "batch_id": [7] * rows,
            "batch_pos": list(range(rows)),
            "msg_id": [f"m{i}" for i in range(rows)],
            "body": [b"b%d" % i for i in range(rows)],
        },
        schema=schema,
    )
    BlindAppender(storage, uri, group_by=("topic", "queue_id")).append(data)
    return storage, uri


def test_a_large_producer_file_is_written_in_row_groups_by_queue_and_read_a_group_at_a_time(tmp_path):
    from deltamq.delta_append import GROUP_ROWS

    rows = 5 * GROUP_ROWS + 10  # two queues of 2.5 groups each: long runs are cut
    storage, uri = _commit_log_like(tmp_path, rows, queues=2)
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    (f,) = snap.files()
    meta = storage.parquet_metadata(f.path)
    per_group = [
        pq.ParquetFile(f.path).read_row_group(i, columns=["queue_id"]) for i in range(meta.num_row_groups)
    ]
    # one queue per group, none longer than GROUP_ROWS, more than one group per queue; every row kept
    assert all(len(set(g.column("queue_id").to_pylist())) == 1 for g in per_group)
    assert max(g.num_rows for g in per_group) == GROUP_ROWS and sum(g.num_rows for g in per_group) == rows
    assert sorted(_delta_rs_rows(uri)) == list(range(rows))
    queues_of = {i: g.column("queue_id")[0].as_py() for i, g in enumerate(per_group)}
    assert sum(1 for q in queues_of.values() if q == 1) >= 3
    # rows of queue 1 only, from several of its groups, in the order asked
    keyed = snap.sorted_keys(f, "batch_pos", lambda t: t.column("batch_pos").to_numpy(), ["batch_pos"])
    assert keyed is not None
    last_odd = rows - 1 if (rows - 1) % 2 else rows - 2
    wanted = np.array([last_odd, 1, 2 * GROUP_ROWS + 1, 3, GROUP_ROWS * 4 + 7], dtype=np.int64)
    assert all(p % 2 == 1 for p in wanted)  # queue 1 holds the odd positions
    hit, at = keyed.rows_equal(wanted)
    assert hit.all()
    got = snap.taken(f, at, ["batch_pos", "msg_id", "queue_id"]).to_pylist()
    assert [r["batch_pos"] for r in got] == wanted.tolist()
    assert [r["msg_id"] for r in got] == [f"m{p}" for p in wanted] and {r["queue_id"] for r in got} == {1}
    decoded = {k[1] for k in snap._groups}
    assert len(decoded) >= 3 and all(queues_of[i] == 1 for i in decoded)
    assert f.path not in snap._cache  # the file was never decoded whole
    # asked for nothing: an empty table of those columns, nothing decoded
    empty = snap.taken(f, np.zeros(0, dtype=np.int64), ["batch_pos", "body"])
    assert empty.num_rows == 0 and empty.column_names == ["batch_pos", "body"]


def test_a_large_append_is_written_as_one_file_per_writer_cut_between_row_groups(tmp_path, monkeypatch):
    import json

    from deltamq import delta_append
    from deltamq.delta_append import GROUP_ROWS

    monkeypatch.setattr(delta_append, "SPLIT_FROM", 1)  # every grouped append counts as large
    monkeypatch.setattr(delta_append, "WRITERS", 2)
    rows = 5 * GROUP_ROWS + 10
    storage, uri = _commit_log_like(tmp_path, rows, queues=2)
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    files = snap.files()
    assert len(files) == 2
    assert sorted(_delta_rs_rows(uri)) == list(range(rows))  # every row once, across the two
    entry = sorted((tmp_path / "cl" / "_delta_log").glob("*.json"))[-1]
    adds = [json.loads(line)["add"] for line in entry.read_text().splitlines() if '"add"' in line]
    assert len(adds) == 2 and all(a["tags"] == {"deltamq.orderedBy": "topic,queue_id"} for a in adds)
    counts = [json.loads(a["stats"])["numRecords"] for a in adds]
    assert sum(counts) == rows and min(counts) >= 2 * GROUP_ROWS  # about even, whole row groups
    for f in files:
        pf = pq.ParquetFile(f.path)
        groups = [pf.read_row_group(i, columns=["queue_id"]) for i in range(pf.metadata.num_row_groups)]
        assert all(len(set(g.column("queue_id").to_pylist())) == 1 for g in groups)
        body = pf.metadata.row_group(0).column(pf.schema_arrow.get_field_index("body"))
        # the bodies: no dictionary tried, no min/max kept; the narrow columns keep both
        assert not body.has_dictionary_page and not body.is_stats_set
        assert pf.metadata.row_group(0).column(pf.schema_arrow.get_field_index("msg_id")).is_stats_set


def test_a_small_append_stays_one_file(tmp_path):
    storage, uri = _commit_log_like(tmp_path, 100, queues=2)
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    assert len(snap.files()) == 1


@pytest.mark.parametrize(
    ("values", "least", "most", "expected"),
    [
        ([0] * 5 + [1] * 2 + [2] * 10 + [None] * 3, 1, 100, [(0, 5), (5, 7), (7, 17), (17, 20)]),
        ([0] * 5 + [1] * 2 + [2] * 10 + [None] * 3, 4, 100, [(0, 5), (5, 17), (17, 20)]),
        ([0] * 5 + [1] * 2 + [2] * 10, 1, 4, [(0, 4), (4, 5), (5, 7), (7, 11), (11, 15), (15, 17)]),
        (list(range(50)), 10, 100, [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50)]),
        ([None, None, 1, 1], 1, 10, [(0, 2), (2, 4)]),
    ],
)
def test_row_group_ranges_cut_where_the_value_changes_small_values_share_and_long_ones_split(
    values, least, most, expected
):
    from deltamq.delta_append import _runs

    assert _runs(pa.table({"q": pa.array(values, pa.int32())}), ["q"], least, most) == expected


def _delta_rs_rows(uri: str) -> list[int]:
    return DeltaTable(uri).to_pyarrow_table().column("batch_pos").to_pylist()


def test_bodies_located_by_position_are_taken_once_and_only_with_their_msg_id(tmp_path):
    """The join-free path of file_reads.bodies (every file located by binary search):
    a message stored twice (a second file of the same batch) is taken once, from the
    first file, and a position whose stored msg_id is not the index row's is left out,
    as the join leaves it."""
    from deltamq.file_reads import _located, _placed, join_bodies

    storage, uri = _commit_log_like(tmp_path, 6, queues=2)
    again = pa.table({"topic": ["orders"], "queue_id": pa.array([0], pa.int32()), "batch_id": [7],
                      "batch_pos": [0], "msg_id": ["m0"], "body": [b"again"]})  # fmt: skip
    BlindAppender(storage, uri).append(again)
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    files = sorted(snap.files(), key=lambda f: f.num_records or 0, reverse=True)  # the first, then the copy
    index = pa.table(
        {
            "cl_batch_id": [7, 7, 7],
            "cl_batch_pos": [0, 1, 2],
            "msg_id": ["m0", "m1", "other"],
            "queue_offset": [5, 6, 7],
        }
    )
    ids, pos = index.column("cl_batch_id").to_numpy(), index.column("cl_batch_pos").to_numpy()
    found = [_located(snap, f, ids, pos) for f in files]
    assert all(x is not None for x in found)
    got = _placed(index, snap, files, [x for x in found if x is not None], ["body"])
    rows = got.sort_by("queue_offset").to_pylist()
    assert [(r["msg_id"], r["body"]) for r in rows] == [("m0", b"b0"), ("m1", b"b1")]
    joined = join_bodies(index, [snap.whole(f) for f in files], ["body"]).sort_by("queue_offset")
    assert joined.column("msg_id").to_pylist() == ["m0", "m1"]
    nothing = np.zeros(3, dtype=bool), np.zeros(3, dtype=np.int64)
    none = _placed(index, snap, files[:1], [nothing], ["body"])
    assert none.num_rows == 0 and "body" in none.column_names


def test_picked_rows_are_the_takes_rows_shared_when_they_come_in_runs():
    """``picked`` gives what ``take`` gives, in the order asked: rows in a few long runs as
    slices of the table (no copy), scattered rows taken."""
    from deltamq.delta_read import RUN_ROWS, picked

    n = 6 * RUN_ROWS
    table = pa.table({"i": np.arange(n), "b": [bytes([i % 251]) * 3 for i in range(n)]})
    runs = np.concatenate([np.arange(4 * RUN_ROWS, 5 * RUN_ROWS), np.arange(0, 2 * RUN_ROWS), [7]])
    scattered = np.random.default_rng(3).permutation(n)[: 2 * RUN_ROWS]
    for rows in (runs, scattered, np.arange(n), np.array([5]), np.zeros(0, np.int64)):
        got = picked(table, rows)
        assert got.equals(table.take(pa.array(rows, pa.int64()))), rows[:5]
    shared = picked(table, runs).column("b")
    assert shared.num_chunks == 3  # three slices of the table: nothing copied
    assert picked(table, scattered).column("b").num_chunks == 1
    few = np.arange(RUN_ROWS, 2 * RUN_ROWS)  # one run, but a sixth of the table: copied, not kept alive
    assert picked(table, few).equals(table.slice(RUN_ROWS, RUN_ROWS))
    assert (
        picked(table, few).column("b").chunk(0).buffers()[2].size
        < table.column("b").chunk(0).buffers()[2].size
    )
    with pytest.raises(IndexError):
        picked(table, np.arange(n - 2, n + 1))


def test_files_this_process_appended_are_kept_decoded_as_a_read_would_decode_them(tmp_path, monkeypatch):
    """An appender's files handed to the snapshot (``on_written`` → ``seed``): the next
    read of them decodes nothing, and gives what decoding them gives (partition columns,
    types, column order)."""
    from deltamq import delta_read

    uri = str(tmp_path / "idx")
    schema = pa.schema(
        [("topic", pa.string()), ("slot", pa.int32()), ("queue_offset", pa.int64()), ("msg_id", pa.string())]
    )
    write_deltalake(uri, schema.empty_table(), partition_by=["topic", "slot"])
    storage = Storage(str(tmp_path))
    seeded = FileSnapshot(storage, uri)
    seeded.refresh()
    appender = BlindAppender(storage, uri, on_written=seeded.seed)
    rows = pa.table(
        {
            "topic": ["a", "a", "b"],
            "slot": pa.array([0, 0, 3], pa.int32()),
            "queue_offset": [5, 6, 7],
            "msg_id": ["m5", "m6", "m7"],
        },
        schema,
    )
    appender.append(rows)
    seeded.refresh()
    decoded = []
    real = FileSnapshot._decode

    def counted(self, *args, **kwargs):
        decoded.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(delta_read.FileSnapshot, "_decode", counted)
    kept = {f.path: seeded.whole(f) for f in seeded.files()}
    assert len(kept) == 2 and not decoded  # both files from the seed
    fresh = FileSnapshot(storage, uri)
    fresh.refresh()
    for f in fresh.files():
        assert fresh.whole(f).equals(kept[f.path])  # the same table a decode gives
    assert len(decoded) == 2
