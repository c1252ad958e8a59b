"""The Spark-free pull client (deltamq.lite.PullConsumer, deltamq/pull_files.py): the same
protocol and tables as Broker.pull_consumer, sharing a group with it; nacks carried out
by the tick; what needs an engine refused by name; processes of both kinds (the Spark-free
ones with PySpark unimportable) pulling one group, every message handed out once."""

from __future__ import annotations

import json

import pytest

from deltamq import Message
from deltamq.errors import ConfigError, UnknownGroup
from deltamq.lite import PullConsumer
from deltamq.tables.deliveries import positions

SECOND = 1_000


@pytest.fixture
def pulled(warehouse_with, clock):
    broker = warehouse_with(
        "orders", queues=4, group="workers", recorder=None, invisible_time_ms=30 * SECOND
    ).broker
    p = broker.producer("p")
    for q in range(4):
        p.send_batch(
            [
                Message("orders", f"q{q}m{i}", tags="T", keys=f"k{i}", properties={"n": str(i)})
                for i in range(5)
            ],
            selector=lambda n, m, a: a,
            arg=q,
        )
    broker.tick(clock.now_ms())
    return broker


def _lite(broker, clock, client: str) -> PullConsumer:
    return PullConsumer(broker.warehouse.location, "workers", client, config=broker.config, clock=clock)


def test_a_spark_free_client_and_a_broker_client_share_a_group(pulled, clock):
    t = clock.now_ms()
    lite, spark = _lite(pulled, clock, "lite"), pulled.pull_consumer("workers", "spark")
    lite.heartbeat(t)
    spark.heartbeat(t)
    got_lite, got_spark = lite.pull(100, now=t), spark.pull(100, now=t)
    assert {m.queue_id for m in got_lite}.isdisjoint({m.queue_id for m in got_spark})
    both = got_lite + got_spark
    assert sorted(m.body.decode() for m in both) == sorted(f"q{q}m{i}" for q in range(4) for i in range(5))
    first = next(m for m in got_lite if m.queue_offset == 0)
    assert (first.topic, first.tags, first.keys, first.properties["n"]) == ("orders", "T", "k0", "0")
    # nothing more for either while everything is in flight; acks from both kinds
    assert lite.pull(100, now=t + 1) == [] and spark.pull(100, now=t + 1) == []
    assert lite.ack([m.receipt_handle for m in got_lite], now=t + 2) == len(got_lite)
    assert spark.ack([m.receipt_handle for m in got_spark], now=t + 2) == len(got_spark)
    assert lite.ack([m.receipt_handle for m in got_lite], now=t + 3) == 0  # once
    assert positions(pulled.warehouse, "workers", [("orders", q) for q in range(4)]) == {
        ("orders", q): (5, 5) for q in range(4)
    }
    pulled.tick(t + 4)  # the fold: offsets, and the log emptied
    assert pulled.sql("SELECT count(*) AS n FROM deliveries").collect()[0]["n"] == 0
    # the lite client leaves: its queues go to the one left, from the acked offsets (once
    # the no-change counter has seen them settled, docs/behaviour.md §6)
    lite.close()
    p = pulled.producer("p")
    for q in range(4):
        p.send(Message("orders", f"x{q}"), selector=lambda n, m, a: a, arg=q)
    pulled.tick(t + 5)
    later = []
    for k in range(8):
        later += spark.pull(100, now=t + 6 + k)
    assert sorted(m.body.decode() for m in later) == [f"x{q}" for q in range(4)]


