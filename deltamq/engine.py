"""The engine seam: the one place that yields a SparkSession and runs SQL.

Three modes (docs/design.md, "Engine"):

* ``embedded`` (default): a Sail server (``pysail``) in a child process, on 127.0.0.1
  at a free port, shared by every Broker of the process, replaced when its memory
  grows past ``embedded_max_rss_mb`` and stopped at exit (deltamq/sail.py);
* ``remote``: any Spark Connect endpoint, ``sc://host:port`` (argument or
  ``DELTAMQ_SPARK_REMOTE``): a Sail server or cluster, or Apache Spark's own Connect
  server with Delta;
* ``classic``: an in-process Apache Spark session with delta-spark (``spark-submit``,
  a notebook): each Engine works in a session of its own (``newSession()``: its own
  temp views and SQL settings over the shared SparkContext).

Two flavours of engine sit behind those modes, told apart when the engine opens:
``sail`` and ``spark`` (Apache Spark with Delta). They differ in how S3 paths are
spelled (Hadoop's ``s3a://``), how a lost commit race is reported, and which
maintenance statements exist (docs/engines.md).

Every SQL statement goes through :meth:`Engine.sql`, which can record it (the Apache
Spark guard parses every recorded statement with Spark's own parser), and every
commit goes through :meth:`Engine.commit`, which retries optimistic-concurrency
conflicts by calling the caller's plan-and-commit function again (so a retry always
re-plans from fresh reads), with bounded, jittered back-off.

Engine gaps and their workarounds are listed in docs/engines.md.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from deltamq import sail
from deltamq.delta_append import VersionTaken
from deltamq.errors import CommitConflict, EngineError, UnsafeStorage, cause_chain
from deltamq.spark_connect import connect
from deltamq.spark_setup import DELTA_CATALOG, DELTA_EXTENSION, DELTA_PACKAGE, SESSION_TUNING
from deltamq.storage import is_transient

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

    from deltamq.config import BrokerConfig, CommitPolicy
    from deltamq.storage import Storage

log = logging.getLogger(__name__)
R = TypeVar("R")
Flavor = Literal["sail", "spark"]

# --- lost commit races, recognised by type ------------------------------------------------
# Delta (classic PySpark raises io.delta.exceptions.*; over Spark Connect the Java class
# arrives as the error's reason and its error class as the condition).
DELTA_CONFLICT_CLASSES = frozenset(
    f"io.delta.exceptions.{name}"
    for name in (
        "ConcurrentAppendException",
        "ConcurrentDeleteReadException",
        "ConcurrentDeleteDeleteException",
        "ConcurrentTransactionException",
        "ConcurrentWriteException",
        "DeltaConcurrentModificationException",
        "MetadataChangedException",
        "ProtocolChangedException",
    )
)
DELTA_CONFLICT_CONDITIONS = frozenset(
    {
        "DELTA_CONCURRENT_APPEND",
        "DELTA_CONCURRENT_DELETE_READ",
        "DELTA_CONCURRENT_DELETE_DELETE",
        "DELTA_CONCURRENT_TRANSACTION",
        "DELTA_CONCURRENT_WRITE",
        "DELTA_METADATA_CHANGED",
        "DELTA_PROTOCOL_CHANGED",
    }
)
# Sail reports a lost race by text only (no class, no condition).
SAIL_CONFLICT_TEXTS = (
    "Failed to commit transaction",
    # a snapshot read racing another writer's commit/checkpoint (seen at the 10-commit
    # checkpoint): it fails before our commit, so re-planning is safe
    "Missing commit file",
    "version already exists",
    "Version already exists",
)


def _condition(exc: BaseException) -> str:
    get = getattr(exc, "getCondition", None) or getattr(exc, "getErrorClass", None)
    try:
        value = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - an exception that cannot say
        value = None
    return (value or "").split(".", 1)[0]


def _java_classes(exc: BaseException) -> set[str]:
    """The Java exception classes an error carries: classic PySpark's captured
    exceptions (``delta.exceptions``) and py4j errors name theirs; a Spark Connect
    error starts with ``(java.class.Name) message``."""
    names: set[str] = set()
    for klass in type(exc).__mro__:
        if klass.__module__.startswith("delta.exceptions"):
            names.add(f"io.delta.exceptions.{klass.__name__}")
    text = str(exc)
    if text.startswith("("):
        names.add(text[1:].split(")", 1)[0])
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            names.add(java.getClass().getName())
        except Exception:  # noqa: BLE001 - the JVM is gone
            pass
    return names


def is_commit_conflict(exc: BaseException) -> bool:
    """True when ``exc`` says another writer's commit landed first: a Delta conflict
    exception (classic or over Spark Connect, by class or error condition), delta-rs'
    ``CommitFailedError``, or Sail's failed commit. Looks through ``__cause__`` chains."""
    for e in cause_chain(exc):
        if _condition(e) in DELTA_CONFLICT_CONDITIONS or _java_classes(e) & DELTA_CONFLICT_CLASSES:
            return True
        if type(e).__name__ == "CommitFailedError":  # delta-rs (Warehouse.merge_rows, retention)
            return True
        if isinstance(e, VersionTaken):  # a conditional append (deltamq/tables/index_files.py)
            return True
        text = str(e)
        if any(marker in text for marker in SAIL_CONFLICT_TEXTS):
            return True
        # a py4j error whose Delta class was not converted names it in its text
        if any(name in text for name in DELTA_CONFLICT_CLASSES):
            return True
    return False


