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

import pyarrow as pa
import pyarrow.compute as pc
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
