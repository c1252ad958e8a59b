"""Engine seam: embedded start/stop, several brokers per process, conflict retries."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from deltamq import Broker, BrokerConfig, Message
from deltamq.config import CommitPolicy
from deltamq.engine import Engine, is_commit_conflict
from deltamq.errors import CommitConflict, ConfigError, EngineError, StorageError


def test_two_brokers_in_one_process_share_the_server(tmp_path, clock):
    a = Broker.init(tmp_path / "a", clock=clock)
    b = Broker.init(tmp_path / "b", clock=clock)
    assert Engine.embedded_running()
    a.create_topic("t1")
    b.create_topic("t2")
    # each broker has its own session: its views name its own tables
    assert [r["topic"] for r in a.sql("SELECT topic FROM topic_config").collect()] == ["t1"]
    assert [r["topic"] for r in b.sql("SELECT topic FROM topic_config").collect()] == ["t2"]
    a.close()
    assert b.topics()["t2"]["queues"] == 4  # closing one broker leaves the other working
    b.close()


@pytest.mark.unit
def test_embedded_server_stops_and_restarts_cleanly(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, sys
        from deltamq import Broker
        from deltamq.engine import Engine
        b = Broker.init({str(tmp_path / "w")!r})
        b.create_topic("t")
        b.close()
        Engine.shutdown_embedded()
        assert not Engine.embedded_running()
        b2 = Broker.open({str(tmp_path / "w")!r})
        assert "t" in b2.topics()
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("OK")


@pytest.mark.unit
def test_remote_mode_needs_a_url(monkeypatch):
    monkeypatch.delenv("DELTAMQ_SPARK_REMOTE", raising=False)
    with pytest.raises(EngineError, match="DELTAMQ_SPARK_REMOTE"):
        Engine.open(BrokerConfig(engine="remote"))
    with pytest.raises(ConfigError, match="sc://"):
        BrokerConfig(remote="http://x")


def test_remote_mode_against_a_spark_connect_endpoint(tmp_path, broker):
    """The embedded server is a Spark Connect endpoint: use it as a 'remote'."""
    from deltamq.sail import EmbeddedServer as _EmbeddedServer

    url = _EmbeddedServer.url()
    b = Broker.init(tmp_path / "r", remote=url)
    assert b.engine.mode == "remote"
    b.create_topic("t")
    b.producer("p").send(Message("t", b"x"))
    assert b.sql("SELECT count(*) AS n FROM commit_log").collect()[0]["n"] == 1
    b.close()


@pytest.mark.unit
def test_an_unreachable_remote_endpoint_is_named_within_seconds(monkeypatch):
    """pyspark's client retries an endpoint that refuses connections for ~10 minutes
    without a word; connect() reaches it first and names it (`deltamq status --remote` at
    a closed port: the error after 22 s, where it sat silent before)."""
    import socket
    import time

    from deltamq.spark_connect import endpoint, reach

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    named = rf"cannot reach Spark Connect endpoint sc://127.0.0.1:{port} .*within 0.5 s"
    with pytest.raises(EngineError, match=named):
        reach(f"sc://127.0.0.1:{port}", 0.5)  # what connect() does first
    assert time.monotonic() - started < 5
    assert endpoint("sc://h") == ("h", 15002)
    assert endpoint("sc://[::1]:9/;token=x") == ("::1", 9)
    with pytest.raises(EngineError, match="port 'x1'"):
        endpoint("sc://h:x1")


def test_config_from_env():
    cfg = BrokerConfig.from_env({"DELTAMQ_COMMIT_RETRIES": "3", "DELTAMQ_SPARK_REMOTE": "sc://h:1"})
    assert cfg.commit_retries == 3 and cfg.engine == "remote" and cfg.remote == "sc://h:1"
    with pytest.raises(ConfigError, match="not an integer"):
        BrokerConfig.from_env({"DELTAMQ_COMMIT_RETRIES": "many"})
    with pytest.raises(ConfigError, match="engine='sparkly'"):
        BrokerConfig(engine="sparkly")
    with pytest.raises(ConfigError, match="bad duration"):
        BrokerConfig(delay_levels="1s 5x")


def test_commit_retries_replan_and_are_counted(broker):
    engine = broker.engine
    calls = []

    def attempt():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("Failed to commit transaction: version 7 already exists")
        return "done"

    before = engine.stats.conflicts_retried
    assert engine.commit(attempt, what="unit", policy=CommitPolicy(retries=8, backoff_ms=1)) == "done"
    assert len(calls) == 3
    assert engine.stats.conflicts_retried - before == 2


def test_commit_gives_up_after_bounded_retries(tmp_path, clock):
    b = Broker.init(tmp_path / "w", clock=clock, config=BrokerConfig(commit_retries=2, commit_backoff_ms=1))

    def always():
        raise RuntimeError("(io.delta.exceptions.ConcurrentAppendException) files were added")

    with pytest.raises(CommitConflict, match="after 2 retries"):
        b.context.commit(always, what="unit")
    with pytest.raises(ValueError):  # other errors are not retried
        b.context.commit(lambda: (_ for _ in ()).throw(ValueError("boom")), what="unit")
    b.close()


def test_store_faults_are_retried_and_then_named(tmp_path, clock):
    """A transient fault of the store (a reset connection, 503 SlowDown, a 500) re-runs the
    attempt like a conflict; one that outlasts the retries is a StorageError naming the
    warehouse and the cause. (The proxy tests make the store fail for real:
    tests/test_story_faults.py.)"""
    b = Broker.init(tmp_path / "w", clock=clock, config=BrokerConfig(commit_retries=2, commit_backoff_ms=1))
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("Connection reset by peer (os error 104)")
        return "done"

    before = b.engine.stats.store_faults_retried
    assert b.context.commit(flaky, what="unit") == "done"
    assert b.engine.stats.store_faults_retried - before == 2

    def down():
        raise RuntimeError("Generic S3 error: Error after 10 retries: HTTP status 503 <Code>SlowDown</Code>")

    with pytest.raises(StorageError, match=r"cannot commit unit to the warehouse at .*/w: the store failed"):
        b.context.commit(down, what="unit")
    b.close()


def test_real_conflicts_between_two_writers_are_retried(tmp_path, clock):
    """Two sessions MERGE into one row at once; losers re-plan; no increment is lost."""
    import threading

    brokers = [Broker.init(tmp_path / "w", clock=clock) for _ in range(2)]
    brokers[0].create_topic("t", queues=1)
    n = 8

    def work(b):
        ref = b.warehouse.ref("topic_config")
        for _ in range(n):

            def attempt():
                # Self-contained: the new value is computed inside the MERGE's own snapshot.
                b.engine.execute(
                    f"MERGE INTO {ref} t USING (SELECT 't' AS topic) s ON t.topic = s.topic "
                    "WHEN MATCHED THEN UPDATE SET t.queues = t.queues + 1"
                )

            b.context.commit(attempt, what="cas")

    threads = [threading.Thread(target=work, args=(b,)) for b in brokers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert brokers[0].topics()["t"]["queues"] == 1 + 2 * n
    assert sum(b.engine.stats.conflicts_retried for b in brokers) > 0
    for b in brokers:
        b.close()


@pytest.mark.unit
def test_conflicts_are_recognised_by_type_on_every_engine():
    from pyspark.errors.exceptions.connect import UnknownException

    # Sail: by its text only
    assert is_commit_conflict(RuntimeError("Failed to commit transaction"))
    # classic PySpark: a py4j error naming Delta's class
    assert is_commit_conflict(Exception("io.delta.exceptions.ConcurrentAppendException: x"))
    # Spark Connect: the Java class as the reason, Delta's error class as the condition
    connect = UnknownException(
        "[DELTA_CONCURRENT_DELETE_READ] files were deleted",
        reason="io.delta.exceptions.ConcurrentDeleteReadException",
    )
    assert is_commit_conflict(connect)
    by_condition = UnknownException(
        "files were added", errorClass="DELTA_CONCURRENT_APPEND.WITH_PARTITION_HINT", messageParameters={}
    )
    assert is_commit_conflict(by_condition)
    # looked for through causes
    wrapped = RuntimeError("deliver failed")
    wrapped.__cause__ = connect
    assert is_commit_conflict(wrapped)
    assert not is_commit_conflict(ValueError("bad value"))
    assert not is_commit_conflict(
        UnknownException("(java.io.IOException) No space left", reason="java.io.IOException")
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.slow  # restarts the embedded server (~11 s)
def test_an_oversized_embedded_server_is_replaced_between_ticks(tmp_path, clock):
    """Sail frees memory only with its process (docs/engines.md): a tick that finds the
    server over embedded_max_rss_mb replaces it, and every broker carries on."""
    from support.listeners import Recorder, read_log

    from deltamq.sail import EmbeddedServer as _EmbeddedServer

    log = tmp_path / "calls.jsonl"
    small = Broker.init(tmp_path / "w", clock=clock, config=BrokerConfig(embedded_max_rss_mb=1))
    other = Broker.init(tmp_path / "o", clock=clock)  # default limit, same server
    other.create_topic("o")
    small.create_topic("t", queues=2)
    small.create_group("g", Recorder(log), consume_from="FIRST_OFFSET")
    small.subscribe("g", "t")
    small.create_group("puller", None, consume_from="FIRST_OFFSET")
    small.subscribe("puller", "t")
    producer = small.producer("p")
    before = Engine.embedded_recycles()
    pids = set()
    for i in range(3):
        pids.add(_EmbeddedServer._proc.pid)
        producer.send(Message("t", f"m{i}".encode()))
        small.tick(clock.now_ms())  # replaces the server first (it is over 1 MiB), then runs
        clock.advance(seconds=1)
    pids.add(_EmbeddedServer._proc.pid)
    assert Engine.embedded_recycles() - before == 3
    assert len(pids) == 4 and not any(_alive(p) for p in pids - {_EmbeddedServer._proc.pid})
    assert sorted(c["body"] for c in read_log(log)) == ["m0", "m1", "m2"]  # listener ran in the new server
    pulled = small.pull_consumer("puller", "c1").pull(10)  # a pull replaces it too
    assert sorted(m.body for m in pulled) == [b"m0", b"m1", b"m2"]
    assert Engine.embedded_recycles() - before == 4
    assert small.sql("SELECT count(*) AS n FROM commit_log").collect()[0]["n"] == 3
    assert other.topics()["o"]["queues"] == 4  # the other broker reconnected on its own
    # code that finds the session itself (Great Expectations) gets a live one
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    assert ConnectSession.builder.getOrCreate().sql("SELECT 1 AS x").collect()[0]["x"] == 1
    assert not other.engine.recycle_if_large(other.config.embedded_max_rss_mb)  # 4096 MiB: nothing to do
    with pytest.raises(ConfigError, match="embedded_max_rss_mb=-1"):
        BrokerConfig(embedded_max_rss_mb=-1)
    small.close()
    other.close()


@pytest.mark.unit
def test_the_embedded_server_dies_with_its_process_and_is_restarted_if_it_dies_alone(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        from deltamq import Broker
        from deltamq.sail import EmbeddedServer as _EmbeddedServer
        b = Broker.init({str(tmp_path / "w")!r})
        b.create_topic("t")
        first = _EmbeddedServer._proc.pid
        os.kill(first, signal.SIGKILL)  # the server dies on its own (e.g. the OOM killer)
        _EmbeddedServer._proc.wait()
        assert "t" in b.topics()  # the next use starts another and reconnects
        print(first, _EmbeddedServer._proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # now the broker's process dies
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    first, second = map(int, out.stdout.split())
    assert first != second and not _alive(first)
    import time

    deadline = time.monotonic() + 10
    while _alive(second) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(second), "the server outlived the process that started it"


def test_closing_one_connect_session_leaves_the_others_release_pool_up(broker):
    """A Connect client's close (a session the garbage collector finalises closes its
    client) used to shut down the result-release pool every session of the process
    shares, under a live query of another session: deltamq keeps the pool up."""
    from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as It

    from deltamq import sail

    other = sail.embedded_session()
    pool = It._get_or_create_release_thread_pool()
    other.client.close()
    assert It._release_thread_pool_instance is pool
    assert pool.submit(lambda: 42).result() == 42
    assert broker.sql("SELECT 1 AS x").collect()[0]["x"] == 1


@pytest.mark.unit
def test_a_late_result_release_after_a_close_raises_nothing():
    """An unfinished Connect result iterator finalised while a session close has shut the
    shared release pool down (docs/engines.md): pyspark's own finaliser raises, deltamq's
    drops the error, so a garbage collection can never raise inside unrelated code."""
    from concurrent.futures import ThreadPoolExecutor

    from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as It
    from pyspark.sql.connect.proto import base_pb2 as pb2

    from deltamq.spark_connect import _quiet_late_releases

    _quiet_late_releases()

    class Stub:
        def ExecutePlan(self, request, metadata=None):  # noqa: N802 - the gRPC stub's name
            return iter(())

    it = It(pb2.ExecutePlanRequest(session_id="s"), Stub(), lambda: iter(()), [])
    closed = ThreadPoolExecutor(max_workers=1)
    closed.shutdown()
    saved = It._release_thread_pool_instance
    It._release_thread_pool_instance = closed
    try:
        with pytest.raises(RuntimeError, match="after shutdown"):
            it.close()  # what pyspark's __del__ calls
        it._result_complete = False
        it.__del__()  # deltamq's: nothing raised
    finally:
        It._release_thread_pool_instance = saved


def test_the_embedded_server_reports_its_own_peak_memory(broker):
    """bench/run.py's "peak Sail server RSS" row: the server process's own high-water
    mark, at least what it holds now, and not this process's."""
    import os

    from deltamq.sail import EmbeddedServer, resident_mb

    broker.sql("SELECT count(*) FROM commit_log").collect()  # the server is up
    now, peak = EmbeddedServer.rss_mb(), EmbeddedServer.peak_rss_mb()
    assert now is not None and peak is not None and peak >= now > 0
    assert EmbeddedServer._proc is not None and EmbeddedServer._proc.pid != os.getpid()
    assert resident_mb("self", "VmHWM") >= (resident_mb("self") or 0) > 0
    assert resident_mb(2**22 + 12345) is None  # no such process: unknown, not an error