def test_a_spark_free_nack_is_sent_back_by_the_tick_at_its_level(pulled, clock):
    t = clock.now_ms()
    lite = _lite(pulled, clock, "lite")
    got = lite.pull(3, now=t)
    assert lite.nack([got[0].receipt_handle], delay_level=2, now=t) == 1
    assert lite.nack([got[1].receipt_handle], delay_level=-1, now=t) == 1
    lite.ack([got[2].receipt_handle], now=t)
    pulled.tick(t + 1)  # pull_expiry carries the nacks out
    pulled.tick(t + 2)  # dispatch indexes what they stored
    stored = pulled.sql(
        "SELECT CAST(l.body AS STRING) AS body, c.topic, c.properties['DELAY'] AS level "
        "FROM consume_queue c JOIN commit_log l ON l.msg_id = c.msg_id "
        "WHERE c.topic IN ('SCHEDULE_TOPIC_XXXX', '%DLQ%workers') ORDER BY body"
    ).collect()
    assert [(r["body"], r["topic"], r["level"]) for r in stored] == [
        (got[0].body.decode(), "SCHEDULE_TOPIC_XXXX", "2"),
        (got[1].body.decode(), "%DLQ%workers", None),
    ]
    states = pulled.sql("SELECT state, count(*) AS n FROM deliveries GROUP BY state").collect()
    assert {r["state"] for r in states} <= {"NACKED", "NACK_REQUESTED", "INFLIGHT", "ACKED"}
    # level 2 is 5 s: back in %RETRY%workers for the client, once
    later = t + 10 * SECOND
    pulled.tick(later)
    again = []
    for k in range(4):
        again += lite.pull(20, now=later + k)
    assert [(m.body.decode(), m.reconsume_times) for m in again if m.reconsume_times] == [
        (got[0].body.decode(), 1)
    ]


def test_what_needs_an_engine_is_refused_by_name(broker, warehouse_with, clock):
    warehouse_with("orders", queues=2)
    broker.create_group("dedup", consume_from="FIRST_OFFSET", dedup_key="keys")
    broker.subscribe("dedup", "orders")
    broker.create_group("sql", consume_from="FIRST_OFFSET")
    broker.subscribe("sql", "orders", "a > 1", type="SQL92")
    broker.create_group(
        "bc",
        "support.listeners:consume_all",
        consume_from="FIRST_OFFSET",
        mode="BROADCASTING",
        instances=["a"],
    )
    with pytest.raises(ConfigError, match="de-duplicates by key.*Broker.pull_consumer"):
        PullConsumer(broker.warehouse.location, "dedup", "c", clock=clock)
    with pytest.raises(UnknownGroup, match=r"'nope' does not exist \(groups: bc, dedup, sql\)"):
        PullConsumer(broker.warehouse.location, "nope", "c", clock=clock)
    with pytest.raises(ConfigError, match="BROADCASTING"):
        PullConsumer(broker.warehouse.location, "bc", "c", clock=clock)
    broker.producer("p").send(Message("orders", "x"))
    broker.tick(clock.now_ms())
    with pytest.raises(ConfigError, match="by SQL92.*Broker.pull_consumer"):
        PullConsumer(broker.warehouse.location, "sql", "c", clock=clock).pull(5)


_WORKER = """
import json, os, sys, time
wh, me, go = sys.argv[1], sys.argv[2], sys.argv[3]
if me.startswith("lite"):
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("pyspark", "pysail", "delta", "great_expectations"):
                raise ImportError(f"{name} is blocked in this test")
    sys.meta_path.insert(0, Block())
    from deltamq.lite import PullConsumer
    consumer = PullConsumer(wh, "workers", me)
else:
    from deltamq import Broker
    broker = Broker.open(wh)
    consumer = broker.pull_consumer("workers", me)
    broker.engine.rows("SELECT 1")
consumer.heartbeat()  # every client live before the first pull: the queues are shared by all four
print("READY", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
got, empty = [], 0
while empty < 8:
    msgs = consumer.pull(50)
    if not msgs:
        empty += 1
        time.sleep(0.25)
        continue
    empty = 0
    assert consumer.ack([m.receipt_handle for m in msgs]) == len(msgs)
    got += [[m.body.decode(), m.queue_id, m.queue_offset] for m in msgs]
spark = sorted(m for m in sys.modules if m.startswith(("pyspark", "pysail")))
print(json.dumps({"got": got, "spark": spark}), flush=True)
"""


