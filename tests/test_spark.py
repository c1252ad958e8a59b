"""Apache Spark with Delta Lake, deployed the three ways users deploy it (`pytest --engine
spark`): an in-process classic session built with ``configure_spark_with_delta_pip``,
``spark-submit`` of deltamq's entry (classic, and against Spark's own Connect server), and
Spark's Connect server itself (the `broker` fixture under --engine spark). The S3 refusal
is docs/engines.md's "S3 commit safety on Apache Spark"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENGINE, SPARK_ENGINES, broker_config
from support.listeners import read_log

from deltamq import Broker, Message
from deltamq.errors import UnsafeStorage

TESTS = Path(__file__).parent

pytestmark = [
    pytest.mark.spark,
    pytest.mark.skipif(ENGINE not in SPARK_ENGINES, reason="needs Apache Spark: pytest --engine spark"),
]


def _env(**extra: str) -> dict[str, str]:
    from deltamq.spark_setup import child_env

    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), env.get("PYTHONPATH", "")] if p)
    env.pop("DELTAMQ_SPARK_REMOTE", None)
    env.update(extra)
    return env


def test_brokers_over_one_classic_session_keep_their_own_views_and_utc(tmp_path):
    log = tmp_path / "listener.jsonl"
    out = subprocess.run(
        [sys.executable, str(TESTS / "support" / "spark_classic_job.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=_env(DELTAMQ_TEST_LOG=str(log)),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["stored"] == [2, 3] and seen["consumed"] == [2, 3]  # no view of one broker leaks to the other
    assert seen["tz"] == ["UTC", "UTC"] and seen["caller_tz"] == "America/New_York"
    assert seen["day"] == "1970-01-01 00:00:00"
    assert seen["modes"] == ["classic/spark", "classic/spark"]
    # the listener, given as an import path, ran in Spark's Python workers
    assert sorted(c["body"] for c in read_log(log)) == ["w0-m0", "w0-m1", "w1-m0", "w1-m1", "w1-m2"]


def _submit(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    import deltamq.orchestration.submit as entry
    from deltamq.spark_setup import spark_bin

    return subprocess.run(
        [spark_bin("spark-submit"), *args[:-1], entry.__file__, *args[-1].split()],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip


def test_spark_submit_runs_a_tick_classic_and_over_spark_connect(broker, clock, tmp_path, cluster):
    from deltamq.spark_setup import python_conf, submit_args

    broker.create_topic("t", queues=2)
    log = tmp_path / "listener.jsonl"
    broker.create_group("g", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "t")
    broker.producer("p").send_batch([Message("t", f"a{i}".encode()) for i in range(3)])
    wh = broker.warehouse.location
    env = _env(DELTAMQ_TEST_LOG=str(log))
    conf: list[str] = []
    for key, value in python_conf(pythonpath=env["PYTHONPATH"]).items():
        conf += ["--conf", f"{key}={value}"]
    # classic: the README's --packages/--conf lines, a local master
    classic = _submit(
        "--master",
        "local[2]",
        *submit_args(),
        *conf,
        f"tick --warehouse {wh} --now {clock.now_ms()}",
        env=env,
    )
    assert classic.returncode == 0, classic.stderr[-4000:]
    assert "dispatch: OK in=3 out=3" in classic.stdout and "deliver: OK" in classic.stdout
    assert sorted(c["body"] for c in read_log(log)) == ["a0", "a1", "a2"]
    # over Spark's own Connect server (the one the broker fixture uses)
    broker.producer("p").send_batch([Message("t", f"b{i}".encode()) for i in range(2)])
    clock.advance(seconds=1)
    remote = _submit(
        "--remote", cluster.url, "--conf", "spark.api.mode=connect",
        f"dispatch --warehouse {wh} --now {clock.now_ms()}", env=env,
    )  # fmt: skip
    assert remote.returncode == 0, remote.stderr[-4000:]
    assert "dispatch: OK in=2 out=2" in remote.stdout
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == 5


def test_an_s3_warehouse_is_refused_on_apache_spark_naming_the_way_out(s3_location, request):
    with pytest.raises(UnsafeStorage) as e:
        Broker.init(s3_location, config=broker_config("s3", request))
    text = str(e.value)
    assert s3_location in text and "S3SingleDriverLogStore" in text and "engine='embedded'" in text


def test_the_engine_reports_apache_spark_and_works_in_utc(broker):
    assert broker.engine.flavor == "spark" and broker.engine.hadoop_paths
    assert broker.spark.conf.get("spark.sql.session.timeZone") == "UTC"
    assert broker.config.promote_ahead_ms is None and broker.context.promote_ahead_ms == 8_000
    assert (
        broker.sql("SELECT CAST(from_unixtime(0) AS STRING) AS d").collect()[0]["d"] == "1970-01-01 00:00:00"
    )


def test_a_real_delta_conflict_over_spark_connect_is_retried(broker):
    """Two sessions MERGE one row at once on Spark's Connect server: Delta's own conflict
    exceptions are recognised (engine.is_commit_conflict) and re-planned; nothing is lost."""
    import threading

    from deltamq.config import BrokerConfig

    broker.create_topic("t", queues=1)
    other = Broker.open(broker.warehouse.location, config=broker.config, clock=broker.clock)
    assert isinstance(other.config, BrokerConfig)
    n = 4

    def work(b):
        ref = b.warehouse.ref("topic_config")
        for _ in range(n):
            b.context.commit(
                lambda b=b: b.engine.execute(
                    f"MERGE INTO {ref} t USING (SELECT 't' AS topic) s ON t.topic = s.topic "
                    "WHEN MATCHED THEN UPDATE SET t.queues = t.queues + 1"
                ),
                what="cas",
            )

    threads = [threading.Thread(target=work, args=(b,)) for b in (broker, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert broker.topics()["t"]["queues"] == 1 + 2 * n
    assert broker.engine.stats.conflicts_retried + other.engine.stats.conflicts_retried > 0
