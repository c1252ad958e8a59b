"""Shared fixtures: one embedded engine for the whole session, a fresh warehouse per test
(``broker``; ``warehouse_with`` adds a topic and a recorded consumer group to it).

Every SQL statement the engine runs during the session is recorded; the Spark guard
test (moved to the end of the run) parses each with Apache Spark's own parser.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("RUST_LOG", "error")

from support.helpers import WarehouseSetup  # noqa: E402

from deltamq import Broker, FakeClock  # noqa: E402
from deltamq.engine import SQL_RECORDERS  # noqa: E402

RECORDED_SQL: set[str] = set()

# Tests marked `plan` can run on a classic Apache Spark session instead (the guard
# runs them that way in a subprocess): DELTAMQ_TEST_ENGINE=classic.
TEST_ENGINE = os.environ.get("DELTAMQ_TEST_ENGINE", "embedded")


# `pytest --engine remote|spark|spark-cluster`: the engine-facing tests run against a Spark
# Connect endpoint the `cluster` fixture starts: Sail in local-cluster mode (driver and
# workers exchanging plans and data over RPC), Apache Spark's own Connect server with
# Delta (local[2]), or that server on a standalone Spark cluster (a master, two workers,
# executors in their own JVMs). CI runs the main story on each, and more on `spark`.
ENGINE = "embedded"
REMOTE_ENGINES = ("remote", "spark", "spark-cluster")
SPARK_ENGINES = ("spark", "spark-cluster")
SPARK_S3_REFUSED = "Apache Spark cannot write a deltamq warehouse on S3 safely (docs/engines.md): refused"


def pytest_addoption(parser):
    parser.addoption(
        "--engine",
        choices=("embedded", *REMOTE_ENGINES),
        default="embedded",
        help="embedded: the broker's own Sail server; remote: a Sail local-cluster Spark Connect server; "
        "spark: Apache Spark's Spark Connect server with Delta; spark-cluster: the same on a standalone "
        "Spark cluster",
    )


def pytest_configure(config):
    global ENGINE
    ENGINE = config.getoption("--engine")
    SQL_RECORDERS.append(RECORDED_SQL.add)


def pytest_generate_tests(metafunc):
    # A test marked `story` (the main story: normal, delayed, timer, retried, transactional,
    # pull, orderly, sinks, ...) runs on a local warehouse and on one in S3 (moto).
    # `@pytest.mark.story(s3="slow")`: the S3 run is long and goes to the slow tier.
    story = metafunc.definition.get_closest_marker("story")
    if story and "store" in metafunc.fixturenames:
        s3 = pytest.param("s3", marks=pytest.mark.slow) if story.kwargs.get("s3") == "slow" else "s3"
        if ENGINE in SPARK_ENGINES:
            s3 = pytest.param("s3", marks=pytest.mark.skip(reason=SPARK_S3_REFUSED))
        metafunc.parametrize("store", ["local", s3], indirect=True)


def recorded_sql_file(config) -> Path | None:
    """Where each run adds the statements it recorded, so the Spark guard (slow tier) parses
    what the default tier issued too; None without pytest's cache (a nested run)."""
    cache = getattr(config, "cache", None)
    return cache.mkdir("deltamq") / "recorded-sql.jsonl" if cache is not None else None


