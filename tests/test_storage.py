"""The storage seam (deltamq/storage.py): locations, options, and loud failures against a
real S3 API server (moto, its own process, real HTTP on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import _free_port, running, s3_server_command

from deltamq import Broker
from deltamq.config import BrokerConfig
from deltamq.errors import ConfigError, StorageError, UnsafeStorage, WarehouseNotFound
from deltamq.storage import Storage, describe_cause, is_transient, normalize_location


# --- locations and options (no server) --------------------------------------------------------
@pytest.mark.unit
def test_locations_are_normalised_and_bad_ones_named():
    assert normalize_location("s3a://bucket/wh/") == "s3://bucket/wh"
    assert normalize_location("file:///tmp/wh") == "/tmp/wh"
    assert normalize_location("gs://b/x") == "gs://b/x"
    assert (
        normalize_location("abfss://c@acct.dfs.core.windows.net/wh")
        == "abfss://c@acct.dfs.core.windows.net/wh"
    )
    with pytest.raises(ConfigError, match="scheme hdfs://.*use a local path, file://, s3://"):
        normalize_location("hdfs://nn/wh")
    with pytest.raises(ConfigError, match="names no bucket"):
        normalize_location("s3:///wh")
    with pytest.raises(ConfigError, match=r"glob characters"):
        normalize_location("/tmp/t[1]/wh")  # Sail reads [1] as a glob


@pytest.mark.unit
def test_options_come_from_the_environment_and_explicit_ones_win():
    env = {"AWS_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "env-key", "AZURE_X": "no", "HOME": "/root"}
    s = Storage("s3://bucket/wh", {"aws_access_key_id": "mine"}, env=env)
    opts = s.delta_rs_options()
    assert opts["AWS_ACCESS_KEY_ID"] == "mine" and opts["AWS_REGION"] == "eu-west-1"
    assert "AZURE_X" not in opts and "HOME" not in opts
    assert opts["AWS_CONDITIONAL_PUT"] == "etag"  # commits are put-if-absent
    # the embedded server inherits the process's environment: it gets the explicit ones
    assert s.engine_env() == {"AWS_ACCESS_KEY_ID": "mine", "AWS_CONDITIONAL_PUT": "etag"}
    assert "mine" not in repr(s) and "AWS_ACCESS_KEY_ID" in repr(s)
    assert "mine" not in repr(BrokerConfig(storage_options={"AWS_ACCESS_KEY_ID": "mine"}))
    assert Storage("/tmp/wh", env=env).delta_rs_options() == {}


@pytest.mark.unit
def test_a_store_error_hides_secrets_and_shows_where_it_looked():
    env = {
        "AWS_REGION": "eu-west-3",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
        "AWS_SESSION_TOKEN": "tok-123456",
    }
    s = Storage("s3://bucket/wh", env=env)
    echoed = RuntimeError("https://s3.eu-west-3.amazonaws.com/bucket: signed with s3cr3t-value, tok-123456")
    text = str(s.error("read", "s3://bucket/wh/offsets", echoed))
    assert "s3cr3t-value" not in text and "tok-123456" not in text and text.count("***") == 2
    assert "s3.eu-west-3.amazonaws.com" in text  # the region is no secret


@pytest.mark.unit
def test_classic_spark_gets_s3a_paths_and_conf_lines():
    s = Storage(
        "s3://bucket/wh",
        {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"},
        env={},
    )
    assert s.engine_path(s.join("commit_log"), True) == "s3a://bucket/wh/commit_log"
    assert s.engine_path(s.join("commit_log"), False) == "s3://bucket/wh/commit_log"
    conf = s.spark_conf()
    assert conf["spark.hadoop.fs.s3a.access.key"] == "k"
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"


@pytest.mark.unit
def test_a_store_without_conditional_writes_is_refused_naming_the_setting():
    with pytest.raises(UnsafeStorage, match="AWS_CONDITIONAL_PUT='disabled'.*If-None-Match"):
        Storage("s3://bucket/wh", {"AWS_CONDITIONAL_PUT": "disabled"}, env={})
    with pytest.raises(UnsafeStorage, match="AWS_CONDITIONAL_PUT"):
        Storage("s3://bucket/wh", env={"AWS_CONDITIONAL_PUT": "disabled"})
    with pytest.raises(ConfigError, match="storage option name"):
        Storage("s3://bucket/wh", {"bad name": "x"}, env={})


@pytest.mark.unit
def test_causes_are_told_apart():
    assert describe_cause(OSError("404 Not Found: <Code>NoSuchBucket</Code>")) == "the bucket does not exist"
    assert "credentials" in describe_cause(OSError("403 Forbidden <Code>InvalidAccessKeyId</Code>"))
    assert describe_cause(OSError("<Code>AccessDenied</Code>")) == "access denied"
    assert describe_cause(OSError("Connection refused (os error 111)")) == "the endpoint cannot be reached"
    assert describe_cause(OSError("HTTP status 403")) == "access denied"
    # a retry time holding the digits 403 is no refusal (seen once: "in 2.009354039s")
    refused = "Error performing GET in 2.009354039s, after 10 retries - tcp connect error: Connection refused"
    assert describe_cause(OSError(refused)) == "the endpoint cannot be reached"
    faults = (
        "Connection reset by peer (os error 104)",
        "Error after 3 retries: <Code>SlowDown</Code>",
        "Generic S3 error: HTTP status 500 Internal Server Error",
        "Server returned non-2xx status code: 503 Service Unavailable",
    )
    for transient in faults:
        assert is_transient(OSError(transient)) and "transient fault" in describe_cause(OSError(transient))
    # numbers that are not a status: an epoch, a process id, a task id, a bucket, a file name
    others = (
        refused,
        "retry in 2.500123s",
        "job 'dispatch' is held by host:503:ab12 until 2026-01-01 (epoch 502)",
        "Task 3 in stage 7.0 failed (TID 504)",
        "s3://acme-500/wh/commit_log/part-00000-500e-4b1c.snappy.parquet: No such file",
    )
    for other in others:
        assert not is_transient(OSError(other)), other
    named = StorageError("cannot read s3://b/x: the store failed the request (Connection reset)")
    assert not is_transient(named)  # named already: not retried again, not wrapped twice


# --- against the S3 API server ----------------------------------------------------------------
def _options(s3_server, **changes):
    return {**s3_server.options, **changes}


def _objects(s3_server, prefix: str) -> list[str]:
    """Keys under ``prefix`` in the test bucket (listed with the storage seam itself)."""
    storage = Storage(f"s3://{s3_server.bucket}", s3_server.options, env={})
    return [e.name for e in storage.list(f"s3://{s3_server.bucket}/{prefix}", recursive=True)]


def test_a_missing_bucket_is_named(s3_server):
    config = BrokerConfig(storage_options=s3_server.options)
    with pytest.raises(StorageError, match=r"s3://no-such-bucket-here/wh.*the bucket does not exist"):
        Broker.init("s3://no-such-bucket-here/wh", config=config)


def test_an_unreachable_endpoint_is_named(s3_server):
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    config = BrokerConfig(storage_options=_options(s3_server, AWS_ENDPOINT_URL=dead))
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"s3://deltamq-test/x/wh.*the endpoint cannot be reached"):
        Broker.init("s3://deltamq-test/x/wh", config=config)
    assert time.monotonic() - started < 60


def test_read_only_commands_on_a_uri_without_a_warehouse_create_nothing(s3_server, capsys):
    from deltamq.cli import main

    env_before = dict(os.environ)
    os.environ.update(s3_server.options)  # the CLI reads the standard AWS_* variables
    try:
        for command in (["status"], ["sql", "SELECT 1"], ["doctor"], ["dlq", "list"]):
            code = main([*command, "--warehouse", f"s3://{s3_server.bucket}/typo/wh"])
            err = capsys.readouterr().err
            assert code == 2 and "no deltamq warehouse at s3://deltamq-test/typo/wh" in err
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert _objects(s3_server, "typo") == []
    with pytest.raises(WarehouseNotFound, match="deltamq init"):
        Broker.open(
            f"s3://{s3_server.bucket}/typo/wh", config=BrokerConfig(storage_options=s3_server.options)
        )
    assert _objects(s3_server, "typo") == []


@pytest.fixture(scope="module")
def s3_with_auth():
    """A second S3 server that checks credentials and permissions (moto's IAM auth): one
    bucket, one user with no permissions; yields (endpoint, that user's keys)."""
    import boto3

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT="3")  # bucket, user and key unauthenticated
    command = s3_server_command(port)
    probe = lambda: urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read() is not None  # noqa: E731
    with running(command, env=env, ready=probe, what="moto_server with auth"):
        kw = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        kw |= {"aws_access_key_id": "bootstrap", "aws_secret_access_key": "bootstrap"}
        boto3.client("s3", **kw).create_bucket(Bucket="locked")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]


