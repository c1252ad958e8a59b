"""What would bite a data engineer in the first week: silent no-ops. Each test here failed
on the code before it (issue "Week one")."""

from __future__ import annotations

import pytest
from support.listeners import consume_all, read_log

from deltamq import Broker, ConsumeStatus, Message
from deltamq.cli import main
from deltamq.errors import (
    ConfigError,
    InProcessListener,
    InUse,
    SystemTopicError,
    UnknownGroup,
    WarehouseNotFound,
)
from deltamq.orchestration.runs import Settings, run_job


def test_a_group_whose_listener_only_one_process_has_is_loud_everywhere_else(broker, clock, capsys):
    """A callable listener lives in the process that registered it. Creating the group
    says so; a tick anywhere else (the CLI, an Airflow task) fails naming the group
    instead of reporting OK while the messages wait; the registering process delivers."""
    wh = str(broker.warehouse.location)
    broker.create_topic("orders", queues=1)

    def local_fn(messages, context):
        return ConsumeStatus.CONSUME_SUCCESS

    with pytest.warns(InProcessListener, match=r"of 'loc' .*only in this process.*package\.module:function"):
        broker.create_group("loc", local_fn, consume_from="FIRST_OFFSET")
    broker.subscribe("loc", "orders")
    broker.producer("shop").send(Message("orders", b"m0"))

    assert main(["group", "list", "--warehouse", wh]) == 0
    listed = capsys.readouterr().out
    assert "in-process:test_first_week:" in listed and "local_fn" in listed

    clock.advance(seconds=1)
    code = main(["tick", "--now", str(clock.now_ms()), "--warehouse", wh])
    err = capsys.readouterr().err
    assert code == 4, err
    assert "group 'loc' consumed nothing" in err and "this process does not have it" in err

    clock.advance(seconds=1)
    delivered = broker.tick(clock.now_ms()).delivered
    assert delivered is not None and delivered.consumed == 1  # here the callable exists
    broker.producer("shop").send(Message("orders", b"m1"))
    broker.close()  # the Airflow task takes the leases

    summary = run_job("tick", Settings(wh))
    assert summary["status"] == "failed" and "group 'loc'" in summary["summary"], summary


def test_opening_a_location_without_a_warehouse_refuses_and_creates_nothing(tmp_path, broker):
    """A typo'd location is not quietly made into a new, empty warehouse: Broker.open
    refuses it as the CLI does; Broker.init (or create=True) creates."""
    typo = tmp_path / "hw"
    with pytest.raises(WarehouseNotFound, match=r"no deltamq warehouse at .*hw.*Broker\.init"):
        Broker.open(typo, clock=broker.clock)
    assert not typo.exists()
    created = Broker.init(typo, clock=broker.clock, levels="1s 2s")
    assert created.warehouse.levels() == [(1, 1000), (2, 2000)]
    assert Broker.open(typo, clock=broker.clock).warehouse.levels() == [(1, 1000), (2, 2000)]
    assert Broker.init(typo, clock=broker.clock).warehouse.levels() == [(1, 1000), (2, 2000)]


def test_deleting_a_topic_with_subscribers_names_what_it_drops(warehouse_with, clock, capsys):
    wh = warehouse_with("orders", queues=2, group="billing", recorder=None)
    broker = wh.broker
    broker.create_topic("spare", queues=1)
    broker.producer("shop").send_batch([Message("orders", f"m{i}".encode()) for i in range(3)])
    # stored, not dispatched yet: counted as group delete counts them
    with pytest.raises(InUse, match=r"topic 'orders' .*billing \(3 not consumed\).*force=True"):
        broker.delete_topic("orders")
    broker.tick(clock.now_ms())
    with pytest.raises(InUse, match=r"topic 'orders' .*billing \(3 not consumed\).*force=True"):
        broker.delete_topic("orders")
    loc = str(broker.warehouse.location)
    assert main(["topic", "delete", "orders", "--warehouse", loc]) == 2
    err = capsys.readouterr().err
    assert "billing (3 not consumed)" in err and "deltamq unsubscribe GROUP orders" in err
    assert "orders" in broker.topics() and broker.subscriptions("billing")
    broker.delete_topic("spare")  # nobody subscribes: no questions
    assert main(["topic", "delete", "orders", "--force", "--warehouse", loc]) == 0
    assert "orders" not in broker.topics()
    assert [s.topic for s in broker.subscriptions("billing")] == ["%RETRY%billing"]


def test_deleting_a_group_with_messages_in_retry_or_in_flight_is_refused(warehouse_with, clock, capsys):
    wh = warehouse_with("orders", queues=1, group="failing", recorder="fail")
    broker = wh.broker
    wh.add_group(None, name="puller")
    wh.add_group("ok", name="idle", expression="nothing-has-this-tag")
    broker.producer("shop").send(Message("orders", b"m0", tags="t"))
    broker.tick(clock.now_ms())  # failing: the message goes to its retry, waiting 10 s
    with pytest.raises(InUse, match=r"'failing' still has 0 messages not consumed .* and 1 retries waiting"):
        broker.delete_group("failing")
    pulled = broker.pull_consumer("puller", "c1").pull(10)
    assert len(pulled) == 1
    with pytest.raises(
        InUse, match=r"'puller' still has 1 messages not consumed \(0 of them .*, 1 pulled and not acked"
    ):
        broker.delete_group("puller")
    loc = str(broker.warehouse.location)
    assert main(["group", "delete", "failing", "--warehouse", loc]) == 2
    assert "1 retries waiting for their delay level" in capsys.readouterr().err
    # once due again, a retry is a message not consumed in the group's retry topic, and said so
    broker.pull_consumer("puller", "c1").nack([m.receipt_handle for m in pulled], delay_level=1)
    broker.tick(clock.now_ms() + 2_000)  # the retry is promoted (level 1: 1 s), not pulled yet
    with pytest.raises(
        InUse, match=r"'puller' still has 1 messages not consumed \(1 of them retries due again"
    ):
        broker.delete_group("puller")
    broker.delete_group("idle")  # passed over (filtered out) everything: deleted
    broker.delete_group("failing", force=True)
    assert set(broker.groups()) == {"puller"}


