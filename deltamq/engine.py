"""The engine seam: the one place that yields a SparkSession and runs SQL.

Three modes (docs/design.md, "Engine"):

* ``embedded`` (default): a Sail server (``pysail``) in a child process, on 127.0.0.1
  at a free port, shared by every Broker of the process, replaced when its memory
  grows past ``embedded_max_rss_mb`` and stopped at exit (or when the process dies);
* ``remote``: any Spark Connect endpoint, ``sc://host:port`` (argument or
  ``DELTAMQ_SPARK_REMOTE``);
* ``classic``: the active SparkSession (e.g. under ``spark-submit``) with delta-spark
  configured.

Every SQL statement goes through :meth:`Engine.sql`, which can record it (the Apache
Spark guard parses every recorded statement with Spark's own parser), and every
commit goes through :meth:`Engine.commit`, which retries optimistic-concurrency
conflicts by calling the caller's plan-and-commit function again (so a retry always
re-plans from fresh reads), with bounded, jittered back-off.

Engine gaps and their workarounds are listed in docs/engines.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from deltamq.errors import CommitConflict, EngineError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

    from deltamq.config import BrokerConfig
    from deltamq.storage import Storage

log = logging.getLogger(__name__)
R = TypeVar("R")
_START_TIMEOUT_S = 120.0

# Texts by which engines report that another writer committed first.
_CONFLICT_MARKERS = (
    "Failed to commit transaction",  # Sail (delta-rs style)
    "ConcurrentAppendException",
    "ConcurrentDeleteReadException",
    "ConcurrentDeleteDeleteException",
    "ConcurrentTransactionException",
    "ConcurrentModificationException",
    "MetadataChangedException",
    "ProtocolChangedException",
    "DELTA_CONCURRENT",
    "version already exists",
    "Version already exists",
    # Sail: a snapshot read racing another writer's commit/checkpoint (seen at the
    # 10-commit checkpoint). A failed read before our commit: safe to re-plan.
    "Missing commit file",
)

_DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
_DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"

# Hooks that receive every SQL statement the engine runs (the Spark guard uses one).
SQL_RECORDERS: list[Callable[[str], None]] = []


def is_commit_conflict(exc: BaseException) -> bool:
    """True when ``exc`` says another writer's commit landed first."""
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in _CONFLICT_MARKERS)


