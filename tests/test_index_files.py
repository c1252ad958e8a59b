"""The index planned from the tables' files (deltamq/tables/index_files.py) is the
engine's plan (``consume_queue.plan_index``), row by row, and its commit is refused when
another writer took the index's next version."""

from __future__ import annotations

import pytest

from deltamq import faults, ids
from deltamq.constants import TRANS_CHECK_MAX_TIME_TOPIC, Prop, SysFlag
from deltamq.delta_append import ORDERED_BY_TAG, VersionTaken
from deltamq.engine import is_commit_conflict
from deltamq.message import Message
from deltamq.sending import rows_to_arrow
from deltamq.tables import commit_log, consume_queue, deltalog, index_files


@pytest.fixture
def orders(warehouse_with):
    return warehouse_with("orders", queues=4).broker


def _row(now: int, batch: int, pos: int, **kw) -> dict:
    row = {
        "msg_id": ids.msg_id(batch, pos),
        "topic": "orders",
        "queue_id": pos % 4,
        "tags": None,
        "keys": None,
        "body": f"b{pos}".encode(),
        "flag": 0,
        "properties": {},
        "born_ts": now - 5,
        "store_ts": now,
        "reconsume_times": 0,
        "sys_flag": 0,
        "producer_group": "p",
        "batch_id": batch,
        "batch_pos": pos,
        "store_date": ids.store_date(now),
    }
    return row | kw


def _every_route(broker, now: int) -> None:
    """Commits of rows taking every route and edge of the plan: tags (none, unicode),
    levels (clamped, zero, malformed, too long), timers (good, malformed), half messages
    (and a discarded one, which is plain), properties naming a real queue already, a copy
    promote wrote (its store time is its due time), no properties at all."""
    batch = ids.new_batch_id(now)
    props = [
        {},
        {Prop.DELAY: "1"},
        {Prop.DELAY: "3", Prop.REAL_TOPIC: "old", Prop.REAL_QID: "9", "x": "y"},
        {Prop.DELAY: "99"},
        {Prop.DELAY: "0"},
        {Prop.DELAY: "abc"},
        {Prop.DELAY: "1234567890"},
        {Prop.TIMER_DELIVER_MS: str(now + 7_300_000)},
        {Prop.TIMER_DELIVER_MS: "12x"},
        {Prop.REAL_TOPIC: "kept", Prop.REAL_QID: "1"},
        {Prop.TRAN_MSG: "true", Prop.PGROUP: "p"},
    ]
    tags = [None, "TagA", "日本", "TagA", "", None, "x" * 40, "TagB", None, "TagA", None]
    pairs = enumerate(zip(props, tags, strict=True))
    rows = [_row(now, batch, i, properties=p, tags=t, keys=f"k{i}") for i, (p, t) in pairs]
    rows[10]["sys_flag"] = SysFlag.TRANSACTION_PREPARED_TYPE
    broker.append_commit_log(rows_to_arrow(rows), what="test")
    discarded = _row(now, ids.new_batch_id(now + 1), 0, topic=TRANS_CHECK_MAX_TIME_TOPIC, queue_id=0)
    discarded |= {"properties": {Prop.TRAN_MSG: "true"}, "sys_flag": SysFlag.TRANSACTION_PREPARED_TYPE}
    broker.append_commit_log(rows_to_arrow([discarded]), what="test")
    copy_batch = ids.engine_batch_id(now + 2, 2)  # a level-2 copy, stored at its due time
    copies = [_row(now + 60_000, copy_batch, i, properties={"a": str(i)}) for i in range(3)]
    broker.append_commit_log(rows_to_arrow(copies), what="test")
    plain = [_row(now + 3, ids.new_batch_id(now + 3), i, properties=None) for i in range(6)]
    for r in plain:
        r["properties"] = {}
    broker.append_commit_log(rows_to_arrow(plain), what="test")


def _key(r: dict) -> tuple:
    def plain(k, v):
        return dict(v) if k == "properties" and v is not None else v

    return tuple(sorted((k, str(plain(k, v))) for k, v in r.items()))