def test_a_group_created_again_after_its_delete_starts_afresh(warehouse_with, clock):
    """A deleted group's dedup keys and pull state went with it: the group created again
    under the name from FIRST_OFFSET skipped every key the old one had consumed, and its
    pull clients went on from the old one's acks (its in-flight messages its retries)."""
    wh = warehouse_with("orders", queues=1, group="g", dedup_key="UNIQ_KEY")
    broker, log = wh.broker, wh.log
    broker.producer("shop").send_batch([Message("orders", f"m{i}".encode()) for i in range(3)])
    t = clock.now_ms()
    broker.tick(t)
    assert len(read_log(log)) == 3
    broker.delete_group("g")
    wh.add_group("ok", name="g", dedup_key="UNIQ_KEY")  # FIRST_OFFSET again
    assert broker.tick(t + 1).job("deliver").details["deduplicated"] == 0
    assert sorted(c["body"] for c in read_log(log)) == ["m0", "m0", "m1", "m1", "m2", "m2"]

    wh.add_group(None, name="puller")
    client = broker.pull_consumer("puller", "c1")
    pulled = client.pull(2)
    client.ack([pulled[0].receipt_handle])  # one acked, one in flight
    broker.delete_group("puller", force=True)
    wh.add_group(None, name="puller")
    client = broker.pull_consumer("puller", "c2")
    again = client.pull(10)
    assert sorted((m.topic, m.queue_offset) for m in again) == [("orders", 0), ("orders", 1), ("orders", 2)]
    client.ack([m.receipt_handle for m in again])
    clock.set(t + 3_600_000)  # the old client's in-flight message expired: not the new group's retry
    broker.tick(clock.now_ms())
    assert broker.sql("SELECT count(*) AS n FROM commit_log WHERE topic = '%RETRY%puller'").first()["n"] == 0


def test_a_group_created_again_does_not_take_the_retries_its_deleted_namesake_left(warehouse_with, clock):
    """The retry topic outlives a group deleted with force (RocketMQ's retry topics start
    at offset 0): the group created again under the name was handed the old one's
    retries. It starts past them."""
    wh = warehouse_with("orders", queues=1, group=None)
    broker = wh.broker
    wh.add_group(None, name="p")
    broker.producer("shop").send_batch([Message("orders", f"m{i}".encode()) for i in range(2)])
    t = clock.now_ms()
    broker.tick(t)
    client = broker.pull_consumer("p", "c1")
    pulled = client.pull(10, now=t)
    assert client.nack([m.receipt_handle for m in pulled], delay_level=1, now=t) == 2
    broker.tick(t + 2_000)  # level 1 (1 s) promoted into %RETRY%p, not pulled yet
    assert broker.sql("SELECT count(*) AS n FROM consume_queue WHERE topic = '%RETRY%p'").first()["n"] == 2
    broker.delete_group("p", force=True)
    wh.add_group(None, name="p", consume_from="LAST_OFFSET")  # nothing of the old one
    broker.producer("shop").send(Message("orders", b"new"))
    broker.tick(t + 3_000)
    client = broker.pull_consumer("p", "c2")
    got = client.pull(10, now=t + 3_000)
    assert [(m.topic, m.body) for m in got] == [("orders", b"new")]


def test_a_tick_while_a_group_subscribes_does_not_start_it_at_offset_0(warehouse_with, clock, tmp_path):
    """`subscribe` committed the subscription, then where the group starts: a tick between
    the two read a subscription without offsets and delivered the topic from offset 0 to a
    LAST_OFFSET group. Where it starts is written first."""
    from support.listeners import Recorder

    wh = warehouse_with("orders", queues=1, group=None)
    broker = wh.broker
    broker.producer("shop").send_batch([Message("orders", f"old{i}".encode()) for i in range(3)])
    broker.tick(clock.now_ms())
    log = tmp_path / "new.jsonl"
    broker.create_group("new", Recorder(log))  # LAST_OFFSET
    catalog = broker.catalog
    real = {name: getattr(catalog, name) for name in ("_init_offsets", "_subscribe")}
    calls: list[str] = []

    def after(name):
        def step(*args, **kwargs):
            real[name](*args, **kwargs)
            calls.append(name)
            if len(calls) == 1:
                broker.tick(clock.now_ms())  # a runner's tick between the two commits

        return step

    for name in real:
        setattr(catalog, name, after(name))
    try:
        broker.subscribe("new", "orders")
    finally:
        for name in real:
            delattr(catalog, name)
    broker.producer("shop").send(Message("orders", b"new"))
    broker.tick(clock.now_ms() + 1)
    assert [c["body"] for c in read_log(log)] == ["new"]