def pytest_sessionfinish(session, exitstatus):
    path = recorded_sql_file(session.config)
    if path is not None and RECORDED_SQL:
        import json

        with open(path, "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(s) + "\n" for s in sorted(RECORDED_SQL))


def pytest_collection_modifyitems(config, items):
    # `@pytest.mark.story(cluster_skip="why")`: a story test an engine gap keeps off the
    # cluster run (each recorded in docs/engines.md)
    for item in items:
        story = item.get_closest_marker("story")
        if ENGINE in REMOTE_ENGINES and story and story.kwargs.get("cluster_skip"):
            item.add_marker(pytest.mark.skip(reason=story.kwargs["cluster_skip"]))
        # `@pytest.mark.embedded_only("why")`: what only the embedded engine does
        only = item.get_closest_marker("embedded_only")
        if ENGINE != "embedded" and only:
            item.add_marker(pytest.mark.skip(reason=f"embedded engine only: {only.args[0]}"))
        # `@pytest.mark.sail_only("why")`: a Sail behaviour Apache Spark does not share
        sail = item.get_closest_marker("sail_only")
        if ENGINE in SPARK_ENGINES and sail:
            item.add_marker(pytest.mark.skip(reason=f"Sail only: {sail.args[0]}"))
    # The guard parses what the rest of the suite issued: run it last.
    items.sort(key=lambda item: 1 if item.get_closest_marker("spark_guard") else 0)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_engine(request, monkeypatch):
    """A test marked ``unit`` runs without any engine (``pytest -m unit``, in seconds):
    starting one (embedded Sail, a Spark Connect session, a classic session) fails it,
    so the marker cannot drift from the truth."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is marked unit but started an engine")

    from deltamq import engine, sail, spark_connect, spark_setup

    monkeypatch.setattr(sail, "embedded_session", refuse)
    monkeypatch.setattr(spark_connect, "connect", refuse)
    monkeypatch.setattr(engine, "connect", refuse)
    monkeypatch.setattr(spark_setup, "classic_session", refuse)


@pytest.fixture(scope="session", autouse=True)
def _remote_for_subprocesses(request):
    """Under a remote engine, processes the tests start (the CLI, crash harness, tick loops)
    reach the same endpoint: DELTAMQ_SPARK_REMOTE, as a user's deployment sets it."""
    if ENGINE not in REMOTE_ENGINES:
        yield
        return
    url = request.getfixturevalue("cluster").url
    old = os.environ.get("DELTAMQ_SPARK_REMOTE")
    os.environ["DELTAMQ_SPARK_REMOTE"] = url
    yield
    if old is None:
        os.environ.pop("DELTAMQ_SPARK_REMOTE", None)
    else:
        os.environ["DELTAMQ_SPARK_REMOTE"] = old


@pytest.fixture
def spark(_spark_source):
    """Spark for plan tests: embedded Sail, or classic local Spark (TEST_ENGINE)."""
    return _spark_source.spark


@pytest.fixture(scope="session")
def _spark_source(request):
    """An object whose ``spark`` is the session to use: an embedded Engine reconnects
    when a test replaced the embedded server."""
    if TEST_ENGINE == "classic":
        from pyspark.sql import SparkSession

        session = (
            SparkSession.builder.master("local[1]")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        yield SimpleNamespace(spark=session)
        session.stop()
        return
    from deltamq.config import BrokerConfig
    from deltamq.engine import Engine

    if ENGINE in REMOTE_ENGINES:
        yield Engine.open(BrokerConfig(engine="remote", remote=request.getfixturevalue("cluster").url))
        return
    yield Engine.open(BrokerConfig())


@pytest.fixture(autouse=True)
def _arrow_pool_put_back():
    """A pull client switches its process's Arrow pool (deltamq/arrow_memory.py):
    each test's is put back, so the broker code of later tests in this worker runs on the
    pool it runs on in production."""
    import pyarrow as pa

    before = pa.default_memory_pool()
    yield
    pa.set_memory_pool(before)


@pytest.fixture(autouse=True)
def _stop_listener_workers():
    """Each test's listeners get their own worker processes; stop them after the test."""
    yield
    from deltamq.jobs import listener_worker

    listener_worker.shutdown()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_767_225_600_000)  # 2026-01-01 00:00:00 UTC


@pytest.fixture
def store(request) -> str:
    """Where the test's warehouse lives: "local" (a temp dir), or "s3" for tests marked
    `story` (their second run)."""
    return getattr(request, "param", "local")


@pytest.fixture
def location(store, tmp_path, request) -> str:
    """The test's warehouse location: tmp_path/wh, or a fresh prefix on the S3 server."""
    if store == "s3":
        if ENGINE in SPARK_ENGINES:
            pytest.skip(SPARK_S3_REFUSED)
        return request.getfixturevalue("s3_location")
    return str(tmp_path / "wh")


@pytest.fixture
def store_env(store, request) -> dict[str, str]:
    """The environment for a subprocess that opens the test's warehouse: this process's,
    plus the S3 server's AWS_* variables for an S3 warehouse."""
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    if store == "s3":
        env.update(request.getfixturevalue("s3_server").options)
    return env


def broker_config(store: str, request) -> object:
    """The BrokerConfig of a test's broker: the S3 server's options for an S3 warehouse,
    the cluster's URL under --engine remote."""
    from deltamq.config import BrokerConfig

    options = request.getfixturevalue("s3_server").options if store == "s3" else {}
    if ENGINE in REMOTE_ENGINES:
        return BrokerConfig(
            engine="remote", remote=request.getfixturevalue("cluster").url, storage_options=options
        )
    return BrokerConfig(storage_options=options)


@pytest.fixture(scope="session")
def _fresh_warehouse(tmp_path_factory) -> Path:
    """A new warehouse made once per test process: a local test's warehouse is a copy of
    it (16 Delta tables created by the engine take 0.4-0.6 s; a copy, a few ms)."""
    path = tmp_path_factory.mktemp("template") / "wh"
    Broker.init(str(path), clock=FakeClock(1_767_225_600_000)).close()
    return path


@pytest.fixture
def broker(location, store, clock, request):
    if store == "local" and ENGINE == "embedded":
        # new files (not copy2's old times): log cleanup goes by a log entry's file age
        shutil.copytree(request.getfixturevalue("_fresh_warehouse"), location, copy_function=shutil.copy)
        b = Broker.open(location, clock=clock, config=broker_config(store, request))
    else:
        b = Broker.init(location, clock=clock, config=broker_config(store, request))
    yield b
    b.close()


@pytest.fixture
def warehouse_with(broker, tmp_path):
    """A factory for the test's warehouse (the ``broker`` fixture's) with a topic and,
    optionally, a consumer group subscribed to it; returns a :class:`helpers.WarehouseSetup`
    (``broker``, ``topic``, ``group``, ``log``)::

        wh = warehouse_with("orders", queues=2, group="g", recorder="fail_twice")
        broker, log = wh.broker, wh.log

    ``queues`` defaults to the broker's default. With ``group``: a group created from
    ``FIRST_OFFSET`` with a ``support.listeners.Recorder(log, recorder)`` listener (no listener
    for ``recorder=None``), subscribed with ``expression``; other keywords go to
    ``Broker.create_group``. ``log`` names the listener log in ``tmp_path``. More groups:
    ``wh.add_group(...)``."""

    def make(
        topic: str = "orders",
        queues: int | None = None,
        *,
        group: str | None = None,
        recorder: str | None = "ok",
        expression: str = "*",
        log: str = "calls.jsonl",
        **group_options,
    ) -> WarehouseSetup:
        broker.create_topic(topic, queues=queues)
        setup = WarehouseSetup(broker, topic, tmp_path / log)
        if group is not None:
            setup.add_group(recorder, name=group, expression=expression, **group_options)
            setup.group = group
        return setup

    return make


@pytest.fixture
def env_listener_log(request, tmp_path, monkeypatch) -> Path:
    """Where `support.listeners:env_recorder` writes: its DELTAMQ_TEST_LOG. The embedded engine
    ships this process's environment to listener workers; a cluster's workers have the
    cluster's own (set when the `cluster` fixture started it)."""
    if ENGINE in REMOTE_ENGINES:
        return request.getfixturevalue("cluster").listener_log
    path = tmp_path / "env-listener.jsonl"
    monkeypatch.setenv("DELTAMQ_TEST_LOG", str(path))
    return path


def table_versions(warehouse_dir: Path | str) -> dict[str, int]:
    """Number of commits of every table (to assert that nothing changed)."""
    root = Path(warehouse_dir)
    out = {}
    for table in sorted(p for p in root.iterdir() if (p / "_delta_log").is_dir()):
        out[table.name] = len(list((table / "_delta_log").glob("*.json")))
    return out


# --- an S3 API server (moto) on 127.0.0.1: a real HTTP endpoint in its own process ---------
S3_BUCKET = "deltamq-test"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(
    command: list[str],
    *,
    env: dict[str, str] | None,
    ready,
    what: str,
    timeout_s: float = 60,
    log: Path | None = None,
    cwd: Path | None = None,
):
    """A server in its own process for the length of the block: started, probed with
    ``ready()`` (true once it answers; OSError while it does not yet) until it answers
    or ``timeout_s`` passes, and stopped at the end. Its output goes to ``log`` (else
    nowhere), which a failure to start names."""
    import subprocess
    import time

    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"{what} did not start (exit code {proc.poll()}; output in {log})")
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            out.close()


