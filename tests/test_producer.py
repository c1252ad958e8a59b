"""Producers: fake-clock stamps, sortable ids, queue choice, DataFrame sends, one commit each."""

from __future__ import annotations

import pytest
from conftest import table_versions

from deltamq import Message
from deltamq.sending import queue_for_key


@pytest.fixture
def orders(warehouse_with):
    return warehouse_with("orders", queues=4).broker


def _rows(broker, where="TRUE"):
    return broker.sql(
        f"SELECT msg_id, topic, queue_id, born_ts, store_ts, properties, producer_group, tags, keys, body "
        f"FROM commit_log WHERE {where} ORDER BY msg_id"
    ).collect()


def test_fake_clock_stamps_sends(orders, clock):
    p = orders.producer("shop")
    first = p.send(Message("orders", b"a"))
    clock.advance(minutes=90)
    second = p.send(Message("orders", b"b"))
    rows = {r["msg_id"]: r for r in _rows(orders)}
    assert rows[first]["store_ts"] == rows[first]["born_ts"] == 1_767_225_600_000
    assert rows[second]["store_ts"] == 1_767_225_600_000 + 90 * 60_000
    assert first < second  # ids sort by store time
    assert rows[first]["properties"]["UNIQ_KEY"] == first
    assert rows[first]["producer_group"] == "shop"


def test_ids_sort_by_time_within_and_across_batches(orders, clock):
    p = orders.producer("shop")
    ids1 = p.send_batch([Message("orders", f"m{i}") for i in range(5)])
    clock.advance(ms=1)
    ids2 = p.send_batch([Message("orders", f"n{i}") for i in range(5)])
    assert ids1 == sorted(ids1) and ids2 == sorted(ids2) and ids1[-1] < ids2[0]
    assert len(set(ids1 + ids2)) == 10


def test_each_send_is_one_commit(orders, tmp_path):
    before = table_versions(tmp_path / "wh")["commit_log"]
    orders.producer("p").send_batch([Message("orders", b"x")] * 50)
    assert table_versions(tmp_path / "wh")["commit_log"] == before + 1


def test_round_robin_spreads_over_queues(orders):
    orders.producer("p").send_batch([Message("orders", f"{i}") for i in range(8)])
    counts = orders.sql("SELECT queue_id, count(*) AS n FROM commit_log GROUP BY queue_id").collect()
    assert sorted(r["n"] for r in counts) == [2, 2, 2, 2]


def test_equal_keys_land_in_one_queue_in_python_and_dataframe(orders):
    p = orders.producer("p")
    keys = ["order-1", "order-2", "order-3", "order-1", "order-2", "order-1"]
    p.send_batch([Message("orders", k, keys=k) for k in keys], queue_keys=keys)
    df = orders.engine.spark.createDataFrame([(k, k) for k in keys], "topic_key string, body string")
    p.send_dataframe(df.selectExpr("'orders' AS topic", "body", "topic_key"), queue_key="topic_key")
    rows = orders.sql("SELECT CAST(body AS STRING) AS k, queue_id FROM commit_log").collect()
    by_key: dict[str, set[int]] = {}
    for r in rows:
        by_key.setdefault(r["k"], set()).add(r["queue_id"])
    assert all(len(q) == 1 for q in by_key.values())
    assert {k: q.pop() for k, q in by_key.items()} == {k: queue_for_key(k, 4) for k in set(keys)}


def test_selector_picks_the_queue(orders):
    mid = orders.producer("p").send(Message("orders", b"x"), selector=lambda n, m, arg: arg % n, arg=7)
    assert _rows(orders, f"msg_id = '{mid}'")[0]["queue_id"] == 3


def test_send_dataframe(orders, clock):
    spark = orders.engine.spark
    df = spark.range(1000).selectExpr(
        "'orders' AS topic",
        "CAST(id AS STRING) AS body",
        "CASE WHEN id % 10 = 0 THEN 'A' ELSE 'B' END AS tags",
        "CAST(id % 3 AS INT) AS delay_level",
        "map('order', CAST(id AS STRING)) AS properties",
    )
    ids = orders.producer("bulk").send_dataframe(df)
    assert ids.count() == 1000
    stats = orders.sql(
        "SELECT count(*) AS n, count(DISTINCT msg_id) AS ids, min(store_ts) AS lo, max(store_ts) AS hi, "
        "count(DISTINCT batch_id) AS batches, "
        "sum(CASE WHEN properties['DELAY'] IS NOT NULL THEN 1 ELSE 0 END) "
        "AS delayed, sum(CASE WHEN properties['UNIQ_KEY'] = msg_id THEN 1 ELSE 0 END) AS uniq "
        "FROM commit_log"
    ).collect()[0]
    assert (stats["n"], stats["ids"], stats["batches"]) == (1000, 1000, 1)
    assert stats["lo"] == stats["hi"] == clock.now_ms()
    assert stats["delayed"] == 666 and stats["uniq"] == 1000