def test_deleting_a_group_deletes_it_from_every_table_naming_groups():
    from deltamq.catalog import GROUP_TABLES
    from deltamq.schemas import TABLES

    holding = {name for name, t in TABLES.items() if "consumer_group" in t.schema.fieldNames()}
    assert set(GROUP_TABLES) == holding
    assert GROUP_TABLES[-1] == "group_config"  # a delete stopped half-way leaves the group there


def test_a_typo_in_a_group_name_is_an_error_not_an_empty_answer(warehouse_with, capsys):
    wh = warehouse_with("orders", queues=1, group="fulfilment", recorder=None)
    loc = str(wh.broker.warehouse.location)
    for command in (["dlq", "resend", "--group", "nosuch"], ["dlq", "list", "--group", "fulfilmnt"]):
        assert main([*command, "--warehouse", loc]) == 2, command
        err = capsys.readouterr().err
        assert f"consumer group {command[-1]!r} does not exist (groups: fulfilment)" in err, err
    with pytest.raises(UnknownGroup, match="'fulfilmnt' does not exist"):
        wh.broker.dead_letters(group="fulfilmnt")
    assert main(["dlq", "list", "--group", "fulfilment", "--warehouse", loc]) == 0
    wh.broker.delete_group("fulfilment")  # its dead letters stay, and can still be listed
    assert wh.broker.dead_letters(group="fulfilment").count() == 0


def test_delays_are_refused_or_taken_alike_by_python_and_the_cli(warehouse_with, clock, capsys, tmp_path):
    from datetime import timedelta

    from deltamq.errors import InvalidTimer

    broker = warehouse_with("orders", queues=1).broker
    loc = str(broker.warehouse.location)
    with pytest.raises(InvalidTimer) as refused:
        broker.producer("p").send(Message("orders", b"x", delay=timedelta(seconds=-3)))
    assert "a delay of -3000 ms is not allowed: a delay is 0 or more milliseconds" in str(refused.value)
    assert main(["send", "orders", "x", "--delay-ms", "-3000", "--warehouse", loc]) == 2
    assert str(refused.value) in capsys.readouterr().err  # the same words
    assert main(["send", "orders", "past", "--deliver-at", "2020-01-01", "--warehouse", loc]) == 2
    err = capsys.readouterr().err
    assert (
        "--deliver-at 2020-01-01 00:00:00" in err and "in the past" in err and "leave --deliver-at out" in err
    )

    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"topic": "orders", "body": "a", "delay_ms": -3000}\n'
        '{"topic": "orders", "body": "b", "deliver_at": "2026-11-01"}\n'
    )
    assert main(["send", "--file", str(path), "--warehouse", loc]) == 6
    err = capsys.readouterr().err
    assert f"{path}:1: {refused.value}" in err and f"{path}:2: deliver_at 2026-11-01 00:00:00" in err
    broker.producer("p").send(Message("orders", b"zero", delay=timedelta(0)))
    assert main(["send", "orders", "zero-cli", "--delay-ms", "0", "--json", "--warehouse", loc]) == 0
    capsys.readouterr()
    rows = broker.sql(
        "SELECT body, properties['TIMER_DELIVER_MS'] AS timer FROM commit_log WHERE topic = 'orders'"
    ).collect()
    assert sorted((bytes(r["body"]), r["timer"]) for r in rows) == [(b"zero", None), (b"zero-cli", None)]


def fail_bad(messages, context):
    """Fails every message whose body starts with ``bad``."""
    if any(m.body.startswith(b"bad") for m in messages):
        return ConsumeStatus.RECONSUME_LATER
    return ConsumeStatus.CONSUME_SUCCESS