def tool(name: str) -> str:
    """A command installed next to this Python (the venv's bin), else on PATH."""
    import shutil

    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.fail(f'{name} is not installed: pip install -e ".[dev]"')
    return exe


def s3_server_command(port: int) -> list[str]:
    """moto's S3 server on 127.0.0.1:``port``, its conditional writes atomic as on S3
    (tests/support/s3_server.py)."""
    return [
        sys.executable,
        str(Path(__file__).parent / "support" / "s3_server.py"),
        "-H",
        "127.0.0.1",
        "-p",
        str(port),
    ]


def create_bucket(endpoint: str, bucket: str) -> bool:
    """PUT /<bucket> on an S3 API server (moto answers unsigned requests)."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=2).read()
    return True


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free port, with one bucket; yields the storage options a
    warehouse on it needs (the names of the standard AWS_* variables)."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = s3_server_command(port)
    with running(command, env=None, ready=lambda: create_bucket(endpoint, S3_BUCKET), what="moto_server"):
        yield SimpleNamespace(
            endpoint=endpoint,
            port=port,
            bucket=S3_BUCKET,
            options={
                "AWS_ACCESS_KEY_ID": "deltamq-test",
                "AWS_SECRET_ACCESS_KEY": "deltamq-test-secret",
                "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ALLOW_HTTP": "true",
            },
        )


@pytest.fixture(scope="session")
def fault_proxy_server(s3_server, tmp_path_factory):
    """The fault proxy (tests/support/fault_proxy.py) in its own process, in front of the
    S3 API server; yields a ``Faults`` handle."""
    from support.fault_proxy import CONTROL, Faults

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "support.fault_proxy",
        "--target",
        s3_server.endpoint,
        "--port",
        str(port),
    ]

    def ready() -> bool:
        import urllib.request

        urllib.request.urlopen(endpoint + CONTROL, timeout=2).read()
        return True

    log = tmp_path_factory.mktemp("fault-proxy") / "proxy.log"
    with running(command, env=env, ready=ready, what="the fault proxy", log=log):
        yield Faults(endpoint, {**s3_server.options, "AWS_ENDPOINT_URL": endpoint})


@pytest.fixture
def faults(fault_proxy_server):
    """The fault proxy with no faults set and zeroed counters, and again after the test."""
    fault_proxy_server.reset()
    yield fault_proxy_server
    fault_proxy_server.reset()


@pytest.fixture
def s3_location(s3_server, request):
    """A fresh warehouse URI on the S3 server, one per test."""
    import uuid

    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return f"s3://{s3_server.bucket}/{name}-{uuid.uuid4().hex[:8]}/wh"


@pytest.fixture(scope="session")
def cluster(request):
    """The Spark Connect endpoint of `--engine remote|spark|spark-cluster`."""
    name = {"remote": "sail_cluster", "spark": "spark_server", "spark-cluster": "spark_cluster"}[ENGINE]
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def sail_cluster(s3_server, tmp_path_factory):
    """Sail in local-cluster mode (`SAIL_MODE=local-cluster sail spark server`) on a free
    port, for `--engine remote`. What a deployment must give such a server (docs/storage.md):
    deltamq and the listeners' modules importable (here: PYTHONPATH has tests/), the
    listeners' environment, and the object store's credentials (here: the S3 server's)."""

    port = _free_port()
    log = tmp_path_factory.mktemp("cluster") / "env-listener.jsonl"
    env = dict(os.environ)
    env.update(s3_server.options)
    env.update(
        SAIL_MODE="local-cluster",
        RUST_LOG="error",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")]),
        DELTAMQ_TEST_LOG=str(log),
        AWS_CONDITIONAL_PUT="etag",
    )
    command = [tool("sail"), "spark", "server", "--ip", "127.0.0.1", "--port", str(port)]
    with running(command, env=env, ready=lambda: _port_open(port), what="Sail local-cluster") as proc:
        yield SimpleNamespace(url=f"sc://127.0.0.1:{port}", pid=proc.pid, listener_log=log)
        _release_results_while_up()


def _release_results_while_up() -> None:
    """Before a Spark Connect server stops: results of finished tests that the garbage
    collector has not reached yet are released now, and the releases in flight are
    waited for. pyspark retries a release against a server that is gone for about ten
    minutes, and the last session's close waits for it (docs/engines.md)."""
    import gc

    from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator

    gc.collect()
    ExecutePlanResponseReattachableIterator.shutdown()
    # anything finalised from here on must not start a release the server cannot answer
    ExecutePlanResponseReattachableIterator._get_or_create_release_thread_pool = classmethod(  # type: ignore[method-assign]
        _no_release_pool
    )


def _no_release_pool(cls):
    raise RuntimeError("the test server has stopped: no release of results")


# --- Apache Spark with Delta: its own Spark Connect server, locally or on a standalone cluster --
def _port_open(port: int) -> bool:
    import socket

    socket.create_connection(("127.0.0.1", port), timeout=1).close()
    return True


def _spark_connect_env(s3_server, listener_log: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The environment and ``--conf`` settings a Spark Connect server for the tests gets:
    what docs/engines.md says a deployment must give it (deltamq and the listeners'
    modules importable on every executor, the listeners' environment, the object store's
    s3a settings, this Python for the workers)."""
    from deltamq.spark_setup import child_env, python_conf
    from deltamq.storage import Storage

    tests_dir = str(Path(__file__).parent)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in [tests_dir, env.get("PYTHONPATH", "")] if p)
    env["DELTAMQ_TEST_LOG"] = str(listener_log)
    conf = python_conf(pythonpath=env["PYTHONPATH"])
    conf["spark.executorEnv.DELTAMQ_TEST_LOG"] = str(listener_log)
    conf["spark.ui.enabled"] = "false"
    conf["spark.log.level"] = "WARN"
    conf["spark.driver.memory"] = "3g"
    conf["spark.sql.shuffle.partitions"] = "2"
    conf.update(Storage(f"s3://{s3_server.bucket}", s3_server.options, env={}).spark_conf())
    return env, conf


@pytest.fixture(scope="session")
def spark_server(s3_server, tmp_path_factory):
    """Apache Spark's Spark Connect server with Delta (`--engine spark`), started the way
    the README starts it: spark-submit of the server class with Delta's --packages."""
    from deltamq.spark_setup import connect_server_command

    work = tmp_path_factory.mktemp("spark-server")
    log = work / "env-listener.jsonl"
    env, conf = _spark_connect_env(s3_server, log)
    port = _free_port()
    command = connect_server_command(port, master="local[2]", extra_conf=conf)
    with running(
        command, env=env, ready=lambda: _port_open(port), what="Spark Connect server",
        timeout_s=300, log=work / "server.log", cwd=work,
    ) as proc:  # fmt: skip
        url = f"sc://127.0.0.1:{port}"
        yield SimpleNamespace(url=url, pid=proc.pid, listener_log=log, log=work / "server.log")
        _release_results_while_up()


@pytest.fixture(scope="session")
def spark_cluster(s3_server, tmp_path_factory):
    """A standalone Apache Spark cluster (a master and two workers, started with
    spark-class as the README does) and Spark's Connect server on it (`--engine
    spark-cluster`): executors run in the workers' own JVMs and Python workers."""
    from deltamq.spark_setup import connect_server_command, master_command, worker_command

    work = tmp_path_factory.mktemp("spark-cluster")
    log = work / "env-listener.jsonl"
    env, conf = _spark_connect_env(s3_server, log)
    conf["spark.executor.cores"] = "1"
    conf["spark.executor.memory"] = "1g"
    master_port, port = _free_port(), _free_port()
    master_url = f"spark://127.0.0.1:{master_port}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            running(
                master_command("127.0.0.1", master_port), env=env, ready=lambda: _port_open(master_port),
                what="Spark master", timeout_s=120, log=work / "master.log", cwd=work,
            )
        )  # fmt: skip
        for i in range(2):
            wdir = work / f"worker{i}"
            wdir.mkdir()
            stack.enter_context(
                running(
                    worker_command(master_url, "127.0.0.1", cores=1, memory="2g") + ["--work-dir", str(wdir)],
                    env=env, ready=lambda n=i + 1: _registered(work / "master.log", n),
                    what=f"Spark worker {i}", timeout_s=120, log=work / f"worker{i}.log", cwd=work,
                )
            )  # fmt: skip
        command = connect_server_command(port, master=master_url, extra_conf=conf)
        proc = stack.enter_context(
            running(
                command, env=env, ready=lambda: _port_open(port), what="Spark Connect server on the cluster",
                timeout_s=300, log=work / "server.log", cwd=work,
            )
        )  # fmt: skip
        yield SimpleNamespace(
            url=f"sc://127.0.0.1:{port}", pid=proc.pid, listener_log=log, log=work / "server.log",
            master=master_url, work=work,
        )  # fmt: skip
        _release_results_while_up()


def _registered(master_log: Path, workers: int) -> bool:
    """True once the master logged ``workers`` workers registering (a line each)."""
    text = master_log.read_text(errors="replace") if master_log.exists() else ""
    return text.count("Registering worker") >= workers
