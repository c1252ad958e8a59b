"""Every producer and admin validation rule: its own error class, and nothing stored."""

from __future__ import annotations

import pytest
from conftest import table_versions

from deltamq import Message
from deltamq.errors import (
    AlreadyExists,
    BodyTooLarge,
    ConfigError,
    FilterSyntaxError,
    InvalidDelayLevel,
    InvalidGroup,
    InvalidMessage,
    InvalidProperties,
    InvalidTopic,
    SystemTopicError,
    TopicNotWritable,
    UnknownGroup,
    UnknownTopic,
)


@pytest.fixture
def ready(broker):
    broker.create_topic("orders", queues=4)
    broker.create_topic("readonly", queues=1, perm="R")
    return broker


BAD_MESSAGES = [
    pytest.param(Message("", b"x"), InvalidTopic, "non-empty", id="empty-topic"),
    pytest.param(Message("a" * 128, b"x"), InvalidTopic, "at most 127", id="topic-too-long"),
    pytest.param(Message("../x", b"x"), InvalidTopic, "letters, digits", id="topic-path"),
    pytest.param(Message("/abs", b"x"), InvalidTopic, "letters, digits", id="topic-abs"),
    pytest.param(Message("ordérs", b"x"), InvalidTopic, "letters, digits", id="topic-unicode"),
    pytest.param(Message("nope", b"x"), UnknownTopic, "does not exist", id="unknown-topic"),
    pytest.param(Message("readonly", b"x"), TopicNotWritable, "perm R", id="not-writable"),
    pytest.param(Message("SCHEDULE_TOPIC_XXXX", b"x"), SystemTopicError, "system topic", id="schedule"),
    pytest.param(Message("RMQ_SYS_TRANS_HALF_TOPIC", b"x"), SystemTopicError, "system topic", id="half"),
    pytest.param(Message("%RETRY%g", b"x"), SystemTopicError, "system topic", id="retry"),
    pytest.param(Message("%DLQ%g", b"x"), SystemTopicError, "system topic", id="dlq"),
    pytest.param(Message("orders", b"x" * (4 * 1024 * 1024 + 1)), BodyTooLarge, "at most 4194304", id="body"),
    pytest.param(Message("orders", 42), InvalidMessage, "bytes or str", id="body-type"),
    pytest.param(
        Message("orders", b"x", properties={"a": 1}), InvalidProperties, "values must be str", id="prop-value"
    ),
    pytest.param(
        Message("orders", b"x", properties={1: "a"}), InvalidProperties, "non-empty strings", id="prop-name"
    ),
    pytest.param(Message("orders", b"x", properties=["a"]), InvalidProperties, "mapping", id="prop-type"),
    pytest.param(Message("orders", b"x", delay_level=-1), InvalidDelayLevel, "negative", id="negative-level"),
    pytest.param(
        Message("orders", b"x", delay_level=1.5), InvalidDelayLevel, "not an integer", id="float-level"
    ),
    pytest.param(Message("orders", b"x", tags=5), InvalidMessage, "tags", id="tags-type"),
]


@pytest.mark.parametrize("bad, error, text", BAD_MESSAGES)
def test_bad_message_in_a_batch_stores_nothing(ready, tmp_path, bad, error, text):
    before = table_versions(tmp_path / "wh")
    good = Message("orders", b"fine")
    with pytest.raises(error, match=text):
        ready.producer("p").send_batch([good, bad, good])
    assert table_versions(tmp_path / "wh") == before
    assert ready.sql("SELECT count(*) AS n FROM commit_log").collect()[0]["n"] == 0


def test_errors_mix_in_builtins(ready):
    with pytest.raises(ValueError):
        ready.producer("p").send(Message("orders", b"x", delay_level=-3))
    with pytest.raises(LookupError):
        ready.producer("p").send(Message("missing", b"x"))


def test_delay_level_above_maximum_is_clamped(ready):
    mid = ready.producer("p").send(Message("orders", b"x", delay_level=99))
    row = ready.sql(f"SELECT properties['DELAY'] AS d FROM commit_log WHERE msg_id = '{mid}'").collect()[0]
    assert row["d"] == "18"


def test_bad_dataframe_stores_nothing(ready, tmp_path):
    spark = ready.engine.spark
    before = table_versions(tmp_path / "wh")
    p = ready.producer("p")
    cases = [
        (spark.createDataFrame([("orders",)], "topic string"), InvalidMessage, "missing"),
        (spark.createDataFrame([("nope", "b")], "topic string, body string"), UnknownTopic, "nope"),
        (spark.createDataFrame([("%DLQ%x", "b")], "topic string, body string"), SystemTopicError, "system"),
        (spark.createDataFrame([(None, "b")], "topic string, body string"), InvalidTopic, "non-empty"),
        (
            spark.createDataFrame([("orders", "b", -2)], "topic string, body string, delay_level int"),
            InvalidDelayLevel,
            "-2",
        ),
        (
            spark.createDataFrame([("orders", "b", 1)], "topic string, body string, properties int"),
            InvalidProperties,
            "map<string,string>",
        ),
        (
            spark.createDataFrame([("orders", "b", 9)], "topic string, body string, queue_id int"),
            InvalidMessage,
            "outside",
        ),
        (
            spark.range(1).selectExpr("'orders' AS topic", "repeat('x', 4194305) AS body"),
            BodyTooLarge,
            "4194305",
        ),
    ]
    for df, error, text in cases:
        with pytest.raises(error, match=text):
            p.send_dataframe(df)
    assert table_versions(tmp_path / "wh") == before


ADMIN_CASES = [
    ("create_topic", ("SCHEDULE_TOPIC_XXXX",), {}, SystemTopicError),
    ("create_topic", ("ok",), {"queues": 0}, ConfigError),
    ("create_topic", ("ok",), {"queues": 5000}, ConfigError),
    ("create_topic", ("ok",), {"perm": "RWX"}, ConfigError),
    ("create_topic", ("orders",), {}, AlreadyExists),
    ("update_topic", ("missing",), {"queues": 2}, UnknownTopic),
    ("delete_topic", ("missing",), {}, UnknownTopic),
    ("create_group", ("bad group",), {}, InvalidGroup),
    ("create_group", ("%RETRY%g",), {}, InvalidGroup),
    ("create_group", ("g",), {"mode": "FANOUT"}, ConfigError),
    ("create_group", ("g",), {"consume_from": "NOW"}, ConfigError),
    ("create_group", ("g",), {"consume_from": "TIMESTAMP"}, ConfigError),
    ("create_group", ("g",), {"pull_batch_size": 0}, ConfigError),
    ("create_group", ("g",), {"listener": "no_colon_path"}, ConfigError),
    ("delete_group", ("missing",), {}, UnknownGroup),
    ("subscribe", ("missing", "orders"), {}, UnknownGroup),
]


@pytest.mark.parametrize("method, args, kwargs, error", ADMIN_CASES)
def test_bad_admin_calls_change_nothing(ready, tmp_path, method, args, kwargs, error):
    before = table_versions(tmp_path / "wh")
    with pytest.raises(error):
        getattr(ready, method)(*args, **kwargs)
    assert table_versions(tmp_path / "wh") == before


@pytest.mark.parametrize("expression", ["A ||", "|| B", "A || || B", "A B", "* || A"])
def test_bad_tag_expressions_are_refused_at_subscribe(ready, tmp_path, expression):
    ready.create_group("g")
    before = table_versions(tmp_path / "wh")
    with pytest.raises(FilterSyntaxError, match="position"):
        ready.subscribe("g", "orders", expression)
    assert table_versions(tmp_path / "wh") == before