def test_sql_users_count_messages_as_sent_and_see_where_each_is(warehouse_with, clock):
    """commit_log holds the broker's copies too (a delayed message twice, a committed
    transaction twice); the views count what producers sent, typed as timestamps, and say
    per group where each message is."""
    from datetime import timedelta

    from deltamq import TxState

    wh = warehouse_with("orders", queues=1)
    broker = wh.broker
    broker.create_group(
        "billing", "test_first_week:fail_bad", consume_from="FIRST_OFFSET", max_reconsume_times=1
    )
    broker.subscribe("billing", "orders")
    broker.create_group(
        "policy",
        "test_first_week:fail_bad",
        consume_from="FIRST_OFFSET",
        retry_policy={"delays_ms": [60_000]},
    )
    broker.subscribe("policy", "orders", "bad")  # only "bad" is tagged bad
    wh.add_group(None, name="puller")
    p = broker.producer("shop")
    p.send_batch(
        [
            Message("orders", b"plain"),
            Message("orders", b"bad", tags="bad"),
            Message("orders", b"delayed", delay_level=2),  # 5 s
            Message("orders", b"timer", delay=timedelta(hours=1)),
        ]
    )
    for body, state in (
        (b"committed", TxState.COMMIT),
        (b"rolled", TxState.ROLLBACK),
        (b"open", TxState.UNKNOWN),
    ):
        p.send_in_transaction(Message("orders", body), lambda m, a, s=state: s)
    t0 = clock.now_ms()
    broker.tick(t0)
    assert len(broker.pull_consumer("puller", "c1").pull(1)) == 1  # "plain": in flight
    retrying = "SELECT g.state FROM message_groups g JOIN messages m ON m.msg_id = g.msg_id "
    retrying += "WHERE m.body = CAST('bad' AS BINARY) AND g.consumer_group = 'billing'"
    assert broker.sql(retrying).collect()[0]["state"] == "in retry"
    clock.advance(seconds=11)
    broker.tick(clock.now_ms())  # "delayed" and the retry of "bad" promoted
    broker.tick(clock.now_ms())  # ... and delivered: "bad" fails again, dead-lettered

    assert broker.sql("SELECT count(*) FROM commit_log WHERE topic = 'orders'").collect()[0][0] > 7
    rows = broker.sql(
        "SELECT body, state, transaction, delay_level, stored_at, deliver_at FROM messages"
    ).collect()
    state = {bytes(r["body"]).decode(): r["state"] for r in rows}
    assert state == {
        "plain": "visible",
        "bad": "visible",
        "delayed": "visible",
        "timer": "delayed",
        "committed": "visible",
        "rolled": "rolled back",
        "open": "prepared",
    }
    by_body = {bytes(r["body"]).decode(): r for r in rows}
    assert by_body["committed"]["transaction"] == "COMMIT" and by_body["delayed"]["delay_level"] == 2
    assert str(by_body["plain"]["stored_at"]).startswith("2026-01-01 ")  # a timestamp, in UTC
    assert by_body["timer"]["deliver_at"] == by_body["timer"]["stored_at"] + timedelta(hours=1)
    # a delay level's message falls due its level's delay after it was stored (level 2: 5 s)
    assert by_body["delayed"]["deliver_at"] == by_body["delayed"]["stored_at"] + timedelta(seconds=5)
    assert by_body["plain"]["deliver_at"] is None

    groups = broker.sql(
        "SELECT m.body, g.consumer_group, g.state, g.retries FROM message_groups g "
        "JOIN messages m ON m.msg_id = g.msg_id"
    ).collect()
    where = {(bytes(r["body"]).decode(), r["consumer_group"]): (r["state"], r["retries"]) for r in groups}
    assert where[("plain", "billing")] == ("consumed", 0)
    assert where[("bad", "billing")] == ("dead-lettered", 1)
    assert where[("delayed", "billing")] == ("consumed", 0)
    assert where[("timer", "billing")] == ("delayed", 0)
    assert where[("committed", "billing")] == ("consumed", 0)
    assert where[("rolled", "billing")] == ("rolled back", 0)
    assert where[("open", "billing")] == ("prepared", 0)
    assert where[("plain", "puller")] == ("in flight", 0)
    assert where[("bad", "puller")] == ("pending", 0)
    assert where[("bad", "policy")] == ("in retry", 1)  # a retry policy's timer, due in 60 s
    assert where[("plain", "policy")] == ("consumed", 0)  # passed over by its filter
    assert len(groups) == 21
    shown = {r[1] for r in broker.sql("SHOW TABLES").collect()}  # a query naming no table: all
    assert {"commit_log", "messages", "message_groups"} <= shown


@pytest.mark.spark
def test_tables_and_views_by_name_in_a_spark_session(warehouse_with, clock, capsys):
    """deltamq.register names the tables and views DATABASE.<name> in a session's catalog:
    a notebook or spark-sql queries them there, and they follow new commits."""
    import deltamq

    wh = warehouse_with("orders", queues=1)
    broker = wh.broker
    broker.producer("p").send_batch([Message("orders", b"a"), Message("orders", b"b", delay_level=1)])
    spark = broker.spark
    names = deltamq.register(spark, broker.warehouse.location, database="mq", config=broker.config)
    assert "mq.commit_log" in names and "mq.messages" in names and "mq.message_groups" in names
    count = "SELECT count(*) FROM mq.messages"
    assert spark.sql(count).collect()[0][0] == 2
    broker.producer("p").send(Message("orders", b"c"))
    assert spark.sql(count).collect()[0][0] == 3  # the tables are read at their newest version
    broker.tick(clock.now_ms() + 2000)
    states = spark.sql("SELECT state, count(*) AS n FROM mq.messages GROUP BY state").collect()
    assert {r["state"]: r["n"] for r in states} == {"visible": 3}
    assert spark.sql("SELECT count(*) FROM mq.message_groups").collect()[0][0] == 0  # no subscribers
    with pytest.raises(deltamq.errors.ConfigError, match="database='mq; DROP"):
        deltamq.register(spark, broker.warehouse.location, database="mq; DROP")
    again = deltamq.register(spark, broker.warehouse.location, database="mq", config=broker.config)
    assert again == names and spark.sql(count).collect()[0][0] == 3  # idempotent, data kept
    status = main(["catalog", "register", "--database", "ops", "--warehouse", str(broker.warehouse.location)])
    if broker.engine.mode == "embedded":  # its catalog would end with the command: refused, by name
        assert status == 2 and "nothing would remain. Give --remote" in capsys.readouterr().err
    elif broker.engine.flavor == "sail":  # a Sail server's catalog is the session's: refused too
        assert status == 2 and "Sail keeps its catalog per session" in capsys.readouterr().err
    else:  # Apache Spark's Connect server: its catalog outlives the command, for every session
        assert status == 0 and "registered 18 tables and views in ops" in capsys.readouterr().out