# docs/engines.md, "S3 commit safety on Apache Spark"
S3_ON_SPARK_REFUSED = (
    "{location}: a deltamq warehouse on S3 cannot be written by Apache Spark with Delta. Delta-Spark "
    "commits to S3 with a check-then-PUT that is atomic only inside one driver JVM "
    "(spark.delta.logStore.s3a.impl=S3SingleDriverLogStore), while deltamq's other writers (Sail, the "
    "Spark-free producer, retention and compaction through delta-rs) commit with conditional PUTs; "
    "together they can overwrite each other's commits. Open this warehouse with the Sail engine "
    "(engine='embedded', or remote= a Sail server), or keep a warehouse for Apache Spark on a store "
    "whose commits are atomic for every writer (a local or HDFS path, ADLS, GCS)"
)

# Hooks that receive every SQL statement the engine runs (the Spark guard uses one).
SQL_RECORDERS: list[Callable[[str], None]] = []


@dataclass
class EngineStats:
    """Counters of one Engine: statements run, commits, conflicts and store faults retried."""

    statements: int = 0
    commits: int = 0
    conflicts_retried: int = 0
    store_faults_retried: int = 0
    stale_dml_repeats: int = 0  # DML statements repeated after a read-back found them not applied
    by_job: dict[str, int] = field(default_factory=dict)


