"""The engine seam: the one place that yields a SparkSession and runs SQL.

Three modes (DESIGN.md, "Engine"):

* ``embedded`` (default): an in-process Sail server (``pysail``) on 127.0.0.1 at a
  free port, shared by every Broker of the process and stopped at exit;
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
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from deltamq.errors import CommitConflict, EngineError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

    from deltamq.config import BrokerConfig

log = logging.getLogger(__name__)
R = TypeVar("R")

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
    """One Sail Spark Connect server per process, started on first use."""

    _lock = threading.Lock()
    _server = None
    _url: str | None = None
    sessions: list = []

    @classmethod
    def url(cls) -> str:
        with cls._lock:
            if cls._url is None:
                os.environ.setdefault("RUST_LOG", "error")
                try:
                    from pysail.spark import SparkConnectServer
                except ImportError as e:  # pragma: no cover - pysail is a hard dependency
                    raise EngineError("the embedded engine needs pysail: pip install pysail") from e
                server = SparkConnectServer(ip="127.0.0.1", port=0)
                server.start(background=True)
                host, port = server.listening_address
                cls._server, cls._url = server, f"sc://{host}:{port}"
                atexit.register(cls.stop)
                log.info("embedded Sail server listening on %s", cls._url)
            return cls._url

    @classmethod
    def stop(cls) -> None:
        with cls._lock:
            # Close our clients first: a server stop waits for open streams otherwise.
            for spark in cls.sessions:
                try:
                    spark.client.close()
                except Exception:  # noqa: BLE001 - already closed
                    pass
            cls.sessions = []
            if cls._server is not None:
                try:
                    cls._server.stop()
                except Exception:  # noqa: BLE001 - best effort at exit
                    log.debug("embedded server stop failed", exc_info=True)
            cls._server, cls._url = None, None

    @classmethod
    def running(cls) -> bool:
        return cls._url is not None


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
        self.spark = spark
        self.mode = mode
        self.config = config
        self.stats = EngineStats()

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
        spark = _connect(_EmbeddedServer.url())
        _EmbeddedServer.sessions.append(spark)
        # Our own server: render times in UTC like the epoch-ms columns (session-local).
        spark.conf.set("spark.sql.session.timeZone", "UTC")
        return cls(spark, "embedded", config)

    @staticmethod
    def shutdown_embedded() -> None:
        """Stop the process's embedded Sail server (it restarts on next use)."""
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
        on purpose: engines disagree on them (DESIGN.md); count with a query."""
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


def _connect(url: str) -> SparkSession:
    from pyspark.sql import SparkSession

    try:
        # create(): a session of our own, so temp views of one Broker never clash
        # with another's in the same process.
        return SparkSession.builder.remote(url).create()
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
