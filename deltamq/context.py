"""The context every job runs in: engine, warehouse, clock, configuration and catalog.

Jobs, pull clients, sinks, data-quality suites and operator tools take a
:class:`Context` instead of the ``Broker``: it is all they may reach, so they cannot
call back into the facade above them. It is also what a producer sends through
(:class:`deltamq.sending.Target`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from deltamq.catalog import Catalog
from deltamq.clock import Clock
from deltamq.config import OPEN_TIME_SETTINGS, PROMOTE_AHEAD_BY_ENGINE_MS, BrokerConfig
from deltamq.engine import Engine
from deltamq.errors import ConfigError
from deltamq.tables.warehouse import Warehouse

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from deltamq.config import GroupConfig
    from deltamq.tables.offsets import OffsetsMerge

R = TypeVar("R")


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

    def reconfigured(self, **changes: Any) -> Context:
        """This context with ``changes`` to its configuration (validated as a new
        :class:`BrokerConfig`), and a catalog that acts on them and keeps what this process
        registered. The engine and the warehouse were opened with ``engine``, ``remote``
        and ``storage_options``: those are refused (open another broker)."""
        fixed = sorted(set(changes) & set(OPEN_TIME_SETTINGS))
        if fixed:
            raise ConfigError(
                f"{', '.join(fixed)}: fixed when the broker opened (its engine and storage were "
                "opened with them); open a new Broker with the setting instead"
            )
        unknown = sorted(set(changes) - {f.name for f in fields(BrokerConfig)})
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {', '.join(unknown)}; BrokerConfig has "
                f"{', '.join(f.name for f in fields(BrokerConfig))}"
            )
        config = replace(self.config, **changes)
        catalog = Catalog(self.warehouse, self.clock, config, registered=self.catalog)
        return replace(self, config=config, catalog=catalog)

    @property
    def promote_ahead_ms(self) -> int:
        """How far ahead promote writes copies: the configuration's ``promote_ahead_ms``,
        or, when it is None, the engine's (``PROMOTE_AHEAD_BY_ENGINE_MS``)."""
        if self.config.promote_ahead_ms is not None:
            return self.config.promote_ahead_ms
        return PROMOTE_AHEAD_BY_ENGINE_MS[self.engine.flavor]

    def commit(self, attempt: Callable[[], R], *, what: str) -> R:
        """``attempt`` committed by the engine, retried on conflicts as this context's
        configuration says (``commit_retries``, ``commit_backoff_ms``)."""
        return self.warehouse.commit(attempt, what=what, policy=self.config.commit_policy)

    def commit_offsets(
        self,
        merge: OffsetsMerge,
        groups: Mapping[str, GroupConfig],
        update: Mapping[str, str],
        insert: Mapping[str, str] | None,
    ) -> None:
        """``merge`` committed less the rows of the ``groups`` (as the pass read them)
        deleted or created again since: checked in each attempt, so a group deleted and
        created again while the pass ran keeps the positions it starts from."""

        def attempt() -> None:
            merge.without(self.catalog.changed(groups)).execute(self.warehouse, update, insert)

        self.commit(attempt, what="offsets")

    # --- what a producer sends through (deltamq.sending.Target) ------------------------------
    def validate_writable_topic(self, topic: Any) -> str:
        return self.catalog.validate_writable_topic(topic)

    def topic_queues(self, topic: str) -> int:
        return self.catalog.topic_queues(topic)

    def max_delay_level(self) -> int:
        return self.catalog.max_delay_level()

    def append_commit_log(self, rows: pa.Table | DataFrame, *, what: str) -> None:
        """Blind-append stored messages to commit_log (one commit)."""
        if type(rows).__module__.startswith("pyarrow"):  # rows built in Python: no engine round trip
            self.commit(partial(self.warehouse.append_arrow, "commit_log", rows), what=what)
        else:
            self.commit(partial(self.warehouse.append, "commit_log", rows), what=what)