def test_send_dataframe_over_many_partitions_gives_unique_ids(orders):
    # monotonically_increasing_id is (partition << 33) + row: a position must never be
    # truncated into another row's id (it was, before: 8 hex digits of a 34-bit value)
    spark = orders.engine.spark
    df = spark.range(30_000).repartition(3).selectExpr("'orders' AS topic", "CAST(id AS STRING) AS body")
    orders.producer("bulk").send_dataframe(df)
    stats = orders.sql(
        "SELECT count(*) AS n, count(DISTINCT msg_id) AS ids, max(length(msg_id)) AS width, "
        "count(DISTINCT batch_pos) AS positions, max(batch_pos) AS hi FROM commit_log"
    ).collect()[0]
    assert (stats["n"], stats["ids"], stats["positions"], stats["width"]) == (30_000, 30_000, 30_000, 24)
    assert stats["hi"] >= 1 << 22  # more than one partition really took part


def test_msg_id_is_never_truncated(spark):
    from pyspark.sql import functions as F

    from deltamq import ids

    for pos in (0, 0xFFFFFFFF, 1 << 32, (1 << 62) | 5):
        got = (
            spark.range(1)
            .select(ids.msg_id_col(F.lit(7).cast("bigint"), F.lit(pos).cast("bigint")))
            .first()[0]
        )
        assert got == ids.msg_id(7, pos)
        assert ids.parse_msg_id(got) == (7, pos)


def test_send_dataframe_empty_commits_nothing(orders, tmp_path):
    before = table_versions(tmp_path / "wh")
    df = orders.engine.spark.createDataFrame([], "topic string, body binary")
    assert orders.producer("p").send_dataframe(df).count() == 0
    assert table_versions(tmp_path / "wh") == before


def test_str_and_binary_bodies(orders):
    p = orders.producer("p")
    a = p.send(Message("orders", "héllo"))
    b = p.send(Message("orders", b"\x00\xff"))
    rows = {r["msg_id"]: r["body"] for r in _rows(orders)}
    assert bytes(rows[a]) == "héllo".encode() and bytes(rows[b]) == b"\x00\xff"


def test_a_batch_of_plain_and_special_messages_stores_each_as_its_own(orders):
    """Rows are built a column at a time, plain messages without a dictionary of their
    own: in one batch a plain message, one with properties, a delayed one and a timer
    each keep what is theirs, and round-robin goes on across batches one queue at a time."""
    p = orders.producer("p")
    first = p.send_results(
        [
            Message("orders", b"plain"),
            Message("orders", b"props", properties={"k": "v"}, tags="t", keys="x"),
            Message("orders", b"delayed", delay_level=99),
            Message("orders", b"timer", deliver_at=1_767_225_600_000 + 60_000, flag=7),
        ]
    )
    second = p.send_results([Message("orders", f"{i}".encode()) for i in range(5)])
    rows = {r["msg_id"]: r for r in _rows(orders)}
    plain, props, delayed, timer = (rows[r.msg_id] for r in first)
    assert plain["properties"] == {"UNIQ_KEY": first[0].msg_id} and plain["tags"] is None
    assert props["properties"] == {"k": "v", "UNIQ_KEY": first[1].msg_id} and props["keys"] == "x"
    highest = first[2].delay_level
    assert first[2].requested_delay_level == 99 and 0 < highest < 99
    assert delayed["properties"]["DELAY"] == str(highest)
    assert first[3].deliver_at == 1_767_225_660_000
    assert timer["properties"]["TIMER_DELIVER_MS"] == "1767225660000" and first[0].deliver_at is None
    queues = [r.queue_id for r in [*first, *second]]
    assert all((b - a) % 4 == 1 for a, b in zip(queues, queues[1:], strict=False)), queues


@pytest.mark.parametrize("field", ["delay_level", "flag"])
def test_a_boolean_delay_level_or_flag_is_refused(orders, field):
    from deltamq.errors import InvalidMessage

    with pytest.raises(InvalidMessage, match=field.replace("_", "[_ ]")):
        orders.producer("p").send(Message("orders", b"x", **{field: False}))


