"""Blind appends without an engine (deltamq/delta_append.py): what delta-rs reads back,
racing writers, the table changing under a writer, protocols it refuses, checkpoints and
statistics. Plain delta-rs tables on a local disk; the S3 path (conditional PUT, a lost
answer) is in tests/test_faults_s3.py, the producer on both in tests/test_lite.py."""

from __future__ import annotations

import json
import threading
from datetime import date
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from deltamq.delta_append import BlindAppender, Unsupported, VersionTaken
from deltamq.storage import Storage

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("day", pa.date32())])


def _rows(ids: range, day: date = date(2026, 11, 26), name: str = "n") -> pa.Table:
    return pa.table(
        {"id": list(ids), "name": [f"{name}{i}" for i in ids], "day": [day] * len(ids)}, schema=SCHEMA
    )


def _table(tmp_path: Path, **kw) -> tuple[Storage, str]:
    uri = str(tmp_path / "t")
    write_deltalake(uri, _rows(range(0)), partition_by=["day"], **kw)
    return Storage(str(tmp_path)), uri


def _entries(uri: str) -> list[list[dict]]:
    log = Path(uri) / "_delta_log"
    return [
        [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        for p in sorted(log.glob("*.json"))
    ]


def test_an_append_is_read_back_by_delta_rs_with_partitions_and_statistics(tmp_path):
    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri, engine_info="test")
    v1 = appender.append(_rows(range(3)))
    v2 = appender.append(pa.concat_tables([_rows(range(3, 5)), _rows(range(5, 7), day=date(2026, 11, 27))]))
    assert (v1, v2) == (1, 2)
    got = DeltaTable(uri).to_pyarrow_table().sort_by("id").to_pylist()
    assert [r["id"] for r in got] == list(range(7))
    assert {r["id"]: r["day"] for r in got}[6] == date(2026, 11, 27)
    second = _entries(uri)[2]
    info = second[0]["commitInfo"]
    assert info["isBlindAppend"] and info["operation"] == "WRITE" and info["engineInfo"] == "test"
    adds = [a["add"] for a in second[1:]]
    assert sorted(a["partitionValues"]["day"] for a in adds) == ["2026-11-26", "2026-11-27"]
    assert all(a["path"].startswith(f"day={a['partitionValues']['day']}/") for a in adds)
    stats = json.loads(next(a for a in adds if a["partitionValues"]["day"] == "2026-11-27")["stats"])
    assert stats == {
        "numRecords": 2,
        "minValues": {"id": 5, "name": "n5"},
        "maxValues": {"id": 6, "name": "n6"},
        "nullCount": {"id": 0, "name": 0},
    }


def test_long_strings_get_no_min_max_and_nulls_are_counted(tmp_path):
    storage, uri = _table(tmp_path)
    rows = pa.table(
        {"id": [1, None], "name": ["x" * 40, None], "day": [date(2026, 11, 26)] * 2}, schema=SCHEMA
    )
    BlindAppender(storage, uri).append(rows)
    add = _entries(uri)[1][1]["add"]
    stats = json.loads(add["stats"])
    assert stats["minValues"] == {"id": 1} and stats["maxValues"] == {"id": 1}
    assert stats["nullCount"] == {"id": 1, "name": 1}
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 2


def test_racing_appenders_each_commit_once_at_dense_versions(tmp_path):
    storage, uri = _table(tmp_path)
    appenders = [BlindAppender(storage, uri) for _ in range(4)]  # each starts at version 0
    versions: list[int] = []
    lock = threading.Lock()

    def send(k: int) -> None:
        for r in range(10):
            v = appenders[k].append(_rows(range(1000 * k + 10 * r, 1000 * k + 10 * r + 10)))
            with lock:
                versions.append(v)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(versions) == list(range(1, 41))
    ids = DeltaTable(uri).to_pyarrow_table()["id"].to_pylist()
    assert len(ids) == len(set(ids)) == 400