def _auth_options(endpoint: str, key: str, secret: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": key,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",
    }


def test_credentials_the_store_rejects_are_named(s3_with_auth):
    endpoint, _, _ = s3_with_auth
    config = BrokerConfig(storage_options=_auth_options(endpoint, "AKIANOSUCHKEY0000000", "wrong"))
    with pytest.raises(
        StorageError, match=r"s3://locked/wh.*no credentials, or credentials the store rejects"
    ):
        Broker.init("s3://locked/wh", config=config)


def test_access_denied_is_named(s3_with_auth):
    endpoint, key, secret = s3_with_auth
    config = BrokerConfig(storage_options=_auth_options(endpoint, key, secret))
    with pytest.raises(StorageError, match=r"s3://locked/wh.*access denied"):
        Broker.init("s3://locked/wh", config=config)


@pytest.mark.slow  # ~9 s: the credential chain's own time-outs
def test_no_credentials_at_all_is_named(s3_server):
    """No keys anywhere: the client falls back to the instance metadata service, which
    here is a closed port on 127.0.0.1 (never a real address)."""
    options = {k: v for k, v in s3_server.options.items() if not k.startswith(("AWS_ACCESS", "AWS_SECRET"))}
    options["AWS_METADATA_ENDPOINT"] = f"http://127.0.0.1:{_free_port()}"
    storage = Storage(f"s3://{s3_server.bucket}/wh", options, env={})
    with pytest.raises(StorageError, match=r"s3://deltamq-test/wh.*no credentials"):
        storage.check_reachable()