class _EmbeddedServer:
    """The process's Sail Spark Connect server, run in a child process
    (deltamq/_sail_child.py), started on first use and replaced by :meth:`recycle`.

    Sail holds on to ~0.1 MB for every operation it executes and frees it only when its
    process ends (docs/engines.md), so a long-lived broker must be able to swap the
    server for a fresh one: every embedded Engine notices the new ``generation`` and
    reconnects on its next use of ``spark``.
    """

    _lock = threading.RLock()
    _proc: subprocess.Popen | None = None
    _url: str | None = None
    generation = 0
    recycles = 0
    sessions: list = []
    _atexit = False
    # environment the server runs with beyond this process's: the object-store settings
    # of the warehouse whose engine used it last (deltamq/storage.py)
    env: dict[str, str] = {}

    @classmethod
    def require_env(cls, env: dict[str, str]) -> None:
        """Make sure the server runs with exactly ``env`` beyond the process's environment,
        replacing a running one that has other settings. One server serves one set of
        object-store settings at a time: engines of warehouses with other settings swap
        it back on their next use (about a second each time)."""
        with cls._lock:
            if cls.env == env:
                return
            cls.env = dict(env)
            if cls._proc is not None and cls._proc.poll() is None:
                cls.recycle("a warehouse needs other object-store settings")

    @classmethod
    def url(cls) -> str:
        with cls._lock:
            if cls._url is None or cls._proc is None or cls._proc.poll() is not None:
                if cls._proc is not None:
                    log.warning("embedded Sail server (pid %s) is gone; starting another", cls._proc.pid)
                cls._start()
            assert cls._url is not None
            return cls._url

    @classmethod
    def alive(cls) -> bool:
        return cls._proc is not None and cls._proc.poll() is None

    @classmethod
    def _start(cls) -> None:
        env = dict(os.environ) | cls.env
        env.setdefault("RUST_LOG", "error")
        proc = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).with_name("_sail_child.py")), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert proc.stdin is not None and proc.stdout is not None
            setup = {"sys_path": [p for p in sys.path if isinstance(p, str)]}
            proc.stdin.write(json.dumps(setup).encode() + b"\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], _START_TIMEOUT_S)
            line = proc.stdout.readline().decode().split() if ready else []
            if len(line) != 3 or line[0] != "LISTENING":
                raise EngineError(
                    f"the embedded Sail server did not start within {_START_TIMEOUT_S:.0f}s "
                    f"(exit code {proc.poll()}, said {line!r}); is pysail installed?"
                )
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        cls._proc, cls._url = proc, f"sc://{line[1]}:{line[2]}"
        cls.generation += 1
        if not cls._atexit:
            atexit.register(cls.stop)
            cls._atexit = True
        log.info("embedded Sail server (pid %s) listening on %s", proc.pid, cls._url)

    @classmethod
    def rss_mb(cls) -> float | None:
        """The server process's resident memory in MiB (None: not running or unknown)."""
        proc = cls._proc
        if proc is None or proc.poll() is not None:
            return None
        return resident_mb(proc.pid)

    @classmethod
    def recycle(cls, reason: str) -> None:
        """Replace the server by a fresh one; engines reconnect on next use."""
        with cls._lock:
            log.info("replacing the embedded Sail server: %s", reason)
            cls.stop()
            cls._start()
            cls.recycles += 1

    @classmethod
    def stop(cls) -> None:
        with cls._lock:
            proc, cls._proc, cls._url = cls._proc, None, None
            # Close our clients while the server still answers: a client finishes its
            # pending ReleaseExecute calls then; against a dead server they would be
            # retried for minutes, holding up the process's exit.
            sessions, cls.sessions = cls.sessions, []
            for spark in sessions:
                try:
                    spark.client.close()
                except Exception:  # noqa: BLE001 - already closed
                    pass
            if proc is None:
                return
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - it would not stop: make it
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    @classmethod
    def running(cls) -> bool:
        return cls._url is not None and cls.alive()


@dataclass
class EngineStats:
    """Counters of one Engine: statements run, commits, conflicts retried."""

    statements: int = 0
    commits: int = 0
    conflicts_retried: int = 0
    stale_dml_repeats: int = 0  # DML statements repeated after a read-back found them not applied
    by_job: dict[str, int] = field(default_factory=dict)


class Engine:
    """A SparkSession plus the helpers every deltamq module uses to touch tables."""

    def __init__(self, spark: SparkSession, mode: str, config: BrokerConfig) -> None:
        self._spark = spark
        self._generation = _EmbeddedServer.generation
        self.mode = mode
        self.config = config
        self.stats = EngineStats()
        # the server environment this engine's warehouse needs (None: any; embedded only)
        self._server_env: dict[str, str] | None = None

    @property
    def spark(self) -> SparkSession:
        """The session; an embedded engine reconnects here after the server was
        replaced (:meth:`recycle_if_large`) or found dead."""
        if self.mode == "embedded":
            if self._server_env is not None and _EmbeddedServer.env != self._server_env:
                _EmbeddedServer.require_env(self._server_env)
            if self._generation != _EmbeddedServer.generation or not _EmbeddedServer.alive():
                self._spark = _embedded_session()
                self._generation = _EmbeddedServer.generation
        return self._spark

    def recycle_if_large(self) -> bool:
        """Replace the embedded server when its memory passed ``embedded_max_rss_mb``
        (Sail frees memory only with its process: docs/engines.md). Call it between
        units of work (a tick, a pull): a query that another thread of this process is
        running on the old server fails and must be retried. True when replaced."""
        limit = self.config.embedded_max_rss_mb
        if self.mode != "embedded" or limit <= 0:
            return False
        rss = _EmbeddedServer.rss_mb()
        if rss is None or rss <= limit:
            return False
        _EmbeddedServer.recycle(f"its memory {rss:.0f} MiB is over embedded_max_rss_mb={limit}")
        return True

    @staticmethod
    def embedded_rss_mb() -> float | None:
        """The embedded server process's resident memory in MiB, if it runs."""
        return _EmbeddedServer.rss_mb()

    @staticmethod
    def embedded_recycles() -> int:
        """How many times this process replaced its embedded server."""
        return _EmbeddedServer.recycles

    def prepare_storage(self, storage: Storage) -> None:
        """Give the engine what ``storage`` needs: the embedded server its environment
        (Sail reads the standard AWS_* / AZURE_* / GOOGLE_* variables), a classic session
        its ``spark.hadoop.fs.s3a.*`` settings. A remote server is configured where it
        runs (docs/storage.md)."""
        if self.mode == "embedded":
            env = storage.engine_env()
            if env:
                self._server_env = env
                _EmbeddedServer.require_env(env)
        elif self.mode == "classic":
            # at run time Hadoop reads fs.s3a.* from the context's configuration; the
            # spark.hadoop.* spelling only takes effect at start-up (--conf)
            hadoop = self._spark.sparkContext._jsc.hadoopConfiguration()
            for key, value in storage.spark_conf().items():
                hadoop.set(key.removeprefix("spark.hadoop."), value)

    # --- construction -------------------------------------------------------------
    @classmethod
    def open(cls, config: BrokerConfig, spark: SparkSession | None = None) -> Engine:
        """Yield an Engine for ``config.engine`` (or wrap the ``spark`` given)."""
        if spark is not None:
            mode = "classic" if _is_classic(spark) else "remote"
            if mode == "classic":
                _check_classic_delta(spark)
            return cls(spark, mode, config)
        if config.engine == "classic":
            from pyspark.sql import SparkSession

            active = SparkSession.getActiveSession()
            if active is None:
                active = SparkSession.builder.getOrCreate()
            _check_classic_delta(active)
            return cls(active, "classic", config)
        if config.engine == "remote":
            url = config.remote or os.environ.get("DELTAMQ_SPARK_REMOTE")
            if not url:
                raise EngineError(
                    "engine 'remote' needs a Spark Connect URL: pass remote='sc://host:port' "
                    "or set DELTAMQ_SPARK_REMOTE"
                )
            return cls(_connect(url), "remote", config)
        return cls(_embedded_session(), "embedded", config)

    @staticmethod
    def shutdown_embedded() -> None:
        """Stop the process's embedded Sail server (it starts again on next use)."""
        _EmbeddedServer.stop()

    @staticmethod
    def embedded_running() -> bool:
        return _EmbeddedServer.running()

    def close(self) -> None:
        """Forget this engine. The Spark session is deliberately left open.

        In pyspark 4.0 a Connect client's ``stop()``/``close()`` shuts down a
        process-wide thread pool that other live sessions' queries use, and releasing
        the server-side session breaks ``pyspark.sql.functions`` whenever the released
        session is the process's default one (docs/engines.md). Sessions are cheap;
        the embedded server goes away with the process. A classic session belongs to
        the caller.
        """

    # --- SQL ----------------------------------------------------------------------
    def sql(self, statement: str) -> DataFrame:
        """Run one SQL statement (lazily for queries). Every statement passes here."""
        self.stats.statements += 1
        for record in SQL_RECORDERS:
            record(statement)
        return self.spark.sql(statement)

    def rows(self, statement: str) -> list[Row]:
        """Run a statement and collect its rows."""
        return self.sql(statement).collect()

    def execute(self, statement: str) -> None:
        """Run a DML/DDL statement for its effect. Its returned counts are ignored
        on purpose: engines disagree on them (docs/design.md); count with a query."""
        self.sql(statement).collect()

    def append(
        self,
        df: DataFrame,
        location: str,
        partition_by: Sequence[str] = (),
        properties: dict[str, str] | None = None,
    ) -> None:
        """Blind-append ``df`` to the Delta table at ``location``; ``properties``
        (``delta.*`` table properties) take effect when the append creates the table.

        Sail has no ``INSERT INTO delta.`path```; the DataFrame writer works on every
        engine, so appends use it (docs/engines.md).
        """
        writer = df.write.format("delta").mode("append")
        for key, value in (properties or {}).items():
            writer = writer.option(key, value)
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        writer.save(location)

    # --- commits ------------------------------------------------------------------
    def commit(self, attempt: Callable[[], R], *, what: str) -> R:
        """Run ``attempt`` (read, plan, commit) and retry it on commit conflicts.

        ``attempt`` must re-read whatever it needs each time it is called: a retry
        never replays a statement built from stale values.
        """
        retries = self.config.commit_retries
        for i in range(retries + 1):
            try:
                result = attempt()
                self.stats.commits += 1
                return result
            except Exception as e:
                if not is_commit_conflict(e):
                    raise
                if i == retries:
                    raise CommitConflict(
                        f"{what}: commit still conflicting after {retries} retries; "
                        "other writers keep committing to the same table"
                    ) from e
                self.stats.conflicts_retried += 1
                self.stats.by_job[what] = self.stats.by_job.get(what, 0) + 1
                base = self.config.commit_backoff_ms / 1000.0
                delay = min(2.0, base * (2**i)) * random.uniform(0.5, 1.5)
                log.info("%s: commit conflict, retry %d in %.3fs", what, i + 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover


def resident_mb(pid: int | str = "self") -> float | None:
    """A process's resident memory in MiB (None: unknown, e.g. not Linux, which then
    never replaces its embedded server by size)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _embedded_session() -> SparkSession:
    from pyspark.sql.connect.client.retries import DefaultPolicy

    with _EmbeddedServer._lock:
        spark = _connect(_EmbeddedServer.url())
        _EmbeddedServer.sessions.append(spark)
    # A local server that stops answering is gone, not busy: give up in ~5 s rather than
    # the client's default ~10 minutes of retries (per query and per ReleaseExecute).
    spark.client.set_retry_policies([DefaultPolicy(max_retries=5, max_backoff=2000)])  # type: ignore[operator]
    _adopt_as_default(spark)
    # Our own server: render times in UTC like the epoch-ms columns (session-local).
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


def _adopt_as_default(spark: SparkSession) -> None:
    """After the embedded server was replaced, the process's default and this thread's
    active Connect session are closed ones: code that finds its session by
    ``SparkSession.builder.getOrCreate()`` (Great Expectations) would try to create one
    without a URL. Make ``spark`` both, where they are unusable."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    with ConnectSession._lock:
        if ConnectSession._get_default_session() is None:
            ConnectSession._default_session = spark  # type: ignore[assignment]
    if ConnectSession.getActiveSession() is None:
        ConnectSession._active_session.session = spark


def _quiet_late_releases() -> None:
    """pyspark 4.0's Spark Connect result iterator releases its results on the server from
    ``__del__``, through a thread pool shared by every session of the process; closing any
    session shuts that pool down. An unfinished iterator that the garbage collector reaches
    while a close is under way raises ``RuntimeError: cannot schedule new futures after
    shutdown`` from ``__del__``, wherever the collector happened to run — in a test run,
    inside the parser pytest uses to show a failure, which CPython 3.11.7 then reports as
    ``SystemError: AST constructor recursion depth mismatch`` and the run ends
    (docs/engines.md). The release is only a courtesy (a closed session's results go with
    it), so that error is dropped here."""
    try:
        from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as It
    except ImportError:  # pragma: no cover - classic PySpark without Connect
        return
    if getattr(It, "_deltamq_quiet_del", False):
        return
    original = It.__del__

    def __del__(self) -> None:  # noqa: N807 - replaces the class's finaliser
        try:
            original(self)
        except RuntimeError:
            pass

    It.__del__ = __del__  # type: ignore[method-assign]
    It._deltamq_quiet_del = True  # type: ignore[attr-defined]


_DEBUGGING = "spark.python.sql.dataFrameDebugging.enabled"


def _connect(url: str) -> SparkSession:
    from pyspark.sql import SparkSession

    _quiet_late_releases()
    try:
        # create(): a session of our own, so temp views of one Broker never clash
        # with another's in the same process. DataFrame debugging off: with it, PySpark
        # walks the stack and tries to import IPython on every Column function call (a
        # busy tick's jobs make hundreds: ~40 ms of client CPU a tick), only to add the
        # call site to engine error messages.
        return SparkSession.builder.remote(url).config(_DEBUGGING, "false").create()
    except Exception as e:
        raise EngineError(f"cannot connect to Spark Connect endpoint {url}: {e}") from e


def _is_classic(spark: SparkSession) -> bool:
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError:  # pragma: no cover
        return True
    return not isinstance(spark, ConnectSession)


def _check_classic_delta(spark: SparkSession) -> None:
    conf = spark.conf
    ext = conf.get("spark.sql.extensions", "") or ""
    catalog = conf.get("spark.sql.catalog.spark_catalog", "") or ""
    missing = []
    if _DELTA_EXTENSION not in ext:
        missing.append(f"spark.sql.extensions={_DELTA_EXTENSION}")
    if catalog != _DELTA_CATALOG:
        missing.append(f"spark.sql.catalog.spark_catalog={_DELTA_CATALOG}")
    if missing:
        raise EngineError(
            "the active Spark session is not configured for Delta Lake; set "
            + " and ".join(missing)
            + " (and put the delta-spark jars on the classpath, e.g."
            + " --packages io.delta:delta-spark_2.13:4.0.0)"
        )