def test_a_writer_walks_past_versions_other_writers_took(tmp_path):
    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    appender.append(_rows(range(1)))
    for i in range(5):  # delta-rs writes meanwhile, behind the appender's back
        write_deltalake(uri, _rows(range(100 + i, 101 + i)), mode="append")
    assert appender.append(_rows(range(1, 2))) == 7
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 7


def test_a_schema_change_by_another_writer_is_refused_not_written_past(tmp_path):
    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    appender.append(_rows(range(1)))
    wider = _rows(range(5, 6)).append_column("extra", pa.array(["e"]))
    write_deltalake(uri, wider, mode="append", schema_mode="merge")
    with pytest.raises(Unsupported, match="changed its schema"):
        appender.append(_rows(range(1, 2)))
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 2  # nothing half-written is visible


def test_an_append_at_a_version_is_no_blind_append_so_a_merge_that_read_before_it_conflicts(tmp_path):
    """Rows planned from the table at version V and appended at exactly V + 1 (dispatch's
    index from the files) say so: a delta-rs MERGE that read V and commits after them
    finds their file among what it should have read and is refused, where a blind
    append's file would be passed over and the same rows inserted twice."""
    from deltalake.exceptions import CommitFailedError

    storage, uri = _table(tmp_path)
    stale = DeltaTable(uri)  # a writer that read version 0
    appender = BlindAppender(storage, uri)
    assert appender.append(_rows(range(3)), at=1) == 1
    (info,) = [a["commitInfo"] for a in _entries(uri)[1] if "commitInfo" in a]
    assert info["isBlindAppend"] is False and info["readVersion"] == 0
    source = _rows(range(3))
    with pytest.raises(CommitFailedError):
        (
            stale.merge(source, "t.id = s.id", source_alias="s", target_alias="t")
            .when_not_matched_insert_all()
            .execute()
        )
    assert sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist()) == [0, 1, 2]
    with pytest.raises(VersionTaken):
        appender.append(_rows(range(3, 4)), at=1)  # planned from version 0 again: taken


def test_an_append_at_a_version_reads_a_schema_changed_since_the_last_it_knew(tmp_path):
    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    appender.append(_rows(range(1)), at=1)
    wider = _rows(range(5, 6)).append_column("extra", pa.array(["e"]))
    write_deltalake(uri, wider, mode="append", schema_mode="merge")  # version 2, a new column
    appender.append(_rows(range(7, 8)).append_column("extra", pa.array(["x"])), at=3)
    got = {r["id"]: r["extra"] for r in DeltaTable(uri).to_pyarrow_table().to_pylist()}
    assert got == {0: None, 5: "e", 7: "x"}  # written with the column, not without it


def test_a_table_with_deletion_vectors_is_refused_by_name(tmp_path):
    storage, uri = _table(tmp_path, configuration={"delta.enableDeletionVectors": "true"})
    with pytest.raises(Unsupported, match="deletionVectors"):
        BlindAppender(storage, uri).append(_rows(range(1)))
    assert DeltaTable(uri).version() == 0


def test_a_checkpoint_at_every_interval(tmp_path):
    storage, uri = _table(tmp_path, configuration={"delta.checkpointInterval": "3"})
    appender = BlindAppender(storage, uri)
    for i in range(7):
        appender.append(_rows(range(i, i + 1)))
    log = Path(uri) / "_delta_log"
    assert sorted(p.name for p in log.glob("*.checkpoint.parquet")) == [
        "00000000000000000003.checkpoint.parquet",
        "00000000000000000006.checkpoint.parquet",
    ]
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 7