def _s3_client(s3_server):
    import boto3

    o = s3_server.options
    return boto3.client(
        "s3",
        endpoint_url=o["AWS_ENDPOINT_URL"],
        region_name=o["AWS_REGION"],
        aws_access_key_id=o["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=o["AWS_SECRET_ACCESS_KEY"],
    )


@pytest.mark.slow  # an S3 warehouse, a tick and doctor (~10 s)
@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_a_deleted_object_is_named_by_the_tick_and_doctor_and_nothing_is_lost(
    broker, clock, location, s3_server, env_listener_log, monkeypatch
):
    from support.listeners import read_log

    from deltamq import Message
    from deltamq.cli import main
    from deltamq.errors import TableDamaged

    broker.create_topic("orders", queues=2)
    broker.create_group("g", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    broker.producer("p").send_batch([Message("orders", f"m{i}") for i in range(4)])
    prefix = location.removeprefix(f"s3://{s3_server.bucket}/")
    [key] = [
        f"{prefix}/commit_log/{n}"
        for n in _objects(s3_server, f"{prefix}/commit_log")
        if n.endswith(".parquet")
    ]
    s3 = _s3_client(s3_server)
    body = s3.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    s3.delete_object(Bucket=s3_server.bucket, Key=key)  # a hand `aws s3 rm`
    uri = f"s3://{s3_server.bucket}/{key}"
    with pytest.raises(TableDamaged, match=f"table commit_log: {uri} is missing"):
        broker.tick(clock.now_ms())
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == 0
    for name, value in s3_server.options.items():
        monkeypatch.setenv(name, value)
    assert main(["doctor", "--warehouse", location]) == 1
    s3.put_object(Bucket=s3_server.bucket, Key=key, Body=body)  # restored from a backup
    assert main(["doctor", "--warehouse", location]) == 0
    broker.tick(clock.now_ms() + 1)
    assert sorted(c["body"] for c in read_log(env_listener_log)) == ["m0", "m1", "m2", "m3"]


_RACER = """
import json, sys, time
from deltamq import Broker, Message
wh, me, go, stop = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
import os
broker = Broker.open(wh)
time.sleep(max(0.0, go - time.time()))
groups, ids, i = [], [], 0
# ten rounds, then more until a conflict was met (either racer's stop file ends them): at most
# 40, and none begun past four minutes (a slow machine's rounds; the test asserts a conflict)
def more():
    return broker.engine.stats.conflicts_retried == 0 and i < 40 and time.time() < go + 240
while i < 10 or (more() and not os.path.exists(stop)):
    name = f"g-{me}-{i}"
    broker.create_group(name)  # a MERGE into group_config, which the other process MERGEs too
    groups.append(name)
    ids += broker.producer(me).send_batch([Message("orders", f"{me}-{i}-{j}") for j in range(5)])  # appends
    i += 1
print(json.dumps({"groups": groups, "ids": ids, "conflicts": broker.engine.stats.conflicts_retried}))
"""

_LITE_RACER = """
import json, sys, time
from deltamq.lite import Producer
from deltamq.message import Message
wh, go = sys.argv[1], float(sys.argv[2])
p = Producer(wh, "lite")
time.sleep(max(0.0, go - time.time()))
ids = []
for i in range(20):
    ids += p.send_batch([Message("orders", f"lite-{i}-{j}") for j in range(5)])
print(json.dumps({"ids": ids}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_two_writers_racing_on_s3_lose_no_commit(broker, location, store_env, tmp_path):
    """Two broker processes (each its own Sail server) MERGE into one S3 table and append
    to another while a Spark-free producer (delta-rs) appends too: every row is there,
    the Delta log has no gap, and the conflicts were detected and retried."""
    broker.create_topic("orders", queues=4)
    go, stop = time.time() + 8, tmp_path / "stop"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, location, me, str(go), str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=store_env,
        )
        for me in ("a", "b")
    ]
    lite = subprocess.Popen(
        [sys.executable, "-c", _LITE_RACER, location, str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=store_env,
    )
    reports = []
    for p in [*procs, lite]:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
        stop.touch()
    groups = {g for r in reports for g in r.get("groups", [])}
    ids = [i for r in reports for i in r["ids"]]
    assert {
        r["consumer_group"] for r in broker.sql("SELECT consumer_group FROM group_config").collect()
    } >= groups
    stored = [r["msg_id"] for r in broker.sql("SELECT msg_id FROM commit_log").collect()]
    assert sorted(stored) == sorted(ids)  # every append, once
    assert sum(r.get("conflicts", 0) for r in reports) > 0  # the races happened and were retried
    wh = broker.warehouse
    for table in ("group_config", "commit_log"):
        entries = wh.storage.list(wh.uri(table) + "/_delta_log")
        versions = sorted(int(e.name[:20]) for e in entries if e.name.endswith(".json"))
        assert versions == list(range(versions[0], versions[-1] + 1))  # no version lost or overwritten


def test_a_taken_version_is_tried_again_then_given_up_by_the_callers_rule():
    """``retry_commits`` runs an attempt again when its version was taken (a conditional
    commit), after a short and doubling wait, and gives up as the caller says once the
    policy's tries are spent; deltamq's other errors are not retried."""
    from deltamq.config import CommitPolicy
    from deltamq.errors import InvalidMessage, StorageError, VersionTaken
    from deltamq.storage import retry_commits

    calls = []

    def taken_twice() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise VersionTaken("version 7 was committed by another writer")
        return "done"

    assert retry_commits(taken_twice, CommitPolicy(5, 20), lambda e, _: e) == "done"
    # waits of a tenth of the back-off (2 ms here) at least, doubling with each try
    assert len(calls) == 3 and calls[1] - calls[0] >= 0.002 and calls[2] - calls[1] >= 0.004

    def always_taken() -> None:
        calls.append(0.0)
        raise VersionTaken("taken")

    calls.clear()
    with pytest.raises(StorageError, match="refused 3 times") as refused:
        retry_commits(
            always_taken, CommitPolicy(2, 1), lambda e, spent: StorageError(f"refused 3 times: {e}")
        )
    assert len(calls) == 3 and isinstance(refused.value.__cause__, VersionTaken)

    def bad() -> None:
        calls.append(0.0)
        raise InvalidMessage("no")

    calls.clear()
    with pytest.raises(InvalidMessage):
        retry_commits(bad, CommitPolicy(5, 1), lambda e, _: e)
    assert len(calls) == 1


def test_the_test_s3_server_lets_one_of_many_racing_conditional_puts_win(s3_server):
    """The tests' S3 server (tests/support/s3_server.py) does what S3 does with many PUTs
    of one key carrying ``If-None-Match: *`` at once: exactly one succeeds. (moto's own
    server, unlocked, sometimes let two succeed under load: a lost commit entry.)"""
    import threading

    from botocore.exceptions import ClientError

    s3 = _s3_client(s3_server)
    wins: list[int] = []
    for round_no in range(5):
        key = f"race-{round_no}/_delta_log/00000000000000000001.json"
        go = threading.Barrier(8)

        def put(me: int, key: str = key, go: threading.Barrier = go) -> None:
            go.wait()
            try:
                s3.put_object(Bucket=s3_server.bucket, Key=key, Body=f"{me}".encode(), IfNoneMatch="*")
                wins.append(me)
            except ClientError as e:
                assert e.response["Error"]["Code"] in ("PreconditionFailed", "ConditionalRequestConflict"), e

        threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stored = s3.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read().decode()
        assert len(wins) == round_no + 1 and stored == str(wins[-1]), (round_no, wins, stored)