def test_the_files_plan_the_engines_index_rows(orders, clock):
    p = orders.producer("p")
    from deltamq import Message

    p.send_batch([Message("orders", f"m{i}", tags="TagA") for i in range(5)])
    orders.tick()  # heads above zero
    _every_route(orders, clock.now_ms())
    wh = orders.warehouse
    fs = index_files.state(wh)
    assert fs is not None  # plain tables on Sail: the files are read
    state = consume_queue.load_dispatch_state(wh)
    assert (fs.version, fs.heads) == (state.version, state.heads)
    commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), state.version, 100)
    assert len(commits) == 4 and index_files.fits(commits)
    levels = wh.levels()
    engine = consume_queue.plan_index(
        commit_log.read_added(wh, commits), consume_queue.heads_frame(wh, state.heads), levels
    ).collect()
    files = index_files.plan(index_files.added(wh, fs, commits), state.heads, levels).to_pylist()
    assert len(files) == len(engine) == 21
    assert sorted(map(_key, files)) == sorted(_key(r.asDict()) for r in engine)
    routes = {r["route"] for r in files}
    assert routes == {"plain", "schedule", "timer", "half"}


def test_dispatch_from_the_files_indexes_as_the_engine_does(orders, clock, monkeypatch):
    """The same commits indexed by one pass each way (the files' limit set to zero for the
    engine's) give the same index and the same result."""
    _every_route(orders, clock.now_ms())
    wh = orders.warehouse
    before = wh.snapshot("consume_queue").version
    files = consume_queue.index_new(wh, 100)
    rows = orders.sql("SELECT * FROM consume_queue ORDER BY msg_id").collect()
    assert wh.snapshot("consume_queue").version == before + 1  # one append
    consume_queue.wipe(wh)
    monkeypatch.setattr(index_files, "MAX_ROWS", 0)
    engine = consume_queue.index_new(wh, 100)
    again = orders.sql("SELECT * FROM consume_queue ORDER BY msg_id").collect()
    assert (files.rows_out, files.routes, files.queues) == (engine.rows_out, engine.routes, engine.queues)
    assert files.rows_out == 21
    strip = ("cl_version",)  # the wipe is itself no commit_log commit: versions are equal anyway
    assert [_key({k: v for k, v in r.asDict().items() if k not in strip}) for r in rows] == [
        _key({k: v for k, v in r.asDict().items() if k not in strip}) for r in again
    ]


def test_an_index_commit_whose_version_was_taken_is_planned_again(orders, clock, monkeypatch):
    """Another indexer commits between this pass's read and its append: the append is
    refused as a commit conflict, the pass runs again from the new state, and every
    message is indexed once."""
    from deltamq import Message

    orders.producer("p").send_batch([Message("orders", f"m{i}") for i in range(8)])
    wh = orders.warehouse
    raced = []
    real_point = faults.point

    def point(name: str) -> None:
        if name == "dispatch.before_index_commit" and not raced:
            raced.append(consume_queue.index_new(wh, 100, job="other"))  # the racing indexer
        real_point(name)

    monkeypatch.setattr(faults, "point", point)
    retried = orders.engine.stats.conflicts_retried
    orders.tick()
    assert raced and raced[0].rows_out == 8
    assert orders.engine.stats.conflicts_retried == retried + 1
    ids_ = [r["msg_id"] for r in orders.sql("SELECT msg_id FROM consume_queue").collect()]
    assert len(ids_) == len(set(ids_)) == 8


def test_a_conditional_append_refuses_a_taken_version(orders):
    wh = orders.warehouse
    appender = wh.arrow_appender("consume_queue")
    fs = index_files.state(wh)
    assert appender is not None and fs is not None
    _every_route(orders, 1_767_225_600_000)
    commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), fs.version, 100)
    index = index_files.plan(index_files.added(wh, fs, commits), fs.heads, wh.levels())
    index_files.append(wh, fs, index)
    with pytest.raises(VersionTaken) as taken:
        index_files.append(wh, fs, index)  # planned from the same version: taken now
    assert is_commit_conflict(taken.value)
    assert orders.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == 21


@pytest.mark.spark
def test_an_engine_append_of_the_index_is_recorded_once_and_never_skipped_after_a_wipe(orders):
    """Apache Spark on a local disk: the index planned from the files is appended by the
    engine, recorded as the index application at the version after the one the plan was
    read at. The same append again (one read, two indexers) adds nothing; after the index
    is emptied (``rebuild-index``), the pass planned again is appended, not taken for one
    already recorded."""
    wh = orders.warehouse
    if not wh.engine.idempotent_appends or wh.arrow_appender("consume_queue") is not None:
        pytest.skip("the engine's idempotent appends: Apache Spark on a local disk (pytest --engine spark)")
    _every_route(orders, 1_767_225_600_000)

    def pass_from_the_files() -> tuple[index_files.FilesState, object]:
        fs = index_files.state(wh)
        assert fs is not None
        commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), -1, 100)
        return fs, index_files.plan(index_files.added(wh, fs, commits), {}, wh.levels())

    def indexed() -> list[str]:
        return [r["msg_id"] for r in orders.sql("SELECT msg_id FROM consume_queue").collect()]

    fs, index = pass_from_the_files()
    index_files.append(wh, fs, index)
    index_files.append(wh, fs, index)
    assert len(indexed()) == len(set(indexed())) == 21
    consume_queue.wipe(wh)
    assert indexed() == []
    fs, index = pass_from_the_files()
    index_files.append(wh, fs, index)
    assert len(indexed()) == len(set(indexed())) == 21