def test_output_says_what_happened_in_words(warehouse_with, clock, capsys, tmp_path):
    """The tick line shows what happened, not a row of zeros; a failed delivery's
    LAST_ERROR is in words; `msg show` cuts at a word; `status` lists the user's topics
    first; an SQL92 filter given as tags gets a hint; `send --file` names every bad line."""
    from deltamq.cli.format import shorten
    from deltamq.errors import FilterSyntaxError

    wh = warehouse_with("orders", queues=1, group="billing", recorder="fail")
    broker = wh.broker
    loc = str(broker.warehouse.location)
    idle = broker.tick(clock.now_ms()).summary()
    assert "nothing to do" in idle and "in=0" not in idle, idle
    broker.producer("p").send(Message("orders", b"x"))
    line = broker.tick(clock.now_ms()).summary()
    assert (
        "dispatch: OK in=1 out=1" in line and "more with nothing to do" in line and "in=0 out=0" not in line
    )
    error = broker.sql("SELECT properties['LAST_ERROR'] AS e FROM commit_log WHERE topic = '%RETRY%billing'")
    assert error.collect()[0]["e"] == "the listener asked for the messages again later (RECONSUME_LATER)"

    assert shorten("the listener asked for the messages again later", 30) == "the listener asked for the…"
    assert main(["status", "--warehouse", loc]) == 0
    out = capsys.readouterr().out
    assert out.index("orders") < out.index("%DLQ%billing") < out.index("%RETRY%billing")

    with pytest.raises(FilterSyntaxError, match=r"reads as an SQL92 filter: subscribe with type='SQL92'"):
        broker.subscribe("billing", "orders", "amount > 100")

    path = tmp_path / "m.jsonl"
    lines = ['{"topic": "orders", "body": "ok"}', "not json", '{"topic": "orders"}', '{"body": "b"}']
    path.write_text("\n".join(lines) + "\n")
    assert main(["send", "--file", str(path), "--warehouse", loc]) == 6
    err = capsys.readouterr().err
    assert "3 bad lines in" in err and f"{path}:2: not JSON" in err and f"{path}:3: missing" in err
    assert f"{path}:4: missing" in err and err.count("\n") == 1  # one line


def test_a_loop_waiting_for_another_runner_says_so_once_and_counts_no_ticks(broker, capsys):
    from deltamq.config import BrokerConfig
    from deltamq.tables.leases import JOB_KINDS, Leases, LeaseTerms

    Leases(broker.warehouse, holder="other-runner").acquire(JOB_KINDS, LeaseTerms.of(BrokerConfig()))
    loc = str(broker.warehouse.location)
    assert main(["tick", "--loop", "--interval", "0.5", "--for", "1.2", "--warehouse", loc]) == 0
    captured = capsys.readouterr()
    waits = [line for line in captured.out.splitlines() if line.startswith("waiting: ")]
    assert waits and all("held by other-runner" in w for w in waits)
    assert "held by other-runner" not in captured.err  # said once, on stdout
    assert captured.out.rstrip().endswith(
        f"stopped after 0 ticks, {len(waits)} times waited for another runner's lease"
    )


