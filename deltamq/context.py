"""The context every job runs in: engine, warehouse, clock, configuration and catalog.

Jobs, pull clients, sinks, data-quality suites and operator tools take a
:class:`Context` instead of the ``Broker``: it is all they may reach, so they cannot
call back into the facade above them. It is also what a producer sends through
(:class:`deltamq.sending.Target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from deltamq.catalog import Catalog
from deltamq.clock import Clock
from deltamq.config import BrokerConfig
from deltamq.engine import Engine
from deltamq.tables.warehouse import Warehouse

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame


@dataclass(frozen=True)
class Context:
    """One warehouse, the engine working on it, the clock, the configuration and the catalog."""

    engine: Engine
    warehouse: Warehouse
    clock: Clock
    config: BrokerConfig
    catalog: Catalog

    @classmethod
    def of(cls, warehouse: Warehouse, clock: Clock, config: BrokerConfig) -> Context:
        return cls(warehouse.engine, warehouse, clock, config, Catalog(warehouse, clock, config))

    # --- what a producer sends through (deltamq.sending.Target) ------------------------------
    def validate_writable_topic(self, topic: Any) -> str:
        return self.catalog.validate_writable_topic(topic)

    def topic_queues(self, topic: str) -> int:
        return self.catalog.topic_queues(topic)

    def max_delay_level(self) -> int:
        return self.catalog.max_delay_level()

    def append_commit_log(self, rows: pa.Table | DataFrame, *, what: str) -> None:
        """Blind-append stored messages to commit_log (one commit)."""
        is_arrow = type(rows).__module__.startswith("pyarrow")
        df = self.engine.spark.createDataFrame(rows) if is_arrow else rows
        self.engine.commit(partial(self.warehouse.append, "commit_log", df), what=what)
