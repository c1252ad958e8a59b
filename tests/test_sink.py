"""Exactly-once Delta sinks: a group's messages MERGEd into a Delta table on a key, guarded
so that replays change nothing."""

from __future__ import annotations

import pytest
from pyspark.sql import functions as F
from support.listeners import order_rows, order_rows_without_guard

from deltamq import Message
from deltamq.errors import ConfigError, ListenerUnavailable
from deltamq.jobs import retain
from deltamq.jobs.sink import SinkError


@pytest.fixture
def lake(warehouse_with):
    return warehouse_with("orders", queues=2, group="lake", recorder=None).broker


def _table(sink) -> dict[str, int]:
    rows = sink.read().collect()
    assert len(rows) == len({r["order_id"] for r in rows}), "a key twice in the sink"
    return {r["order_id"]: r["amount"] for r in rows}


@pytest.mark.spark  # also on Apache Spark (pytest --engine spark -m spark)
@pytest.mark.story(s3="slow")  # the S3 variant in the slow tier (the default tier stays under 6 min)
def test_a_sink_keeps_the_latest_message_per_key_and_replays_change_nothing(lake, clock, location):
    sink = lake.sink_to_table("lake", f"{location}-orders-sink", ["order_id"], order_rows)
    p = lake.producer("p")
    for i in range(6):
        p.send(Message("orders", str(i).encode(), keys=f"o{i % 4}"))  # o0 and o1 sent twice
    run = lake.tick(clock.now_ms()).job("sink")
    assert run.rows_in == 6
    assert _table(sink) == {"o0": 4, "o1": 5, "o2": 2, "o3": 3}
    clock.advance(seconds=1)
    p.send(Message("orders", b"40", keys="o0"))
    p.send(Message("orders", b"70", keys="o7"))
    assert lake.tick(clock.now_ms()).job("sink").rows_in == 2
    assert _table(sink) == {"o0": 40, "o1": 5, "o2": 2, "o3": 3, "o7": 70}
    # replay everything from the start (a crash before the offsets, or an operator's reset)
    lake.reset_offsets("lake", 0)
    assert sink.run(clock.now_ms()).messages == 8
    assert _table(sink) == {"o0": 40, "o1": 5, "o2": 2, "o3": 3, "o7": 70}
    assert sink.run(clock.now_ms()).messages == 0  # caught up


def test_a_sink_honours_its_subscription_and_an_identity_transform(lake, clock, tmp_path):
    lake.create_topic("audit", queues=1)
    lake.create_group("raw", consume_from="FIRST_OFFSET")
    lake.subscribe("raw", "audit", "keep")
    sink = lake.sink_to_table("raw", str(tmp_path / "raw"), "msg_id")
    p = lake.producer("p")
    kept = p.send(Message("audit", b"a", tags="keep"))
    p.send(Message("audit", b"b", tags="drop"))
    lake.tick(clock.now_ms())
    rows = sink.read().collect()
    assert [(r["msg_id"], bytes(r["body"])) for r in rows] == [(kept, b"a")]
    assert set(sink.read().columns) >= {"topic", "queue_offset", "properties", "_deltamq_order"}


def test_sink_configuration_errors_name_the_bad_value(lake, tmp_path):
    table = str(tmp_path / "t")
    with pytest.raises(SinkError, match="_deltamq_order"):
        lake.sink_to_table("lake", table, ["order_id"], order_rows_without_guard)
    with pytest.raises(SinkError, match="lacks \\['amount_id'\\]"):
        lake.sink_to_table("lake", table, ["amount_id"], order_rows)
    with pytest.raises(ConfigError, match="absolute path"):
        lake.sink_to_table("lake", "relative/t", ["order_id"], order_rows)
    for own in (lake.warehouse.path("commit_log"), f"file://{lake.warehouse.location}/offsets/"):
        with pytest.raises(ConfigError, match="own tables"):
            lake.sink_to_table("lake", own, ["order_id"], order_rows)
    with pytest.raises(ConfigError, match="key column '1x'"):
        lake.sink_to_table("lake", table, ["1x"], order_rows)
    lake.create_group("pushed", lambda m: None)
    with pytest.raises(ConfigError, match="push listener"):
        lake.sink_to_table("pushed", table, ["order_id"], order_rows)
    sink = lake.sink_to_table("lake", table, ["order_id"], "support.listeners:order_rows")
    with pytest.raises(ConfigError, match="is a sink"):
        lake.pull_consumer("lake", "c1")
    with pytest.raises(
        ConfigError, match="'lake' is the sink into .*a push listener needs a group of its own"
    ):
        lake.create_group("lake", lambda m, c: None, exist_ok=True)  # before: registered, and it took them
    assert "lake" not in lake.catalog.listeners
    assert sink.read().count() == 0  # created empty
    lake.create_group("other", consume_from="FIRST_OFFSET")
    with pytest.raises(SinkError, match="has columns"):
        lake.sink_to_table("other", table, ["msg_id"])  # the identity rows do not fit that table


