"""Subscription filters: tags and RocketMQ's SQL92 subset (docs/behaviour.md §3)."""

from __future__ import annotations

import pytest

from deltamq.errors import FilterSyntaxError
from deltamq.filters import compile_sql92, parse_sql92

ROWS = [
    # id, properties, tags
    ("a", {"amount": "150", "region": "eu", "vip": "true"}, "TagA"),
    ("b", {"amount": "50", "region": "us"}, "TagB"),
    ("c", {"amount": "abc", "region": "eu"}, None),
    ("d", {}, "TagA"),
    ("e", {"amount": "100.5", "region": "it's"}, "TagC"),
]

TRUTH = [
    ("amount > 100", {"a", "e"}),
    ("amount >= 150", {"a"}),
    ("amount < 100", {"b"}),
    ("amount = 50", {"b"}),
    ("amount <> 50", {"a", "e"}),  # non-numeric and missing never match a numeric comparison
    ("region = 'eu'", {"a", "c"}),
    ("region <> 'eu'", {"b", "e"}),  # missing region: no match
    ("region = 'it''s'", {"e"}),
    ("region IN ('eu', 'us')", {"a", "b", "c"}),
    ("region NOT IN ('eu')", {"b", "e"}),
    ("amount IN (50, 150)", {"a", "b"}),
    ("amount BETWEEN 50 AND 100.5", {"b", "e"}),
    ("amount NOT BETWEEN 50 AND 100.5", {"a"}),
    ("region IS NULL", {"d"}),
    ("region IS NOT NULL", {"a", "b", "c", "e"}),
    ("vip = TRUE", {"a"}),
    ("TAGS = 'TagA'", {"a", "d"}),
    ("TAGS IS NULL", {"c"}),
    ("region = 'eu' OR region = 'us' AND amount > 100", {"a", "c"}),  # AND binds tighter
    ("(region = 'eu' OR region = 'us') AND amount > 100", {"a"}),
    ("NOT region = 'eu'", {"b", "e"}),
    # three-valued logic, as in RocketMQ's (JMS-derived) filter: a missing or non-numeric
    # value makes a comparison unknown, and NOT unknown is still unknown: no match
    ("NOT (amount > 100) AND region IS NOT NULL", {"b"}),
    ("TRUE", {"a", "b", "c", "d", "e"}),
    ("FALSE OR amount > 140", {"a"}),
    ("1 = 1", {"a", "b", "c", "d", "e"}),
]


@pytest.mark.plan
@pytest.mark.parametrize("expression, expected", TRUTH)
def test_sql92_truth_table(spark, expression, expected):
    df = spark.createDataFrame(ROWS, "id string, properties map<string,string>, tags string")
    df = df.withColumn("keys", df.id)
    got = {r["id"] for r in df.where(compile_sql92(expression)).collect()}
    assert got == expected, expression


MALFORMED = [
    ("amount >", "position 9"),
    ("amount > > 3", "position 10"),
    ("(region = 'eu'", "position 15"),
    ("region = 'eu')", "position 14"),
    ("region = 'eu", "unterminated string starting at position 10"),
    ("region == 'eu'", "position 9"),
    ("amount BETWEEN 1", "position 17"),
    ("amount BETWEEN 'a' AND 'b'", "expected a number at position 16"),
    ("region > 'eu'", "compares numbers only, at position 8"),
    ("region IN ()", "position 12"),
    ("amount NOT 5", "position 12"),
    ("region IS 'x'", "position 11"),
    ("", "empty"),
]


@pytest.mark.unit
@pytest.mark.parametrize("expression, where", MALFORMED)
def test_malformed_expressions_are_rejected_with_a_position(expression, where):
    with pytest.raises(FilterSyntaxError, match=where):
        parse_sql92(expression)


HOSTILE = [
    "a = 'x' OR 1=1) --",
    "'; DROP TABLE commit_log",
    "a = 'x'; DELETE FROM offsets",
    "a = 'unbalanced",
    "(" * 10_000 + "a = 1" + ")" * 10_000,
    "(" * 100 + "a = 1" + ")" * 100,
    "NOT " * 100 + "a = 1",
    "a = 1 -- comment",
    "a = `b`",
    'a = "b"',
]


@pytest.mark.unit
@pytest.mark.parametrize("expression", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_expressions_are_rejected(expression):
    with pytest.raises(FilterSyntaxError):
        parse_sql92(expression)


@pytest.mark.plan
def test_quotes_and_sql_inside_literals_match_literally(spark):
    rows = [("1", {"a": "x' OR '1'='1"}), ("2", {"a": "x"}), ("3", {"a": "'; DROP TABLE t; --"})]
    df = spark.createDataFrame(rows, "id string, properties map<string,string>")
    df = df.withColumn("tags", df.id).withColumn("keys", df.id)
    assert [r["id"] for r in df.where(compile_sql92("a = 'x'' OR ''1''=''1'")).collect()] == ["1"]
    assert [r["id"] for r in df.where(compile_sql92("a = '''; DROP TABLE t; --'")).collect()] == ["3"]


def test_sql92_subscription_end_to_end(broker, clock, tmp_path):
    from support.listeners import Recorder, read_log

    from deltamq import Message

    broker.create_topic("orders", queues=2)
    log = tmp_path / "sql.jsonl"
    broker.create_group("big", Recorder(log), consume_from="FIRST_OFFSET")
    with pytest.raises(FilterSyntaxError, match="position"):
        broker.subscribe("big", "orders", "amount > ", type="SQL92")
    broker.subscribe("big", "orders", "amount > 100 AND region = 'eu'", type="SQL92")
    p = broker.producer("p")
    p.send_batch(
        [
            Message("orders", "yes", properties={"amount": "500", "region": "eu"}),
            Message("orders", "small", properties={"amount": "5", "region": "eu"}),
            Message("orders", "us", properties={"amount": "500", "region": "us"}),
            Message("orders", "none"),
        ]
    )
    result = broker.tick(clock.now_ms()).job("deliver").result
    assert [c["body"] for c in read_log(log)] == ["yes"]
    assert (result.consumed, result.filtered) == (1, 3)
    subs = {s.topic: s for s in broker.subscriptions("big")}
    assert subs["orders"].expr_type == "SQL92"


@pytest.mark.unit
def test_a_tag_quoted_twice_is_refused_at_subscribe_time():
    """``deltamq subscribe g t "'*'"`` subscribed to a tag named ``'*'`` (with its quotes),
    which matched nothing; a quoted tag is refused, naming the unquoted one."""
    from deltamq.filters import validate_expression

    for expression, tag in (("'*'", "*"), ('"paid"', "paid"), ("'a' || b", "a")):
        with pytest.raises(FilterSyntaxError, match=f"is quoted.*write {tag!r}"):
            validate_expression(expression)
    assert validate_expression("it's || b") == "it's || b"  # a quote inside a tag is its own