def test_an_appender_that_slept_through_log_cleanup_commits_at_the_head_not_behind_it(tmp_path):
    """An appender's last version and those after it were deleted by log cleanup (below a
    newer checkpoint): the free name after its last version is no commit any reader
    reads. It notices the entry before is gone, withdraws its entry, and commits at the
    head."""
    storage, uri = _table(tmp_path)
    sleeper, busy = BlindAppender(storage, uri), BlindAppender(storage, uri)
    assert sleeper.append(_rows(range(0, 1))) == 1
    for i in range(1, 10):
        busy.append(_rows(range(i, i + 1)))
    DeltaTable(uri).create_checkpoint()  # at version 10
    log = Path(uri) / "_delta_log"
    for v in range(10):  # what log cleanup deletes: the entries below the checkpoint
        (log / f"{v:020d}.json").unlink()
    assert sleeper.append(_rows(range(100, 101))) == 11
    assert not (log / f"{2:020d}.json").exists()
    ids = sorted(DeltaTable(uri).to_pyarrow_table()["id"].to_pylist())
    assert ids == [*range(10), 100]


def test_a_refused_create_with_nothing_there_tries_the_same_version_again(tmp_path, monkeypatch):
    """A create refused although no entry is there (S3 answers 409 to a create racing
    another request): taking the next version would leave a hole no reader gets past."""
    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    real = storage.put_if_absent
    refused: list[str] = []

    def refuse_once(path: str, data: bytes) -> bool:
        if not refused and path.endswith(".json"):
            refused.append(path)
            return False
        return real(path, data)

    monkeypatch.setattr(storage, "put_if_absent", refuse_once)
    assert appender.append(_rows(range(1))) == 1
    names = sorted(p.name for p in (Path(uri) / "_delta_log").glob("*.json"))
    assert refused and names == [f"{0:020d}.json", f"{1:020d}.json"]
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 1


