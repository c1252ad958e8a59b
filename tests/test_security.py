"""Security: SQL only from validated identifiers and escaped literals, names that cannot
leave the warehouse, read-only ``deltamq sql``.

The SQL test records every statement the engine runs (the same recorder the Apache
Spark guard parses) while hostile text goes into every field a user controls, then
splits each statement into Spark SQL tokens: the hostile text may appear only inside
string literals, whole, and read back equal to what the user sent.
"""

from __future__ import annotations

import re

import pytest
from conftest import table_versions
from support.helpers import recorded_sql

from deltamq import Message
from deltamq.cli import main
from deltamq.errors import DeltaMQError, ReadOnlyQuery
from deltamq.tables.sqlguard import check_read_only, tokens

MARK = "ZQX"
HOSTILE = MARK + "' OR '1'='1'; DROP TABLE offsets; -- \\' /* `x` \" \n) UNION SELECT * FROM leases"

SQL92_FORM = HOSTILE.replace("'", "''")  # the text as a string inside an SQL92 filter
FORMS = (HOSTILE, SQL92_FORM, MARK + "x")


def _unescape(literal: str) -> str:
    """The value of a Spark SQL string literal (backslash escapes)."""
    body = literal[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r", "t": "\t"}.get(m.group(1), m.group(1)), body)


def _outside_literals(statement: str) -> list[str]:
    """Problems with the hostile text in one statement: outside a string literal, or a
    literal holding part of it but not all of it."""
    problems = []
    for t in tokens(statement):
        if MARK not in t.text:
            continue
        if t.kind != "string":
            problems.append(f"{t.kind} token {t.text[:40]!r}")
        elif not any(form in _unescape(t.text) for form in FORMS):
            problems.append(f"literal {t.text[:60]!r} holds only part of the text")
    return problems


def _try(fn, *args, **kwargs):
    """Hostile calls may be refused (a clear deltamq error); they must not break SQL."""
    try:
        return fn(*args, **kwargs)
    except (DeltaMQError, ValueError, LookupError, TypeError) as e:
        assert "PARSE_SYNTAX_ERROR" not in str(e) and "invalid argument" not in str(e), e
        return None


def test_user_text_reaches_sql_only_as_escaped_literals(broker, clock):
    with recorded_sql() as recorded:
        broker.create_topic("orders", queues=2)
        broker.create_group("push", "support.listeners:always_fail")
        broker.create_group("pulled")
        broker.subscribe("push", "orders", f"color = '{SQL92_FORM}' OR n > 1", "SQL92")
        broker.subscribe("pulled", "orders", f"{MARK}x || b")
        p = broker.producer("p")
        p.send_batch(
            [
                Message(
                    "orders",
                    HOSTILE,
                    tags=HOSTILE,
                    keys=HOSTILE,
                    properties={"color": HOSTILE, "n": "2", "x" + MARK: HOSTILE},
                ),
                Message("orders", b"b", tags=f"{MARK}x", keys=f"{MARK}x"),
                Message("orders", b"late", delay_level=2, keys=HOSTILE),
            ]
        )
        hostile_df = broker.engine.spark.createDataFrame(
            [("orders", HOSTILE, HOSTILE, HOSTILE)], "topic string, body string, tags string, keys string"
        )
        p.send_dataframe(hostile_df)
        clock.advance(seconds=1)
        broker.tick()
        consumer = broker.pull_consumer("pulled", "c1")
        got = consumer.pull(10)
        assert [m.keys for m in got] == [f"{MARK}x"]
        _try(consumer.ack, [HOSTILE])
        _try(consumer.nack, [HOSTILE + "|0|1|2"])
        consumer.ack([m.receipt_handle for m in got])
        _try(broker.trace, HOSTILE)
        _try(broker.find_by_key, HOSTILE)
        assert broker.find_by_key(f"{MARK}x")
        _try(lambda: broker.dead_letters(msg_ids=[HOSTILE]).collect())
        _try(p.end_transaction, HOSTILE, "COMMIT")
        _try(p.end_transactions, {HOSTILE: "ROLLBACK"})
        _try(broker.producer, HOSTILE)
        _try(broker.pull_consumer, "pulled", HOSTILE)
        _try(broker.create_group, HOSTILE)
        _try(broker.subscribe, "push", HOSTILE)
        _try(broker.reset_offsets, HOSTILE, 0)
        _try(broker.create_topic, HOSTILE)
        clock.advance(minutes=2)
        broker.tick()

    hostile = [s for s in recorded if MARK in s]
    # most user text travels as DataFrame data and never becomes SQL text; subscriptions do
    assert any(s.startswith("MERGE INTO") and "subscription" in s for s in hostile), hostile
    problems = {s[:120]: _outside_literals(s) for s in hostile}
    assert not {k: v for k, v in problems.items() if v}
    # the hostile values were stored and matched as data, not as SQL
    rows = broker.sql("SELECT topic, keys, tags, properties['color'] AS c FROM commit_log").collect()
    stored = [r for r in rows if r["topic"] == "orders" and r["c"] is not None]
    assert [(r["keys"], r["tags"], r["c"]) for r in stored] == [(HOSTILE, HOSTILE, HOSTILE)]
    # the SQL92 filter compared the value as data: only that message reached the failing
    # listener, and only it was sent back to the retry topic
    retried = [r for r in rows if r["topic"] == "%RETRY%push"]
    assert retried and all(r["c"] == HOSTILE for r in retried)
    assert broker.sql("SELECT count(*) AS n FROM offsets").collect()[0]["n"] > 0  # not dropped


@pytest.mark.parametrize(
    "query",
    [
        "DELETE FROM offsets",
        "WITH x AS (SELECT 1) INSERT INTO offsets SELECT * FROM offsets",
        "SELECT 1; DELETE FROM offsets",
        "select 1 ;\n drop table offsets",
        "(SELECT 1) UNION ALL (SELECT 2); TRUNCATE TABLE offsets",
        "FROM offsets INSERT OVERWRITE TABLE x SELECT *",
        "EXPLAIN MERGE INTO offsets t USING leases s ON true WHEN MATCHED THEN DELETE",
        "SET spark.sql.ansi.enabled=false",
        "/* SELECT */ UPDATE offsets SET next_offset = 0",
        "-- SELECT\nCREATE TABLE x (a INT)",
        "SELECT * FROM offsets WHERE 1=1 /* */; ALTER TABLE offsets ADD COLUMNS (x INT)",
        "CACHE TABLE offsets",
        "",
    ],
)
def test_read_only_sql_refuses_every_write(broker, tmp_path, query):
    before = table_versions(tmp_path / "wh")
    with pytest.raises(ReadOnlyQuery, match="write=True"):
        broker.sql(query)
    assert table_versions(tmp_path / "wh") == before


@pytest.mark.parametrize(
    "query",
    [
        "SELECT replace(topic, 'a', 'b') AS t FROM topic_config",
        "SELECT 'DELETE FROM offsets; DROP TABLE x' AS s",
        "-- DELETE FROM offsets\nSELECT 1 AS one",
        "SELECT 1 AS one;",
        "SELECT `update` FROM (SELECT 1 AS `update`)",
        "WITH x AS (SELECT 1 AS a) SELECT a FROM x",
        "(SELECT 1 AS one)",
        "VALUES (1)",
    ],
)
def test_read_only_sql_runs_queries(broker, query):
    check_read_only(query)
    broker.sql(query).collect()


def test_cli_sql_is_read_only_without_write(broker, tmp_path, capsys):
    broker.create_topic("orders")
    wh = str(tmp_path / "wh")
    before = table_versions(wh)
    assert main(["sql", "--warehouse", wh, "DELETE FROM topic_config"]) != 0
    assert "write" in capsys.readouterr().err
    assert table_versions(wh) == before
    delete = f"DELETE FROM delta.`{wh}/topic_config` WHERE topic = 'orders'"
    assert main(["sql", "--warehouse", wh, "--write", delete]) == 0
    assert broker.sql("SELECT count(*) AS n FROM topic_config").collect()[0]["n"] == 0


ESCAPES = ["../x", "..", "/abs", "a/b", "a\\b", "x\x00y", "~", "ordérs", " ", "a\nb"]


def test_names_cannot_escape_the_warehouse(broker, tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.chdir(outside)  # a relative escape would land here
    broker.create_topic("orders")
    broker.create_group("g")
    calls = (
        lambda n: broker.create_topic(n),
        lambda n: broker.create_group(n),
        lambda n: broker.subscribe("g", n),
        lambda n: broker.producer(n).send(Message("orders", b"x")),
        lambda n: broker.pull_consumer("g", n),
        lambda n: broker.producer("p").send(Message(n, b"x")),
    )
    for name in ESCAPES:
        for call in calls:
            with pytest.raises((DeltaMQError, ValueError)):
                call(name)
    with pytest.raises(DeltaMQError, match="warehouse's own tables"):
        broker.sink_to_table("g", str(tmp_path / "wh" / "offsets"), ["msg_id"])
    # '%' is allowed in topic names (%RETRY%g); as a partition value it stays escaped
    broker.create_topic("%2e%2e")
    broker.subscribe("g", "%2e%2e")
    broker.producer("p").send(Message("%2e%2e", b"x"))
    broker.tick()
    assert broker.sql("SELECT count(*) AS n FROM consume_queue WHERE topic = '%2e%2e'").collect()[0]["n"] == 1
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "wh"]


def test_producers_cannot_write_system_or_read_only_topics(broker, tmp_path):
    broker.create_topic("readonly", perm="R")
    broker.create_topic("denied", perm="DENY")
    before = table_versions(tmp_path / "wh")
    p = broker.producer("p")
    spark = broker.engine.spark
    for topic in (
        "readonly",
        "denied",
        "SCHEDULE_TOPIC_XXXX",
        "RMQ_SYS_TRANS_HALF_TOPIC",
        "%RETRY%g",
        "%DLQ%g",
    ):
        with pytest.raises(DeltaMQError, match=re.escape(topic)):
            p.send(Message(topic, b"x"))
        with pytest.raises(DeltaMQError, match=re.escape(topic)):
            p.send_dataframe(spark.createDataFrame([(topic, "x")], "topic string, body string"))
    assert table_versions(tmp_path / "wh") == before


@pytest.mark.parametrize("where", ["1=1; DELETE FROM offsets", "true) OR (true", "1=1 -- x\n; DROP TABLE x"])
def test_operator_predicates_stay_single_expressions(broker, tmp_path, where):
    before = table_versions(tmp_path / "wh")
    with pytest.raises(Exception, match="(?i)parse|syntax|invalid|expected"):
        broker.dead_letters(where=where).collect()
    assert table_versions(tmp_path / "wh") == before