def test_queue_choice_by_key_selector_and_round_robin_per_topic(warehouse_with):
    """The three ways of choosing a queue, built a column at a time: equal keys one
    queue (crc32 of the key), a selector's answer as given, and round-robin continuing
    per topic across batches of two topics."""
    broker = warehouse_with("orders", queues=4).broker
    broker.create_topic("refunds", queues=3)
    p = broker.producer("p")
    keyed = p.send_results([Message("orders", b"x")] * 3, queue_keys=["a", "b", "a"])
    assert [r.queue_id for r in keyed] == [queue_for_key(k, 4) for k in ("a", "b", "a")]
    chosen = p.send_results([Message("orders", b"x")] * 3, selector=lambda n, m, arg: arg % n, arg=6)
    assert [r.queue_id for r in chosen] == [2, 2, 2]
    mixed = [Message(t, b"x") for t in ("orders", "refunds", "orders", "refunds", "refunds")]
    first, second = p.send_results(mixed), p.send_results(mixed)
    for topic, queues in (("orders", 4), ("refunds", 3)):
        seen = [r.queue_id for r in [*first, *second] if r.topic == topic]
        assert all((b - a) % queues == 1 for a, b in zip(seen, seen[1:], strict=False)), (topic, seen)


@pytest.mark.parametrize("transactional", [False, True])
def test_a_plan_without_the_absent_columns_stores_the_same_rows(orders, transactional):
    """``send_dataframe`` leaves out the expressions of optional columns its input lacks;
    the rows and the rule each breaks are those of the plan over every column."""
    from deltamq.producer import _row_problem, plan_send_dataframe

    spark = orders.engine.spark
    inputs = [
        spark.createDataFrame([("orders", b"a"), ("nope", b"b")], "topic string, body binary"),
        spark.createDataFrame(
            [
                ("orders", b"a", {"k": "v", "UNIQ_KEY": "x"}),
                ("orders", b"b", {"TIMER_DELIVER_MS": "1767225660000"}),
            ],
            "topic string, body binary, properties map<string,string>",
        ),
        spark.createDataFrame(
            [("orders", b"a", 3, 2, 9), ("orders", b"b", None, 7, None)],
            "topic string, body binary, delay_level int, queue_id int, deliver_at_ms long",
        ),
    ]
    p = orders.producer("p")
    for df in inputs:
        checked = p._check_dataframe_columns(df.coalesce(1), None)
        given = frozenset(df.columns)
        args = dict(queues={"orders": 4}, batch_id=77, now_ms=1_767_225_600_000, producer_group="p",
                    max_level=18, rr_start=5, transactional=transactional)  # fmt: skip
        every = plan_send_dataframe(checked, **args).collect()
        assert plan_send_dataframe(checked, given=given, **args).collect() == every, df.columns
        rules = [
            _row_problem({"orders": 4}, args["now_ms"], orders.config, transactional, g)
            for g in (None, given)
        ]
        assert [checked.select(r.alias("p")).collect() for r in rules][0] == checked.select(
            rules[1].alias("p")
        ).collect()


def test_a_send_to_a_topic_not_there_names_the_topics_and_a_level_with_a_timer_is_refused(orders, clock):
    """A mistyped topic's error lists the topics there are; a message with both a delay
    level and ``deliver_at`` is refused, as the CLI's options exclude each other (a
    ``TIMER_DELIVER_MS`` property beside a level keeps §2's routing: the timer), nothing
    stored."""
    from deltamq.errors import InvalidMessage, InvalidTimer, UnknownTopic

    p = orders.producer("p")
    with pytest.raises(UnknownTopic, match=r"topic 'Orders' does not exist \(the topics are orders\)"):
        p.send(Message("Orders", b"x"))
    orders.create_group("g")
    with pytest.raises(UnknownTopic, match=r"the topics are orders\)"):
        orders.subscribe("g", "Orders")
    before = orders.sql("SELECT count(*) AS n FROM commit_log").collect()[0]["n"]
    with pytest.raises(InvalidTimer, match="both delay_level=3 and deliver_at; give one of them"):
        p.send_batch(
            [Message("orders", b"a"), Message("orders", b"x", delay_level=3, deliver_at=clock.now_ms() + 1)]
        )
    both = orders.spark.createDataFrame(
        [("orders", b"x", 3, clock.now_ms() + 1000)],
        "topic string, body binary, delay_level int, deliver_at_ms bigint",
    )
    with pytest.raises(InvalidMessage, match="both a delay_level and deliver_at_ms"):
        p.send_dataframe(both)
    assert orders.sql("SELECT count(*) AS n FROM commit_log").collect()[0]["n"] == before