@pytest.mark.slow  # subprocesses
def test_spark_free_and_spark_based_client_processes_hand_out_everything_once(pulled, clock, tmp_path):
    from test_pull import _race

    p = pulled.producer("p")
    per_queue = 300
    for q in range(4):
        p.send_batch(
            [Message("orders", f"q{q}n{i}") for i in range(per_queue)], selector=lambda n, m, a: a, arg=q
        )
    pulled.tick(clock.now_ms())
    outcomes = _race(_WORKER, tmp_path / "wh", ["lite0", "lite1", "spark0", "spark1"], tmp_path / "go")
    reports = {c: json.loads(out.splitlines()[-1]) for c, out in outcomes.items()}
    assert reports["lite0"]["spark"] == [] and reports["lite1"]["spark"] == []  # no Spark loaded
    handed = [tuple(m) for r in reports.values() for m in r["got"]]
    expected = {f"q{q}m{i}" for q in range(4) for i in range(5)} | {
        f"q{q}n{i}" for q in range(4) for i in range(per_queue)
    }
    assert sorted(b for b, _, _ in handed) == sorted(expected)  # each exactly once
    # The group is shared: both kinds of client handed messages out. Every client joined
    # before the first pull, but a process scheduled late may still find its queue taken
    # over, so only the kinds are checked, not every process (on a loaded machine the two
    # Spark-free clients, starting in milliseconds, once took every queue before either
    # Spark-based one had joined).
    counts = {c: len(r["got"]) for c, r in reports.items()}
    assert counts["lite0"] + counts["lite1"] > 0 and counts["spark0"] + counts["spark1"] > 0, counts
    pulled.tick(clock.now_ms() + 1)
    acked = pulled.sql(
        "SELECT queue_id, next_offset FROM offsets WHERE consumer_group = 'workers' AND topic = 'orders'"
    ).collect()
    assert {r["queue_id"]: r["next_offset"] for r in acked} == {q: per_queue + 5 for q in range(4)}


@pytest.mark.parametrize("kind", ["lite", "spark"])
def test_acks_kept_for_the_next_pull_are_stored_with_it(pulled, clock, kind):
    """ack(flush=False): counted at once, stored with the client's next pull (one commit
    for both), by flush() or by close(); acked once only."""
    t = clock.now_ms()
    client = _lite(pulled, clock, "c") if kind == "lite" else pulled.pull_consumer("workers", "c")
    queues = [("orders", q) for q in range(4)]
    first = client.pull(8, now=t)
    assert client.ack([m.receipt_handle for m in first], now=t, flush=False) == 8
    assert client.ack([first[0].receipt_handle], now=t, flush=False) == 0  # once
    assert sum(a for a, _ in positions(pulled.warehouse, "workers", queues).values()) == 0  # not stored yet
    version = pulled.warehouse.delta_rs("deliveries").version()
    second = client.pull(4, now=t + 1)
    assert pulled.warehouse.delta_rs("deliveries").version() == version + 1  # acks and deliveries: one commit
    assert sum(a for a, _ in positions(pulled.warehouse, "workers", queues).values()) == 8
    assert client.ack([m.receipt_handle for m in second], now=t + 2, flush=False) == 4
    client.flush()
    assert sum(a for a, _ in positions(pulled.warehouse, "workers", queues).values()) == 12
    rest = client.pull(20, now=t + 3)
    client.ack([m.receipt_handle for m in rest], now=t + 4, flush=False)
    client.close()  # stores them before leaving
    assert sum(a for a, _ in positions(pulled.warehouse, "workers", queues).values()) == 20


def test_clients_of_a_few_queues_read_the_row_groups_of_their_queues_only(warehouse_with, clock):
    """A Spark-free producer's large send is stored in row groups by queue; two Spark-free
    clients pulling two queues each get every message once, with its body, and each
    decodes only row groups of its own queues (the bodies' files are never decoded whole)."""
    from deltamq.delta_append import GROUPED_FROM
    from deltamq.lite import Producer

    broker = warehouse_with("orders", queues=4, group="workers", recorder=None).broker
    n = GROUPED_FROM * 2
    producer = Producer(broker.warehouse.location, "p", config=broker.config, clock=clock)
    producer.send_batch([Message("orders", f"m{i}") for i in range(n)])
    broker.tick(clock.now_ms())
    t = clock.now_ms()
    a, b = _lite(broker, clock, "a"), _lite(broker, clock, "b")
    a.heartbeat(t)
    b.heartbeat(t)
    got: dict[str, list] = {"a": [], "b": []}
    for k in range(40):
        for name, client in (("a", a), ("b", b)):
            msgs = client.pull(1000, now=t + k)
            client.ack([m.receipt_handle for m in msgs], now=t + k)
            got[name] += msgs
    bodies = sorted(m.body.decode() for m in got["a"] + got["b"])
    assert bodies == sorted(f"m{i}" for i in range(n))
    for name, client in (("a", a), ("b", b)):
        mine = {m.queue_id for m in got[name]}
        assert len(mine) == 2
        snap = client.store.snapshot("commit_log")
        assert snap._groups and not any(f.path in snap._cache for f in snap.files())
        for path, group in snap._groups:
            meta = snap.storage.parquet_metadata(path)
            stats = meta.row_group(group).column(meta.schema.names.index("queue_id")).statistics
            assert {stats.min, stats.max} <= mine