def test_a_partition_value_with_special_characters_is_read_back(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([("id", pa.int64()), ("topic", pa.string())])
    write_deltalake(uri, pa.table({"id": [], "topic": []}, schema=schema), partition_by=["topic"])
    odd = "%RETRY%g/x=1 é"
    BlindAppender(Storage(str(tmp_path)), uri).append(pa.table({"id": [1], "topic": [odd]}, schema=schema))
    assert DeltaTable(uri).to_pyarrow_table().to_pylist() == [{"id": 1, "topic": odd}]
    folders = [p.name for p in Path(uri).iterdir() if p.name.startswith("topic=")]
    assert folders == ["topic=%25RETRY%25g%2Fx%3D1 é"]


def test_put_if_absent_keeps_the_first_writer(tmp_path):
    storage = Storage(str(tmp_path))
    path = str(tmp_path / "d" / "x.json")
    (tmp_path / "d").mkdir()
    assert storage.put_if_absent(path, b"first") is True
    assert storage.put_if_absent(path, b"second") is False
    assert storage.read_bytes(path) == b"first"
    assert storage.read_bytes(str(tmp_path / "d" / "missing")) is None
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["x.json"]  # no temporary left


def test_a_reader_stops_at_a_hole_in_a_listing_and_never_skips_past_it(tmp_path):
    """A listing that raced commits can show version 4 without 3 (ext4 lists in hash
    order): dispatch's reader takes 1..2 now and the rest next time, instead of reading
    4 and moving its position past 3's messages."""
    from deltamq.tables import deltalog

    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    for i in range(4):
        appender.append(_rows(range(i, i + 1)))
    entry3 = Path(uri) / "_delta_log" / f"{3:020d}.json"
    hidden = entry3.read_bytes()
    entry3.unlink()  # as a racing listing would show it
    assert [c.version for c in deltalog.commits_after(storage, uri, 0, 10)] == [1, 2]
    entry3.write_bytes(hidden)
    assert [c.version for c in deltalog.commits_after(storage, uri, 2, 10)] == [3, 4]


def test_opening_a_table_retries_a_listing_that_raced_a_commit():
    from deltamq.storage import is_transient

    raced = Exception(
        "Kernel error: Generic delta kernel error: Expected contiguous commit files, but found gap"
    )
    assert is_transient(raced)


def test_a_replace_swaps_files_at_one_version_or_none(tmp_path):
    """``replace`` (the Spark-free pull client's lock rows): the files it read out and
    their rows, changed, in, at exactly the version after the one read. delta-rs reads
    the result; a version taken in between refuses it (VersionTaken) and leaves the
    table as the other writer made it; a MERGE that read the files before it conflicts."""
    from deltalake.exceptions import CommitFailedError

    from deltamq.delta_read import FileSnapshot

    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    appender.append(_rows(range(3)))  # version 1, one file
    appender.append(_rows(range(3, 5)))  # version 2, another
    snap = FileSnapshot(storage, uri)
    assert snap.refresh() == 2
    stale = DeltaTable(uri)  # a writer that read version 2
    (first,) = snap.files(lambda f: f.min_values.get("id") == 0)
    changed = snap.whole(first).to_pylist()
    changed[1]["name"] = "changed"
    assert appender.replace([first], pa.Table.from_pylist(changed, schema=SCHEMA), at=3) == 3
    got = {r["id"]: r["name"] for r in DeltaTable(uri).to_pyarrow_table().to_pylist()}
    assert got == {0: "n0", 1: "changed", 2: "n2", 3: "n3", 4: "n4"}
    (info, *actions) = _entries(uri)[3]
    assert info["commitInfo"]["readVersion"] == 2 and not info["commitInfo"]["isBlindAppend"]
    assert [a["remove"]["path"] for a in actions if "remove" in a] == [first.log_path]
    assert all(a["remove"]["size"] > 0 for a in actions if "remove" in a)
    with pytest.raises(VersionTaken):  # planned from version 2 again: taken
        appender.replace([first], _rows(range(0)), at=3)
    assert snap.refresh() == 3 and len(snap.files()) == 2
    with pytest.raises(CommitFailedError):  # it read the file the replace took out
        (
            stale.merge(_rows(range(1, 2), name="m"), "t.id = s.id", source_alias="s", target_alias="t")
            .when_matched_update_all()
            .execute()
        )
    (gone,) = snap.files(lambda f: f.min_values.get("id") == 3)
    assert appender.replace([gone], _rows(range(0)), at=4) == 4  # a delete: no file added
    assert sorted(DeltaTable(uri).to_pyarrow_table().column("id").to_pylist()) == [0, 1, 2]


def test_a_refused_replace_leaves_no_file_and_an_append_only_table_is_not_replaced(tmp_path):
    from deltamq.delta_read import FileSnapshot

    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    appender.append(_rows(range(2)))
    snap = FileSnapshot(storage, uri)
    snap.refresh()
    (first,) = snap.files()
    appender.append(_rows(range(2, 3)))  # version 2 by "another writer"
    before = sorted(p.name for p in Path(uri).rglob("*.parquet"))
    with pytest.raises(VersionTaken):
        appender.replace([first], _rows(range(1)), at=2)
    assert sorted(p.name for p in Path(uri).rglob("*.parquet")) == before  # its file deleted again

    storage2, locked = _table(tmp_path / "ao", configuration={"delta.appendOnly": "true"})
    writer = BlindAppender(storage2, locked)
    writer.append(_rows(range(2)))
    snap = FileSnapshot(storage2, locked)
    snap.refresh()
    with pytest.raises(Unsupported, match="append-only"):
        writer.replace(snap.files(), _rows(range(1)), at=2)


def test_a_commit_at_a_version_whose_predecessor_was_cleaned_up_is_withdrawn(tmp_path):
    """A writer that planned from a version log cleanup has since removed (below a newer
    checkpoint, which readers start from) would commit where no reader looks: the entry
    is withdrawn and the commit refused, so the caller reads the table again."""
    storage, uri = _table(tmp_path)
    appender = BlindAppender(storage, uri)
    appender.append(_rows(range(1)))  # version 1
    appender.append(_rows(range(1, 2)))  # version 2
    (Path(uri) / "_delta_log" / f"{2:020d}.json").unlink()  # as cleanup would, past a checkpoint
    with pytest.raises(VersionTaken, match="cleaned up"):
        appender.append(_rows(range(2, 3)), at=3)
    assert not (Path(uri) / "_delta_log" / f"{3:020d}.json").exists()