def test_an_s3_warehouse_without_credentials_is_one_line_of_error(tmp_path):
    """delta-rs logs each fallback of the AWS credential chain as a long WARN line; the
    CLI prints the one error line that says it (RUST_LOG=warn brings them back)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "RUST_LOG"}
    env |= {
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9",  # nothing listens there
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    command = [sys.executable, "-c", "from deltamq.cli import main; raise SystemExit(main())", "status"]
    command += ["-w", "s3://no-bucket/wh"]
    quiet = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 2 and quiet.stderr.count("\n") == 1, quiet.stderr
    assert quiet.stderr.startswith("deltamq: error: cannot list s3://no-bucket/wh: no credentials")
    loud = subprocess.run(
        command, env=env | {"RUST_LOG": "warn"}, capture_output=True, text=True, timeout=120
    )
    assert "WARN" in loud.stderr  # what the default leaves out


def test_a_plain_http_endpoint_without_allow_http_names_the_setting(tmp_path):
    """An http:// endpoint (MinIO, an emulator) without AWS_ALLOW_HTTP is refused by the
    client itself, before any request: the error said "the store refused the request"."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # never reached
    }
    command = [sys.executable, "-c", "from deltamq.cli import main; raise SystemExit(main())", "status"]
    done = subprocess.run(command + ["-w", "s3://b/wh"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "set AWS_ALLOW_HTTP=true" in done.stderr, done.stderr


def by_key_or_id(df):
    """A sink transform: the business key, or the message id for a message without one."""
    from pyspark.sql import functions as F

    return df.select(F.coalesce(F.col("keys"), F.col("msg_id")).alias("k"), "_deltamq_order")


def test_sink_messages_without_a_key_share_the_null_keys_row_as_documented(warehouse_with, clock, tmp_path):
    broker = warehouse_with("orders", queues=1, group="lake", recorder=None).broker
    broker.create_group("lake2", consume_from="FIRST_OFFSET")
    broker.subscribe("lake2", "orders")
    plain = broker.sink_to_table("lake", str(tmp_path / "plain"), ["keys"])
    keyed = broker.sink_to_table("lake2", str(tmp_path / "keyed"), ["k"], "test_first_week:by_key_or_id")
    broker.producer("p").send_batch(
        [Message("orders", b"a"), Message("orders", b"b"), Message("orders", b"c", keys="k1")]
    )
    broker.tick(clock.now_ms())
    assert sorted((r["keys"] or "-") for r in plain.read().collect()) == ["-", "k1"]  # a and b: one row
    assert keyed.read().count() == 3


def test_dropping_queues_that_hold_unconsumed_messages_is_refused(warehouse_with, clock, capsys):
    """``topic update --queues`` to fewer queues left the dropped queues' messages unread,
    silently (a walkthrough found it): refused while a group has not consumed them."""
    wh = warehouse_with("orders", queues=4, group="billing", recorder=None)
    broker = wh.broker
    broker.producer("shop").send_batch(
        [Message("orders", f"m{i}") for i in range(3)], selector=lambda n, m, arg: 1
    )
    with pytest.raises(InUse, match=r"queues 1\.\.3 hold messages .*billing \(3 not consumed\).*force=True"):
        broker.update_topic("orders", queues=1)  # stored, not dispatched yet: counted too
    broker.tick(clock.now_ms())
    loc = str(broker.warehouse.location)
    assert main(["topic", "update", "orders", "--queues", "1", "--warehouse", loc]) == 2
    err = capsys.readouterr().err
    assert "billing (3 not consumed)" in err
    assert broker.topic_queues("orders") == 4
    broker.update_topic("orders", queues=2)  # queues 2 and 3 hold nothing
    assert broker.topic_queues("orders") == 2
    assert main(["topic", "update", "orders", "--queues", "1", "--force", "--warehouse", loc]) == 0
    [row] = broker.sql("SELECT queues FROM topic_config WHERE topic = 'orders'").collect()
    assert row["queues"] == 1


def test_unsubscribing_stops_a_group_and_keeps_where_it_was(warehouse_with, clock, capsys):
    """topic delete's refusal says to unsubscribe first: there is a way to (Python and CLI).
    The group stops getting the topic; subscribing again goes on from its offsets."""
    wh = warehouse_with("orders", queues=1, group="billing")
    broker = wh.broker
    p = broker.producer("shop")
    p.send(Message("orders", b"before"))
    t = clock.now_ms()
    broker.tick(t)
    with pytest.raises(ConfigError, match=r"does not subscribe to topic 'nope'.*'orders'"):
        broker.unsubscribe("billing", "nope")
    with pytest.raises(SystemTopicError, match="own retry topic"):
        broker.unsubscribe("billing", "%RETRY%billing")
    loc = str(broker.warehouse.location)
    assert main(["unsubscribe", "billing", "orders", "--warehouse", loc]) == 0
    assert "unsubscribed billing from orders" in capsys.readouterr().out
    assert [s.topic for s in broker.subscriptions("billing")] == ["%RETRY%billing"]
    p.send(Message("orders", b"while away"))
    broker.tick(t + 1_000)
    assert [c["body"] for c in read_log(wh.log)] == ["before"]
    assert broker.subscribe("billing", "orders") is None  # nothing to replace
    broker.tick(t + 2_000)
    assert [c["body"] for c in read_log(wh.log)] == ["before", "while away"]
    # subscribing again replaces the subscription (one per topic, as in RocketMQ), and says so
    assert main(["subscribe", "billing", "orders", "paid", "--warehouse", loc]) == 0
    assert "(TAG paid); it replaces TAG *" in capsys.readouterr().out


def test_exist_ok_takes_a_topic_or_group_only_as_it_is(broker, tmp_path):
    """exist_ok=True with other settings than those stored kept the stored ones and said
    nothing (a sample run again with max_reconsume_times changed changed nothing): it is
    refused, naming each difference and how to make the change. The same settings again
    are still fine, and a refused callable is not registered."""
    from deltamq.errors import AlreadyExists

    broker.create_topic("jobs", queues=8)
    broker.create_topic("jobs", queues=8, exist_ok=True)
    with pytest.raises(AlreadyExists, match=r"queues: 8 stored, 3 given.*update_topic"):
        broker.create_topic("jobs", queues=3, exist_ok=True)
    assert broker.topics()["jobs"]["queues"] == 8
    broker.create_group("flaky", "support.listeners:always_fail", max_reconsume_times=2)
    broker.create_group("flaky", "support.listeners:always_fail", max_reconsume_times=2, exist_ok=True)
    differ = r"max_reconsume_times: 2 stored, 7 given.*update_group.*delete --force"
    with pytest.raises(AlreadyExists, match=differ):
        broker.create_group("flaky", "support.listeners:always_fail", max_reconsume_times=7, exist_ok=True)
    with pytest.raises(AlreadyExists, match=r"listener: 'support.listeners:always_fail' stored"):
        broker.create_group("flaky", consume_all, max_reconsume_times=2, exist_ok=True)
    assert "flaky" not in broker.catalog.listeners
    assert broker.groups()["flaky"].max_reconsume_times == 2


def test_exist_ok_compares_only_what_the_caller_gave(broker):
    """A default the caller did not choose is not a setting: a topic made with 8 queues,
    or made read-only by update_topic, is taken by create_topic(name, exist_ok=True), and
    a group by create_group(name, exist_ok=True) without its listener."""
    broker.create_topic("jobs", queues=8)
    broker.create_topic("jobs", exist_ok=True)
    broker.update_topic("jobs", perm="R")
    broker.create_topic("jobs", queues=8, exist_ok=True)
    broker.create_group("b", "support.listeners:always_fail", mode="BROADCASTING", instances=["a"])
    broker.create_group("b", mode="BROADCASTING", instances=["a"], exist_ok=True)
    broker.create_group("c", "support.listeners:always_fail")
    broker.create_group("c", exist_ok=True)


def test_a_group_is_updated_in_place_and_keeps_its_offsets(warehouse_with, clock, tmp_path, capsys):
    """Changing a setting meant delete and create, losing the offsets (exist_ok names the
    difference and now points here). update_group changes it in place (RocketMQ's
    updateSubGroup): what changed is returned, the offsets stay, and the next tick uses it."""
    from support.listeners import Recorder

    wh = warehouse_with("orders", queues=1, group="billing")
    broker = wh.broker
    p = broker.producer("shop")
    p.send(Message("orders", b"one"))
    t = clock.now_ms()
    broker.tick(t)
    offsets = "SELECT next_offset FROM offsets WHERE consumer_group = 'billing' AND topic = 'orders'"
    assert broker.sql(offsets).collect()[0]["next_offset"] == 1
    other = tmp_path / "other.jsonl"
    changed = broker.update_group("billing", Recorder(other), max_reconsume_times=2)
    assert changed["max_reconsume_times"] == (16, 2) and set(changed) == {"max_reconsume_times", "listener"}
    assert broker.groups()["billing"].max_reconsume_times == 2
    assert broker.sql(offsets).collect()[0]["next_offset"] == 1  # kept
    p.send(Message("orders", b"two"))
    broker.tick(t + 1_000)
    assert [c["body"] for c in read_log(wh.log)] == ["one"]
    assert [c["body"] for c in read_log(other)] == ["two"]
    assert broker.update_group("billing", max_reconsume_times=2) == {}  # the stored value: no change
    # an import path replaces the callable registered in this process
    broker.update_group("billing", "support.listeners:consume_all")
    p.send(Message("orders", b"three"))
    broker.tick(t + 2_000)
    assert [c["body"] for c in read_log(other)] == ["two"]
    # what cannot change in place, and bad values, are refused before anything is written
    with pytest.raises(ConfigError, match=r"orderly cannot be changed in place.*delete the group"):
        broker.catalog.update_group("billing", {"orderly": True})
    with pytest.raises(ConfigError, match=r"max_reconsume_times=-5 is not allowed"):
        broker.update_group("billing", max_reconsume_times=-5)
    with pytest.raises(ConfigError, match="needs what to change"):
        broker.update_group("billing")
    with pytest.raises(ConfigError, match="are for BROADCASTING groups"):
        broker.update_group("billing", instances=["a"])
    broker.create_group("pulled")
    with pytest.raises(ConfigError, match="pull group cannot become a push group in place"):
        broker.update_group("pulled", "support.listeners:consume_all")
    assert broker.groups()["billing"].max_reconsume_times == 2 and broker.groups()["pulled"].listener is None
    # the CLI
    loc = str(broker.warehouse.location)
    assert main(["group", "update", "billing", "--max-reconsume-times", "5", "--warehouse", loc]) == 0
    assert "billing: max_reconsume_times 2 -> 5" in capsys.readouterr().out
    assert main(["group", "update", "billing", "--mode", "BROADCASTING", "--warehouse", loc]) == 2
    assert "group update takes no --mode" in capsys.readouterr().err
    assert main(["group", "delete", "billing", "--max-reconsume-times", "5", "--warehouse", loc]) == 2


def test_a_broadcasting_group_gains_and_loses_instances_in_place(warehouse_with, clock, tmp_path):
    """An instance added starts where consume_from says (LAST_OFFSET: the head, not offset
    0); one removed stops receiving and its offsets go."""
    from support.listeners import Recorder

    wh = warehouse_with("news", queues=1)
    broker = wh.broker
    log = tmp_path / "b.jsonl"
    broker.create_group("fanout", Recorder(log), mode="BROADCASTING", instances=["a", "b"])
    broker.subscribe("fanout", "news")
    p = broker.producer("p")
    p.send(Message("news", b"old"))
    t = clock.now_ms()
    broker.tick(t)
    changed = broker.update_group("fanout", instances=["b", "c"])
    assert changed == {"instances": (("a", "b"), ("b", "c"))}
    rows = broker.sql("SELECT client_id, next_offset FROM offsets WHERE consumer_group = 'fanout'").collect()
    assert {r["client_id"]: r["next_offset"] for r in rows} == {"b": 1, "c": 1}
    p.send(Message("news", b"new"))
    broker.tick(t + 1_000)
    calls = sorted((c["instance"], c["body"]) for c in read_log(log))
    assert calls == [("a", "old"), ("b", "new"), ("b", "old"), ("c", "new")]


def _late_pass_row(broker, group: str, topic: str, client: str, at: int) -> None:
    """What a deliver pass that read the settings before a group's delete (or an
    instance's removal) commits after it: its attempt record inserts the row again."""
    from functools import partial

    from deltamq.tables.offsets import OffsetsMerge, source

    merge = OffsetsMerge(("next_offset", "attempts"), broker.clock.now_ms())
    merge.add(group, topic, 0, client, next_offset=at, attempts=1)
    rules = {"next_offset": source("next_offset"), "attempts": source("attempts")}
    broker.context.commit(partial(merge.execute, broker.warehouse, rules, rules), what="offsets")


def test_a_group_created_again_starts_afresh_over_rows_a_late_pass_left(warehouse_with, clock, tmp_path):
    """A pass that read a group's settings before its delete can write an offsets row back
    after it. The group created again under the name read that row as its position (it
    re-consumed from there instead of starting where consume_from says); the row goes now,
    and so does an added instance's."""
    from support.listeners import Recorder

    broker = warehouse_with("orders", queues=1).broker
    log = tmp_path / "g.jsonl"
    broker.create_group("billing", Recorder(log))
    broker.subscribe("billing", "orders")
    p = broker.producer("p")
    p.send_batch([Message("orders", f"m{i}") for i in range(3)])
    broker.tick(clock.now_ms())
    broker.delete_group("billing")
    _late_pass_row(broker, "billing", "orders", "", 1)
    broker.create_group("billing", Recorder(log))  # LAST_OFFSET: from the head
    broker.subscribe("billing", "orders")
    p.send(Message("orders", b"new"))
    broker.tick(clock.now_ms() + 1_000)
    assert [c["body"] for c in read_log(log)] == ["m0", "m1", "m2", "new"]
    # an instance removed, a late pass writing its row back, the instance added again
    blog = tmp_path / "b.jsonl"
    broker.create_group("fanout", Recorder(blog), mode="BROADCASTING", instances=["a", "b"])
    broker.subscribe("fanout", "orders")
    broker.update_group("fanout", instances=["a"])
    _late_pass_row(broker, "fanout", "orders", "b", 0)
    broker.update_group("fanout", instances=["a", "b"])
    rows = broker.sql("SELECT client_id, next_offset FROM offsets WHERE consumer_group = 'fanout'").collect()
    assert {r["client_id"]: r["next_offset"] for r in rows} == {"a": 4, "b": 4}


def test_a_dedup_group_created_again_ignores_keys_a_late_pass_recorded(warehouse_with, clock, tmp_path):
    """A late pass of a deleted de-duplicating group can record its consumed keys after
    the delete (a review's repro); the group created again under the name skipped a new
    message carrying such a key. Its leftover keys go when it is created."""
    from support.listeners import Recorder

    from deltamq import dedup

    broker = warehouse_with("orders", queues=1).broker
    log = tmp_path / "d.jsonl"
    broker.create_group("billing", Recorder(log), consume_from="FIRST_OFFSET", dedup_key="KEYS")
    broker.subscribe("billing", "orders")
    broker.delete_group("billing")
    dedup.record(
        broker.warehouse, [("billing", "order-1", "X")], clock.now_ms(), policy=broker.config.commit_policy
    )
    broker.create_group("billing", Recorder(log), consume_from="FIRST_OFFSET", dedup_key="KEYS")
    broker.subscribe("billing", "orders")
    broker.producer("p").send(Message("orders", b"new", keys="order-1"))
    result = broker.tick(clock.now_ms()).job("deliver").result
    assert (result.consumed, result.deduplicated) == (1, 0)


def test_adding_an_instance_leaves_the_others_where_they_are(warehouse_with, clock, tmp_path):
    """Instances with no offset row yet (the topic was empty when the group subscribed)
    read from 0; adding an instance placed them all at the head, so they missed what was
    dispatched before (a review's repro). Only the added instance is placed now."""
    from support.listeners import Recorder

    from deltamq.jobs import dispatch

    broker = warehouse_with("news", queues=1).broker
    log = tmp_path / "b.jsonl"
    broker.create_group("fanout", Recorder(log), mode="BROADCASTING", instances=["a", "b"])
    broker.subscribe("fanout", "news")  # empty: no rows
    broker.producer("p").send_batch([Message("news", f"m{i}") for i in range(3)])
    dispatch.run(broker.context, clock.now_ms())
    broker.update_group("fanout", instances=["a", "b", "c"])
    broker.tick(clock.now_ms() + 1_000)
    got = sorted((c["instance"], c["body"]) for c in read_log(log))
    assert got == sorted((i, f"m{n}") for i in ("a", "b") for n in range(3))


@pytest.mark.parametrize("later_ms", [0, 1_000], ids=["same-ms", "a-second-later"])
def test_a_pass_across_a_group_deleted_and_created_again_writes_nothing_of_the_old_one(
    warehouse_with, clock, tmp_path, monkeypatch, later_ms
):
    """A deliver pass read group "billing", its listener ran, and meanwhile the group was
    deleted and created again (FIRST_OFFSET). The pass then moved the new group's
    position to where the old one had got to, so the new group never saw those
    messages; it also sent the old group's failures into the new group's retry topic.
    Now the pass writes nothing of a group whose settings changed under it."""
    from support.listeners import Recorder

    from deltamq.jobs import deliver

    broker = warehouse_with("orders", queues=1).broker
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    broker.create_group("billing", Recorder(old, "fail"), consume_from="FIRST_OFFSET")
    broker.subscribe("billing", "orders")
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(4)])
    decide = deliver.decide

    def meanwhile(*args, **kwargs):  # after the listener's calls, before the pass writes
        broker.delete_group("billing", force=True)
        clock.advance(ms=later_ms)  # the new group is told apart by its creation time
        broker.create_group("billing", Recorder(new), consume_from="FIRST_OFFSET")
        broker.subscribe("billing", "orders")
        return decide(*args, **kwargs)

    monkeypatch.setattr(deliver, "decide", meanwhile)
    broker.tick(clock.now_ms())
    assert len(read_log(old)) == 4
    monkeypatch.setattr(deliver, "decide", decide)
    broker.tick(clock.now_ms() + 1_000)
    assert sorted(c["body"] for c in read_log(new)) == ["m0", "m1", "m2", "m3"]  # from the first
    retried = broker.sql("SELECT count(*) AS n FROM commit_log WHERE topic = '%RETRY%billing'").collect()
    assert retried[0]["n"] == 0