def test_lock_rows_are_compare_and_set_between_two_spark_free_stores(pulled, clock, monkeypatch):
    """Two clients' stores change one queue's lock row from the same read: the first
    commits; the second, whose read is older than that commit, finds its version taken,
    and read again, its expected row gone, so it changes nothing."""
    from deltamq.errors import VersionTaken
    from deltamq.pull_log import LockEntry

    a, b = _lite(pulled, clock, "a"), _lite(pulled, clock, "b")
    a.heartbeat()
    a.pull(5)  # takes every queue's lock
    queue = ("orders", 0)
    seen = a.store.read_locks("workers")[queue]
    assert seen is not None and seen.owner == "a"
    assert b.store.read_locks("workers")[queue] == seen
    take = [(queue, seen, LockEntry("b", 9, 0))]
    with monkeypatch.context() as m:  # b plans from that read, older than a's commit
        m.setattr(b.store.snapshot("queue_lock"), "refresh", lambda: None)
        a.store.commit(
            lambda: a.store.write_locks(
                "workers", [(queue, seen, LockEntry("a", seen.last_access_ts + 1, 0))]
            ),
            what="queue_lock",
        )
        with pytest.raises(VersionTaken):
            b.store.write_locks("workers", take)
    version = b.store.snapshot("queue_lock").version
    b.store.commit(lambda: b.store.write_locks("workers", take), what="queue_lock")  # read again
    now = b.store.read_locks("workers")[queue]
    assert now == LockEntry("a", seen.last_access_ts + 1, 0)  # the stale expectation changed nothing
    assert b.store.snapshot("queue_lock").version == version  # and committed nothing
    b.store.commit(lambda: b.store.write_locks("workers", [(queue, now, LockEntry("b", 9, 0))]), what="x")
    assert b.store.read_locks("workers")[queue] == LockEntry("b", 9, 0)  # a current one lands
    assert b.store.snapshot("queue_lock").version == version + 1
    a.close()


def test_a_lock_table_the_file_writer_cannot_write_is_changed_by_merge(pulled, clock):
    """``queue_lock`` with a writer feature the compare-and-set of files does not meet
    (change data feed): the client's lock writes go by delta-rs ``MERGE`` instead, and a
    pull still takes its queues."""
    from deltalake import DeltaTable

    uri = str(pulled.warehouse.uri("queue_lock"))
    DeltaTable(uri).alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
    client = _lite(pulled, clock, "cdf")
    got = client.pull(20)
    assert len(got) == 20 and "queue_lock" in client.store._merged
    owners = {e.owner for e in client.store.read_locks("workers").values() if e is not None}
    assert owners == {"cdf"}
    client.close()


def test_lock_rows_are_added_by_a_conditional_append_and_a_racing_client_adds_none_twice(pulled, clock):
    """A client that finds no lock rows for its queues adds them in one commit at the
    version after the one it read (no delta-rs ``MERGE``); when another client adds them
    between its read and its commit, its commit is refused, it reads again and adds
    nothing: one row per queue."""
    queues = [("orders", q) for q in range(4)]
    a, b = _lite(pulled, clock, "a"), _lite(pulled, clock, "b")
    assert a.store.read_locks("workers") == {}
    writer = a.store._writer("queue_lock")
    real = writer.replace
    raced = []

    def racing(*args, **kwargs):
        if not raced:  # b adds the rows after a read, before a commits
            raced.append(b.store.snapshot("queue_lock").version)
            b.store.ensure_lock_rows("workers", queues)
        return real(*args, **kwargs)

    writer.replace = racing
    a.store.ensure_lock_rows("workers", queues)
    snap = a.store.snapshot("queue_lock")
    assert snap.version == raced[0] + 1  # b's commit alone: a's was refused and not redone
    rows = snap.read(snap.files(), ["consumer_group", "topic", "queue_id", "owner", "no_change_count"])
    assert sorted(rows.to_pylist(), key=lambda r: r["queue_id"]) == [
        {"consumer_group": "workers", "topic": "orders", "queue_id": q, "owner": None, "no_change_count": 0}
        for q in range(4)
    ]
    assert "queue_lock" not in a.store._tables  # no delta-rs table opened for a MERGE
    # the rows are the engine's too, and a pull takes them
    counted = pulled.sql("SELECT count(*) AS n FROM queue_lock WHERE consumer_group = 'workers'")
    assert counted.collect()[0]["n"] == 4
    assert len(a.pull(100)) == 20
    a.close()
    b.close()


