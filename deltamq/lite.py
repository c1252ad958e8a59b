"""A producer and a pull consumer without Spark: ``pip install "deltamq[producer]"``
(pyarrow, the ``deltalake`` package and obstore; no PySpark, no Sail).

    from deltamq.lite import Producer
    from deltamq.message import Message

    producer = Producer("/data/wh", "order-service")
    producer.send(Message("orders", b"{...}", keys="order-1"))

The same validation, queue choice and ids as the Spark producer (both are
:class:`deltamq.sending.BaseProducer`); each send is one blind append to ``commit_log``
written by delta-rs, which dispatch indexes like any other. Blind appends never conflict
with the broker's jobs or with other producers. DataFrame sends and transactions need
the Spark producer (``Broker.producer``).

    from deltamq.lite import PullConsumer

    consumer = PullConsumer("/data/wh", "workers", "worker-1")
    messages = consumer.pull(1000)
    consumer.ack([m.receipt_handle for m in messages])

The same protocol, tables and guarantees as ``Broker.pull_consumer`` (deltamq/pull.py),
on a store that reads the tables' files and writes with delta-rs (deltamq/pull_files.py);
the two kinds of client share a group. Groups with a de-duplication key or an SQL92
subscription need ``Broker.pull_consumer``; a nack is carried out by the broker's next
tick.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import pyarrow as pa

from deltamq import pull as _pull
from deltamq.arrow_memory import use_pool
from deltamq.clock import Clock, SystemClock
from deltamq.config import BrokerConfig
from deltamq.constants import COMMIT_LOG_GROUPS, SCHEMA_VERSION
from deltamq.delta_append import BlindAppender, Unsupported
from deltamq.delta_read import FileSnapshot
from deltamq.errors import SchemaVersionError, WarehouseNotFound
from deltamq.pull_files import FileStore
from deltamq.sending import BaseProducer, Topics
from deltamq.storage import Storage, retry_commits

log = logging.getLogger("deltamq.lite")


def _deltalake():
    try:
        import deltalake
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError('deltamq.lite needs the deltalake package: pip install "deltamq[producer]"') from e
    return deltalake


class Warehouse(Topics):
    """The parts of a warehouse a producer needs, read and written with delta-rs."""

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        config: BrokerConfig | None = None,
        clock: Clock | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.config = config or BrokerConfig.from_env()
        # the storage seam: the same options, credentials and commit-safety settings as
        # the broker (storage_options here, else the config's, else the environment's)
        self.storage = Storage(location, storage_options or self.config.storage_options)
        self.location = self.storage.location
        self.clock = clock or SystemClock()
        self._max_level: int | None = None
        self._appender: BlindAppender | None = BlindAppender(
            self.storage,
            self.storage.join("commit_log"),
            engine_info="deltamq-lite",
            group_by=COMMIT_LOG_GROUPS,
        )
        self._write_lock = threading.Lock()
        self._snapshots: dict[str, FileSnapshot] = {}
        version = self._schema_version()
        if version is None:
            raise WarehouseNotFound(
                f"no deltamq warehouse at {self.location}; create it with `deltamq init --warehouse "
                f"{self.location}` (which needs the Spark install)"
            )
        if version != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.location} has schema version {version}; this release writes {SCHEMA_VERSION} "
                "(create or upgrade it with `deltamq init`, which needs the Spark install)"
            )

    def _read(self, name: str, columns: list[str]) -> list[dict[str, Any]]:
        """Every row of a small control table (``columns``), from its files as the tick
        reads them (deltamq/delta_read.py), its snapshot kept and brought up to date.
        Not delta-rs' ``to_pyarrow_table``: a process that exited right after one (a send
        refused for an unknown topic, say) aborted now and then in native code, its
        dataset's reads still winding down."""
        uri = self.storage.join(name)
        snap = self._snapshots.get(name)
        if snap is None:
            if not self.storage.is_delta_table(uri):  # a store it cannot list raises StorageError
                return []
            snap = self._snapshots[name] = FileSnapshot(self.storage, uri)
        try:
            snap.refresh()
            return snap.read(snap.files(), columns).to_pylist()
        except Exception as e:  # noqa: BLE001 - a store error becomes a StorageError naming it
            raise self.storage.error("read", uri, e) from e

    def _schema_version(self) -> int | None:
        rows = [r for r in self._read("warehouse_meta", ["key", "value"]) if r["key"] == "schema_version"]
        return int(rows[0]["value"]) if rows else None

    def _topic_rows(self) -> list[tuple[str, int, str, bool]]:
        rows = self._read("topic_config", ["topic", "queues", "perm", "ordered"])
        return [(r["topic"], r["queues"], r["perm"], r["ordered"]) for r in rows]

    def max_delay_level(self) -> int:
        if self._max_level is None:
            levels = self._read("schedule_levels", ["level"])
            self._max_level = max((r["level"] for r in levels), default=0)
        return self._max_level

    def append_commit_log(self, rows: pa.Table, *, what: str) -> None:
        """One blind append of ``rows`` to ``commit_log``: a Parquet file and a commit entry
        written by :class:`deltamq.delta_append.BlindAppender` (no table snapshot carried
        between sends; a lost answer to its commit is recognised as its own). A table whose
        protocol that writer does not meet is appended to with delta-rs, which retries a
        refusal of its conflict checker here, with back-off. Rows carry ids derived before
        the write: a repeat is indexed once."""
        with self._write_lock:
            if self._appender is not None:
                try:
                    self._appender.append(rows)
                    return
                except Unsupported as e:
                    log.info("commit_log: %s; appending with delta-rs", e)
                    self._appender = None
            self._append_with_delta_rs(rows)

    def _append_with_delta_rs(self, rows: pa.Table) -> None:
        dl = _deltalake()
        uri = self.storage.join("commit_log")
        retry_commits(
            lambda: dl.write_deltalake(
                uri, rows, mode="append", storage_options=self.storage.delta_rs_options()
            ),
            self.config.commit_policy,
            lambda e, _: self.storage.error("append to", uri, e),
        )


class Producer(BaseProducer):
    """Sends messages to the warehouse at ``location`` for producer group ``group``,
    without Spark: ``send`` and ``send_batch`` as on ``Broker.producer(group)``."""

    def __init__(
        self,
        location: str | os.PathLike[str] | Warehouse,
        group: str,
        *,
        config: BrokerConfig | None = None,
        clock: Clock | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        target = (
            location
            if isinstance(location, Warehouse)
            else Warehouse(location, config=config, clock=clock, storage_options=storage_options)
        )
        super().__init__(target, group)


class PullConsumer(_pull.PullConsumer):
    """A pull client of ``group`` (CLUSTERING, no push listener) as ``client_id``, in the
    warehouse at ``location``, without Spark: ``pull``, ``ack``, ``nack``, ``heartbeat``
    and ``close`` as on ``Broker.pull_consumer(group, client_id)``."""

    def __init__(
        self,
        location: str | os.PathLike[str] | Warehouse,
        group: str,
        client_id: str,
        *,
        config: BrokerConfig | None = None,
        clock: Clock | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        wh = (
            location
            if isinstance(location, Warehouse)
            else Warehouse(location, config=config, clock=clock, storage_options=storage_options)
        )
        super().__init__(FileStore(wh.storage, wh.config, wh.clock), group, client_id)
        use_pool(wh.config.pull_memory_pool)  # once the group is found; 2 x faster than mimalloc here