def test_an_older_message_merged_in_a_later_pass_does_not_overwrite_a_newer_one(lake, clock, tmp_path):
    """Queues advance independently: with one message per queue per pass, the older
    message of key A (queue 0, offset 2) is merged two passes after the newer one (queue 1,
    offset 0). The replay guard keeps the newer; a plain upsert would go back to 'old'."""
    lake.delete_group("lake", force=True)
    lake.create_group("lake", consume_from="FIRST_OFFSET", pull_batch_size=1)
    lake.subscribe("lake", "orders")
    sink = lake.sink_to_table("lake", str(tmp_path / "s"), ["order_id"], order_rows)
    p = lake.producer("p")

    def to(q):
        return lambda n, m, a: q

    for body, key in ((b"1", "f1"), (b"2", "f2"), (b"10", "A")):
        p.send(Message("orders", body, keys=key), selector=to(0))
    clock.advance(seconds=1)
    p.send(Message("orders", b"20", keys="A"), selector=to(1))
    t = clock.now_ms()
    lake.tick(t)
    assert _table(sink) == {"f1": 1, "A": 20}
    for i in range(1, 3):
        lake.tick(t + i)
    assert _table(sink) == {"f1": 1, "f2": 2, "A": 20}


def test_a_sink_whose_transform_cannot_be_imported_waits_and_the_tick_goes_on(
    lake, clock, tmp_path, monkeypatch
):
    """A sink's transform that the tick's process cannot import (a tick run from another
    folder) stops that sink alone, as a listener that cannot be loaded stops its group:
    its messages wait, the later jobs still run, and the tick names the group and why
    (``deltamq tick`` exits 4). Once importable, the next tick sinks them."""
    import sys

    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "lake_transforms.py").write_text(
        "def rows(df):\n"
        "    return df.selectExpr('keys AS order_id', 'CAST(CAST(body AS STRING) AS INT) AS amount', "
        "'_deltamq_order')\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    sink = lake.sink_to_table("lake", str(tmp_path / "orders-sink"), ["order_id"], "lake_transforms:rows")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(folder)])
    monkeypatch.delitem(sys.modules, "lake_transforms")
    p = lake.producer("p")
    for i in range(3):
        p.send(Message("orders", str(i).encode(), keys=f"o{i}"))
    result = lake.tick(clock.now_ms())
    assert [(g, "lake_transforms:rows" in why) for g, why in result.setup_errors] == [("lake", True)]
    assert result.job("sink").status == "OK" and "cannot be imported" in (result.job("sink").error or "")
    assert result.ok and not [j.job for j in result.jobs if j.status == "FAILED"]
    after = [j for j in result.jobs[[j.job for j in result.jobs].index("sink") + 1 :]]
    assert after and all(j.status == "OK" or j.note for j in after)  # ran, or had nothing to do
    assert lake.sql("SELECT count(*) AS n FROM offsets WHERE consumer_group = 'lake'").collect()[0]["n"] == 0
    with pytest.raises(ListenerUnavailable, match="lake_transforms:rows"):
        sink.run(clock.now_ms())  # asked for by name: raised, not a result to overlook
    monkeypatch.syspath_prepend(str(folder))
    clock.advance(seconds=1)
    again = lake.tick(clock.now_ms())
    assert again.setup_errors == () and again.job("sink").rows_in == 3
    assert _table(sink) == {"o0": 0, "o1": 1, "o2": 2}


def test_a_sink_whose_pass_fails_waits_and_the_other_sinks_and_jobs_go_on(lake, clock, tmp_path):
    """A transform failing on the rows it is given stops its own sink only (nothing
    merged, offsets kept, the tick names it and why, exit 4): the sinks after it merge and
    the later jobs run, instead of the whole tick failing at that sink, tick after tick."""
    from support.listeners import order_rows_refusing_poison

    bad = lake.sink_to_table("lake", str(tmp_path / "a"), ["order_id"], order_rows_refusing_poison)
    lake.create_group("zlake", consume_from="FIRST_OFFSET")
    lake.subscribe("zlake", "orders")
    good = lake.sink_to_table("zlake", str(tmp_path / "z"), ["order_id"], order_rows)
    p = lake.producer("p")
    p.send(Message("orders", b"1", keys="o1"))
    p.send(Message("orders", b"2", keys="poison"))
    result = lake.tick(clock.now_ms())
    [(group, why)] = result.setup_errors
    assert group == "lake" and "order 'poison' cannot be written" in why and str(tmp_path / "a") in why
    assert _table(good) == {"o1": 1, "poison": 2} and bad.read().count() == 0
    assert result.job("retain").status in ("OK", "SKIPPED") and result.job("retain").error is None
    assert not [j.job for j in result.jobs if j.status == "FAILED"]
    with pytest.raises(Exception, match="poison"):
        bad.run(clock.now_ms())  # asked for by name: raised


def test_a_sink_table_whose_column_types_do_not_take_the_output_is_refused_when_configured(lake, tmp_path):
    """The table check compared column names only: a table with a string where the
    transform gives a bigint (or the other way) was accepted, and every tick's sink pass
    failed (Sail) or could write nulls. A column the output gives in a narrower type of
    the same kind (int for bigint) is written as before."""
    spark = lake.engine.spark
    strict = str(tmp_path / "strict")
    spark.createDataFrame(
        [("o1", "10", "m", "x")], "order_id string, amount string, msg_id string, _deltamq_order string"
    ).write.format("delta").save(strict)
    with pytest.raises(SinkError, match=r"amount: bigint → string.*cast them in the transform"):
        lake.sink_to_table("lake", strict, ["order_id"], order_rows)
    wide = str(tmp_path / "wide")
    spark.createDataFrame(
        [("o1", 1.5, "m", "x")], "order_id string, amount double, msg_id string, _deltamq_order string"
    ).write.format("delta").save(wide)
    with pytest.raises(SinkError, match=r"amount: bigint → double"):  # bigint to double may round
        lake.sink_to_table("lake", wide, ["order_id"], order_rows)
    narrow = str(tmp_path / "narrow")  # a bigint amount; the transform gives an int
    spark.createDataFrame(
        [], "order_id string, amount bigint, msg_id string, _deltamq_order string"
    ).write.format("delta").save(narrow)

    def int_amounts(df):
        return order_rows(df).withColumn("amount", F.col("amount").cast("int"))

    sink = lake.sink_to_table("lake", narrow, ["order_id"], int_amounts)
    lake.producer("p").send(Message("orders", b"7", keys="o1"))
    lake.tick()
    assert _table(sink) == {"o1": 7}


def test_a_group_whose_pull_client_died_can_become_a_sink_and_retention_forgets_that_client(
    lake, clock, tmp_path
):
    """A pull client that never closed stays in ``clients``: a live one keeps a sink out of
    its group; past the client timeout it has left, the group may become a sink, and the
    next retention pass removes its row."""
    lake.create_group("pulled", consume_from="FIRST_OFFSET")
    lake.subscribe("pulled", "orders")
    consumer = lake.pull_consumer("pulled", "c1")
    consumer.heartbeat(clock.now_ms())  # then dies without close()
    table = str(tmp_path / "t")
    with pytest.raises(ConfigError, match=r"live pull clients \(c1\)"):
        lake.sink_to_table("pulled", table, ["msg_id"])
    clock.advance(ms=lake.config.client_timeout_ms + 1)
    lake.sink_to_table("pulled", table, ["msg_id"])
    clients = "SELECT count(*) AS n FROM clients WHERE consumer_group = 'pulled'"
    assert lake.sql(clients).collect()[0]["n"] == 1
    run = retain.run(lake.context, clock.now_ms(), force=True)
    assert run.pruned["clients"] == 1
    assert lake.sql(clients).collect()[0]["n"] == 0