def test_close_stamps_the_given_back_lock_rows_with_its_now(pulled, clock):
    """``close(now)`` gives back what a client reserved at the time it is told, as a pull
    stamps its lock rows: with pulls run ahead of the clock (``now`` given), the store's
    clock would move each row's last access back."""
    ahead = clock.now_ms() + 600_000
    client = _lite(pulled, clock, "a")
    got = client.pull(2, now=ahead)  # reserves ahead of what it hands out
    assert len(got) == 2
    reserved = {q: e for q, e in client.store.read_locks("workers").items() if e and e.owner == "a"}
    assert any(e.delivered_offset is not None and e.delivered_offset > 2 for e in reserved.values())
    client.close(now=ahead + 5)
    back = {q: e for q, e in client.store.read_locks("workers").items() if e and e.owner == "a"}
    assert back and {e.last_access_ts for q, e in back.items() if e != reserved[q]} == {ahead + 5}


def test_a_pull_group_stays_a_pull_group_once_its_clients_left(pulled, clock):
    """Status calls a group pull clients have pulled from "pull", also once every client
    left and retention removed their ``clients`` rows (its lock rows stay)."""
    from deltamq.jobs import retain

    client = _lite(pulled, clock, "a")
    assert client.pull(3)
    client.close()
    retain.run(pulled.context, clock.now_ms() + pulled.config.client_timeout_ms + 1, force=True)
    assert pulled.sql("SELECT count(*) AS n FROM clients").collect()[0]["n"] == 0
    kinds = {g["group"]: g["kind"] for g in pulled.status()["groups"]}
    assert kinds["workers"] == "pull"


def test_the_spark_free_client_takes_its_arrow_pool_from_the_config(pulled, clock):
    """deltamq/arrow_memory.py: the client switches its process's Arrow allocator as its
    config says, from the process's pool whatever it is (the conftest puts it back)."""
    import dataclasses

    import pyarrow as pa

    pa.set_memory_pool(pa.mimalloc_memory_pool())
    config = dataclasses.replace(pulled.config, pull_memory_pool="system")
    client = PullConsumer(pulled.warehouse.location, "workers", "pooled", config=config, clock=clock)
    try:
        assert pa.default_memory_pool().backend_name == "system"
        system = pa.system_memory_pool()
        before = system.total_bytes_allocated()
        got = client.pull(100, now=clock.now_ms())
        assert len(got) == 20 and got[0].body.startswith(b"q")
        assert system.total_bytes_allocated() > before  # the files it decoded
    finally:
        client.close()


def test_the_broker_s_pull_client_switches_its_process_pool_too(pulled, clock):
    """Broker.pull_consumer applies ``pull_memory_pool`` (``auto``) as the Spark-free
    client does: from pyarrow's mimalloc to jemalloc (the conftest puts the pool back)."""
    import pyarrow as pa

    pa.set_memory_pool(pa.mimalloc_memory_pool())
    with pytest.raises(UnknownGroup):  # a client refused changes nothing in its process
        pulled.pull_consumer("nope", "spark-pooled")
    with pytest.raises(UnknownGroup):
        PullConsumer(pulled.warehouse.location, "nope", "lite-pooled", config=pulled.config, clock=clock)
    assert pa.default_memory_pool().backend_name == "mimalloc"
    client = pulled.pull_consumer("workers", "spark-pooled")
    try:
        assert pa.default_memory_pool().backend_name in ("jemalloc", "system")  # system: no jemalloc built
        assert len(client.pull(100, now=clock.now_ms())) == 20
    finally:
        client.close()
