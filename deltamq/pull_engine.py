"""The pull protocol's tables reached through the broker's context (``Broker.pull_consumer``):
control-table writes are engine statements committed with the engine's conflict
handling; hot reads come from the tables' files where they can (deltamq/pull_reads.py,
deltamq/tables/files.py). The protocol is deltamq/pull.py's; the Spark-free store is
deltamq/pull_files.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from deltamq import dedup
from deltamq import file_reads as files
from deltamq.config import GroupConfig, Subscription
from deltamq.jobs import pull_expiry
from deltamq.pull_log import LockEntry, LogRow, Queue
from deltamq.pull_reads import Range, handout_rows
from deltamq.tables import deliveries
from deltamq.tables.consume_queue import visible_heads
from deltamq.tables.integrity import faults_named
from deltamq.tables.sqltext import sql_long, sql_str

if TYPE_CHECKING:
    from deltamq.context import Context

R = TypeVar("R")


class EngineStore:
    """What a pull client reads and writes, through ``ctx`` (engine, warehouse, catalog)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.clock = ctx.clock

    # --- the catalog ----------------------------------------------------------------------
    def group(self, name: str) -> GroupConfig | None:
        return self.ctx.catalog.groups().get(name)

    def group_names(self) -> list[str]:
        return sorted(self.ctx.catalog.groups())

    def listens(self, group: str) -> bool:
        """Whether this process registered a push listener for ``group``."""
        return group in self.ctx.catalog.listeners

    def subscriptions(self, group: str) -> list[Subscription]:
        return list(self.ctx.catalog.subscriptions(group))

    def topic_queues(self, topic: str) -> int | None:
        try:
            return self.ctx.catalog.topic_queues(topic)
        except Exception:  # noqa: BLE001 - a deleted topic has no queues
            return None

    # --- commits and errors ---------------------------------------------------------------
    def commit(self, attempt: Callable[[], R], *, what: str) -> R:
        return self.ctx.commit(attempt, what=what)

    @contextmanager
    def named(self) -> Iterator[None]:
        """Store faults and damaged files raised inside become errors naming the warehouse."""
        with faults_named(self.ctx.warehouse):
            yield

    def before_pull(self) -> None:
        self.ctx.engine.recycle_if_large(self.ctx.config.embedded_max_rss_mb)

    # --- clients --------------------------------------------------------------------------
    def heartbeat(self, group: str, client: str, now: int) -> None:
        ref = self.ctx.warehouse.ref("clients")
        statement = (
            f"MERGE INTO {ref} t USING (SELECT {sql_str(group)} AS consumer_group, "
            f"{sql_str(client)} AS client_id, {sql_long(now)} AS first_seen_ts, "
            f"{sql_long(now)} AS last_seen_ts) s "
            "ON t.consumer_group = s.consumer_group AND t.client_id = s.client_id "
            "WHEN MATCHED THEN UPDATE SET t.last_seen_ts = greatest(t.last_seen_ts, s.last_seen_ts) "
            "WHEN NOT MATCHED THEN INSERT *"
        )
        self.commit(lambda: self.ctx.engine.execute(statement), what="clients")

    def leave(self, group: str, client: str) -> None:
        statement = (
            f"DELETE FROM {self.ctx.warehouse.ref('clients')} WHERE consumer_group = {sql_str(group)} "
            f"AND client_id = {sql_str(client)}"
        )
        self.commit(lambda: self.ctx.engine.execute(statement), what="clients")

    def live_clients(self, group: str, since: int) -> list[str]:
        return live_clients(self.ctx, group, since)

    # --- locks ----------------------------------------------------------------------------
    def read_locks(self, group: str) -> dict[Queue, LockEntry | None]:
        return deliveries.read_locks(self.ctx.warehouse, group)

    def write_locks(self, group: str, changes: list[tuple[Queue, LockEntry | None, LockEntry]]) -> None:
        """Compare-and-set of lock rows; the caller commits (:meth:`commit`)."""
        deliveries.write_locks(self.ctx.warehouse, group, changes)

    def ensure_lock_rows(self, group: str, queues: Sequence[Queue]) -> None:
        self.commit(
            partial(deliveries.ensure_lock_rows, self.ctx.warehouse, group, list(queues)), what="queue_lock"
        )

    # --- the index and the log ------------------------------------------------------------
    def heads(self, now: int) -> dict[Queue, int]:
        return visible_heads(self.ctx.warehouse, now)

    def positions(self, group: str, queues: Sequence[Queue]) -> dict[Queue, tuple[int, int]]:
        return deliveries.positions(self.ctx.warehouse, group, queues)

    def handout_rows(
        self, group: str, cfg: GroupConfig, subs: Sequence[Subscription], ranges: Sequence[Range], now: int
    ) -> pa.Table:
        return handout_rows(self.ctx, group, cfg, subs, ranges, now)

    def open_rows(
        self, group: str, *, queues: Iterable[Queue] = (), handles: Iterable[str] = ()
    ) -> list[LogRow]:
        """INFLIGHT rows of ``group`` not ended yet, of ``queues`` or with ``handles``."""
        cond = F.col("consumer_group") == group
        listed = sorted(set(handles))
        if listed:
            cond = cond & deliveries.handles_column(listed)
        else:
            cond = cond & deliveries.queues_column(queues)
        rows = deliveries.open_rows(self.ctx.warehouse, cond)
        if not listed:
            return rows
        wanted = set(listed)
        return [r for r in rows if r[6] in wanted]

    def append_log(self, rows: list[LogRow]) -> None:
        self.commit(partial(deliveries.append, self.ctx.warehouse, rows), what="deliveries")

    def record_keys(self, group: str, cfg: GroupConfig, acked: list[dict[str, Any]], now: int) -> None:
        """Keys of acknowledged messages (docs/behaviour.md §7), from their consume_queue rows."""
        rows = (
            self.ctx.warehouse.read("consume_queue")
            .where(deliveries.at_offsets(acked))
            .select(dedup.key_column(cfg.dedup_key or "").alias("k"), "msg_id")
            .collect()
        )
        dedup.record(
            self.ctx.warehouse,
            [(group, r["k"], r["msg_id"]) for r in rows],
            now,
            policy=self.ctx.config.commit_policy,
        )

    def nack(self, rows: list[LogRow], level: int) -> None:
        """Nacked deliveries: sent back to the retry / DLQ path now, then ended (NACKED)."""
        pull_expiry.send_back(self.ctx, [deliveries.as_dict(r) for r in rows], level, "nack")
        if rows:
            self.append_log([deliveries.ended(r, "NACKED") for r in rows])


def live_clients(ctx: Context, group: str, since: int) -> list[str]:
    """Clients of ``group`` seen at ``since`` or later."""
    found = files.rows(
        ctx.warehouse,
        "clients",
        ["client_id"],
        (pc.field("consumer_group") == group) & (pc.field("last_seen_ts") >= since),
    )
    if found is not None:
        return sorted(set(found.column("client_id").to_pylist()))
    rows = (
        ctx.warehouse.read("clients")
        .where((F.col("consumer_group") == group) & (F.col("last_seen_ts") >= F.lit(since)))
        .select("client_id")
        .collect()
    )
    return sorted({r["client_id"] for r in rows})