class Engine:
    """A SparkSession plus the helpers every deltamq module uses to touch tables."""

    def __init__(self, spark: SparkSession, mode: str, flavor: Flavor = "sail") -> None:
        self._spark = spark
        self._generation = sail.EmbeddedServer.generation
        self.mode = mode
        self.flavor: Flavor = flavor
        self.stats = EngineStats()
        # the server environment this engine's warehouse needs (None: any; embedded only)
        self._server_env: dict[str, str] | None = None

    @property
    def idempotent_appends(self) -> bool:
        """Whether the engine's Delta writer records an application's appends and skips
        one it already committed (``txnAppId`` / ``txnVersion``): Apache Spark's does;
        Sail 0.7 has no such options."""
        return self.flavor == "spark"

    @property
    def hadoop_paths(self) -> bool:
        """Apache Spark reads S3 through Hadoop's ``s3a://``; Sail reads ``s3://``."""
        return self.flavor == "spark"

    @property
    def spark(self) -> SparkSession:
        """The session; an embedded engine reconnects here after the server was
        replaced (:meth:`recycle_if_large`) or found dead."""
        if self.mode == "embedded":
            server = sail.EmbeddedServer
            if self._server_env is not None and server.env != self._server_env:
                server.require_env(self._server_env)
            if self._generation != server.generation or not server.alive():
                self._spark = sail.embedded_session()
                self._generation = server.generation
        return self._spark

    def recycle_if_large(self, limit: int) -> bool:
        """Replace the embedded server when its memory passed ``limit`` MiB (the broker's
        ``embedded_max_rss_mb``; Sail frees memory only with its process:
        docs/engines.md). Call it between units of work (a tick, a pull): a query that
        another thread of this process is running on the old server fails and must be
        retried. True when replaced."""
        if self.mode != "embedded" or limit <= 0:
            return False
        rss = sail.EmbeddedServer.rss_mb()
        if rss is None or rss <= limit:
            return False
        sail.EmbeddedServer.recycle(f"its memory {rss:.0f} MiB is over embedded_max_rss_mb={limit}")
        return True

    @staticmethod
    def embedded_rss_mb() -> float | None:
        """The embedded server process's resident memory in MiB, if it runs."""
        return sail.EmbeddedServer.rss_mb()

    @staticmethod
    def embedded_recycles() -> int:
        """How many times this process replaced its embedded server."""
        return sail.EmbeddedServer.recycles

    def prepare_storage(self, storage: Storage) -> None:
        """Give the engine what ``storage`` needs: the embedded server its environment
        (Sail reads the standard AWS_* / AZURE_* / GOOGLE_* variables), a classic session
        its ``fs.s3a.*`` settings. A remote server is configured where it runs
        (docs/storage.md). Refuses what could lose a commit: Apache Spark on S3."""
        if self.flavor == "spark" and storage.kind == "s3":
            raise UnsafeStorage(S3_ON_SPARK_REFUSED.format(location=storage.location))
        if self.mode == "embedded":
            env = storage.engine_env()
            if env:
                self._server_env = env
                sail.EmbeddedServer.require_env(env)
        elif self.mode == "classic":
            # at run time Hadoop reads fs.s3a.* from the context's configuration; the
            # spark.hadoop.* spelling only takes effect at start-up (--conf)
            hadoop = self._spark.sparkContext._jsc.hadoopConfiguration()
            for key, value in storage.spark_conf().items():
                hadoop.set(key.removeprefix("spark.hadoop."), value)

    # --- construction -------------------------------------------------------------
    @classmethod
    def open(cls, config: BrokerConfig, spark: SparkSession | None = None) -> Engine:
        """Yield an Engine for ``config.engine`` (or over the ``spark`` given: a classic
        session is forked with ``newSession()`` so that each Engine has its own views)."""
        if spark is None and config.engine == "classic":
            from pyspark.sql import SparkSession

            spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        if spark is not None:
            if _is_classic(spark):
                _check_delta(spark)
                return cls(_own_session(spark.newSession(), "spark"), "classic", "spark")
            flavor = _flavor_of(spark)
            return cls(_own_session(spark, flavor), "remote", flavor)
        if config.engine == "remote":
            url = config.remote or os.environ.get("DELTAMQ_SPARK_REMOTE")
            if not url:
                raise EngineError(
                    "engine 'remote' needs a Spark Connect URL: pass remote='sc://host:port' "
                    "or set DELTAMQ_SPARK_REMOTE"
                )
            spark = connect(url)
            flavor = _flavor_of(spark)
            return cls(_own_session(spark, flavor), "remote", flavor)
        return cls(sail.embedded_session(), "embedded", "sail")

    @staticmethod
    def shutdown_embedded() -> None:
        """Stop the process's embedded Sail server (it starts again on next use)."""
        sail.EmbeddedServer.stop()

    @staticmethod
    def embedded_running() -> bool:
        return sail.EmbeddedServer.running()

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
        """Run one SQL statement (lazily for queries). Every statement passes here; those
        Sail runs are recorded for the Apache Spark guard (Apache Spark checks its own)."""
        self.stats.statements += 1
        if self.flavor == "sail":
            for record in SQL_RECORDERS:
                record(statement)
        return self.spark.sql(statement)

    @contextmanager
    def views(self) -> Iterator[Views]:
        """A scope for the temporary views one call needs (a MERGE source, a result read
        by several statements): each gets a name unique to the call, so two Brokers or two
        threads on one session never read each other's, and all are dropped on leaving."""
        scope = Views(self)
        try:
            yield scope
        finally:
            scope.drop()

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
        *,
        once: tuple[str, int] | None = None,
    ) -> None:
        """Blind-append ``df`` to the Delta table at ``location``; ``properties``
        (``delta.*`` table properties) take effect when the append creates the table.
        ``once`` (Apache Spark only: :attr:`idempotent_appends`): (application id,
        version) recorded with the commit; an append whose version is not above the one
        recorded for that id is skipped, and two appends of one id racing conflict
        (Delta's idempotent writes). The caller must choose versions that only grow.

        Sail has no ``INSERT INTO delta.`path```; the DataFrame writer works on every
        engine, so appends use it (docs/engines.md).
        """
        writer = df.write.format("delta").mode("append")
        if once is not None:
            if not self.idempotent_appends:
                raise ValueError(f"the {self.flavor} engine does not record idempotent appends")
            writer = writer.option("txnAppId", once[0]).option("txnVersion", str(once[1]))
        for key, value in (properties or {}).items():
            writer = writer.option(key, value)
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        writer.save(location)

    # --- commits ------------------------------------------------------------------
    def commit(
        self,
        attempt: Callable[[], R],
        *,
        what: str,
        policy: CommitPolicy,
        store_error: Callable[[BaseException], Exception] | None = None,
    ) -> R:
        """Run ``attempt`` (read, plan, commit) and retry it on commit conflicts and on
        transient faults of the store (throttling, resets, server errors) as ``policy``
        says (the caller's configuration: Context.commit passes it). A store fault that
        outlasts the retries raises ``store_error(e)`` (Context.commit: a StorageError
        naming the warehouse and the cause).

        ``attempt`` must re-read whatever it needs each time it is called: a retry
        never replays a statement built from stale values. After a store fault the
        commit may have landed (its answer was lost): the re-read sees it, and a blind
        append repeats rows whose ids it derived before writing (docs/reliability.md,
        "Ambiguous commits").
        """
        retries = policy.retries
        for i in range(retries + 1):
            try:
                result = attempt()
                self.stats.commits += 1
                return result
            except Exception as e:
                conflict = is_commit_conflict(e)
                if not conflict and not is_transient(e):
                    raise
                if i == retries:
                    if not conflict:
                        if store_error is None:
                            raise
                        raise store_error(e) from e
                    raise CommitConflict(
                        f"{what}: commit still conflicting after {retries} retries; "
                        "other writers keep committing to the same table"
                    ) from e
                if conflict:
                    self.stats.conflicts_retried += 1
                    self.stats.by_job[what] = self.stats.by_job.get(what, 0) + 1
                else:
                    self.stats.store_faults_retried += 1
                base = policy.backoff_ms / 1000.0
                delay = min(2.0, base * (2**i)) * random.uniform(0.5, 1.5)
                cause = "commit conflict" if conflict else f"store fault ({e!s:.200})"
                log.info("%s: %s, retry %d in %.3fs", what, cause, i + 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover


class Views:
    """Temporary views of one :meth:`Engine.views` scope."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._token = secrets.token_hex(4)
        self.names: list[str] = []

    def add(self, df: DataFrame, purpose: str) -> str:
        """Register ``df`` as a view named for ``purpose`` and this scope; returns the name."""
        name = f"dmq_{purpose}_{self._token}"
        df.createOrReplaceTempView(name)
        if name not in self.names:
            self.names.append(name)
        return name

    def drop(self) -> None:
        spark = self._engine.spark
        for name in self.names:
            try:
                spark.catalog.dropTempView(name)
            except Exception as e:  # the session is gone: so are its views
                log.debug("temporary view %s not dropped: %s", name, e)
        self.names.clear()


def _is_classic(spark: SparkSession) -> bool:
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError:  # pragma: no cover
        return True
    return not isinstance(spark, ConnectSession)


def _own_session(spark: SparkSession, flavor: Flavor) -> SparkSession:
    """deltamq's session settings, wherever the session came from: epoch-ms columns are
    rendered and cut into days in UTC; on Apache Spark, Delta's snapshot state in few
    partitions (spark_setup.SESSION_TUNING)."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    if flavor == "spark":
        for key, value in SESSION_TUNING.items():
            spark.conf.set(key, value)
    return spark


def _flavor_of(spark: SparkSession) -> Flavor:
    """``spark`` when the endpoint is Apache Spark (its ``version()`` is "4.0.5 <commit>"),
    ``sail`` for Sail (its own version alone). Apache Spark must have Delta loaded."""
    try:
        version = str(spark.sql("SELECT version() AS v").collect()[0][0])
    except Exception as e:  # noqa: BLE001 - the endpoint does not answer
        raise EngineError(f"the Spark Connect endpoint did not answer SELECT version(): {e}") from e
    if len(version.split()) < 2:
        return "sail"
    _check_delta(spark, what=f"the Spark Connect server (Apache Spark {version.split()[0]})")
    return "spark"


def _check_delta(spark: SparkSession, what: str = "the active Spark session") -> None:
    conf = spark.conf
    ext = conf.get("spark.sql.extensions", "") or ""
    catalog = conf.get("spark.sql.catalog.spark_catalog", "") or ""
    missing = []
    if DELTA_EXTENSION not in ext:
        missing.append(f"spark.sql.extensions={DELTA_EXTENSION}")
    if catalog != DELTA_CATALOG:
        missing.append(f"spark.sql.catalog.spark_catalog={DELTA_CATALOG}")
    if missing:
        raise EngineError(
            f"{what} is not configured for Delta Lake; set "
            + " and ".join(missing)
            + f" (and put the delta-spark jars on the classpath: --packages {DELTA_PACKAGE};"
            + " `deltamq spark-conf` prints every line)"
        )