def test_tags_hash_is_sparks_xxhash64(orders):
    import pyarrow as pa

    tags = ["TagA", "", "日本", "a" * 100, "TagA"]
    got = index_files.tags_hash(pa.chunked_array([tags + [None]])).to_pylist()
    want = [
        r["h"]
        for r in orders.engine.rows(
            "SELECT xxhash64(t) AS h, i FROM VALUES "
            + ", ".join(f"('{t}', {i})" for i, t in enumerate(tags))
            + " AS v(t, i) ORDER BY i"
        )
    ]
    assert got == want + [None]


def test_offsets_follow_queue_then_commit_batch_and_position_whatever_order_rows_arrive_in():
    """``_with_offsets`` on rows in the files' order (the fast path, a stable sort by queue)
    and on rows whose commits, batches or positions arrive out of order within a queue
    (the full sort): every row gets its queue's head plus its rank in (version, batch,
    position) order, as the engine's window numbers them."""
    import random

    import pyarrow as pa

    rng = random.Random(7)
    rows = [
        {
            "topic": t,
            "queue_id": q,
            "cl_version": v,
            "cl_batch_id": b,
            "cl_batch_pos": p,
            "msg_id": f"{t}{q}{v}{b}{p}",
        }
        for t in ("b", "a", "日本", "ａ")
        for q in (-1, 0, 3)
        for v in (5, 6)
        for b in (1, 2)
        for p in (0, 7, 9)
    ]
    heads = {("a", 3): 100, ("日本", 0): 7, ("b", -1): 4}

    def expected(given):
        ordered = sorted(
            given,
            key=lambda r: (
                r["topic"].encode(),
                r["queue_id"],
                r["cl_version"],
                r["cl_batch_id"],
                r["cl_batch_pos"],
            ),
        )
        out, seen = [], {}
        for r in ordered:
            queue = (r["topic"], r["queue_id"])
            out.append((r["msg_id"], heads.get(queue, 0) + seen.get(queue, 0)))
            seen[queue] = seen.get(queue, 0) + 1
        return out

    in_order = sorted(rows, key=lambda r: (r["topic"].encode(), r["queue_id"]))
    for given in (rows, in_order, rng.sample(rows, len(rows))):
        half = len(given) // 2  # two chunks, as rows of two files come
        table = pa.concat_tables([pa.Table.from_pylist(given[:half]), pa.Table.from_pylist(given[half:])])
        got = index_files._with_offsets(table, heads)
        assert list(
            zip(got.column("msg_id").to_pylist(), got.column("queue_offset").to_pylist(), strict=True)
        ) == (expected(given))


def test_a_producers_file_ordered_by_queue_is_tagged_and_indexed_here_in_larger_passes(orders):
    """deltamq's own writer tags a file whose rows it ordered by queue; a pass of such files
    is indexed from the files up to ``MAX_ORDERED_ROWS``, others up to ``MAX_ROWS``."""
    import pyarrow as pa

    p = orders.producer("p")
    p.send_arrow(pa.table({"topic": ["orders"] * 5000, "body": [b"x"] * 5000}))
    p.send_batch([Message("orders", b"y")])
    wh = orders.context.warehouse
    commits = deltalog.commits_after(wh.storage, wh.uri("commit_log"), -1, 100)
    big, small = (next(c for c in commits if c.files and c.files[0].num_records == n) for n in (5000, 1))
    assert big.files[0].tags == {ORDERED_BY_TAG: "topic,queue_id"}
    assert small.files[0].tags is None  # too small to be grouped: written in the send's order
    many = [big] * (index_files.MAX_ROWS // 5000 + 1)  # above MAX_ROWS, within MAX_ORDERED_ROWS
    assert index_files.fits([big]) and index_files.fits([small]) and index_files.fits(many)
    assert not index_files.fits([*many, small])
    assert not index_files.fits([big] * (index_files.MAX_ORDERED_ROWS // 5000 + 1))
