"""The pull protocol's tables without an engine: the store of ``deltamq.lite.PullConsumer``.

Reads come from the tables' files through kept snapshots (deltamq/delta_read.py,
deltamq/file_reads.py); the deliveries log is appended to by
:class:`deltamq.delta_append.BlindAppender`. Lock rows are changed by compare-and-set
of their files (:meth:`FileStore._rewrite`: committed at the version after the one
read, or not at all), client rows by delta-rs ``MERGE``s, whose conflict checker
refuses a commit when another writer changed the files it read: either way a race with
the broker's engine or another client is retried from a fresh read, never lost. Same tables, same
rows and the same protocol (deltamq/pull.py) as ``Broker.pull_consumer``'s store.

What needs an engine is refused with an error saying so: groups with a
de-duplication key and SQL92 subscriptions (use ``Broker.pull_consumer``). A nack is
recorded as a request that the broker's next tick carries out (``NACK_REQUESTED``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from deltamq import file_reads
from deltamq.clock import Clock
from deltamq.config import BrokerConfig, GroupConfig, Subscription
from deltamq.constants import NACK_REQUESTED
from deltamq.delta_append import BlindAppender, Unsupported
from deltamq.delta_read import DataFile, FileSnapshot
from deltamq.errors import ConfigError, DeltaMQError, StorageError
from deltamq.pull_log import (
    LOCK_COLUMNS,
    LockEntry,
    LogRow,
    Queue,
    lock_entries,
    log_table,
    positions_of,
    still_open,
    summarise,
)
from deltamq.storage import Storage, is_transient, merge_rows_into, retry_commits

R = TypeVar("R")

_ENGINE_ONLY = 'needs the broker\'s engine: use Broker.pull_consumer (pip install "deltamq[broker]")'


class FileStore:
    """What a Spark-free pull client reads and writes, in the warehouse at ``storage``."""

    def __init__(self, storage: Storage, config: BrokerConfig, clock: Clock) -> None:
        self.storage = storage
        self.config = config
        self.clock = clock
        self._snapshots: dict[str, FileSnapshot] = {}
        self._log = BlindAppender(storage, storage.join("deliveries"), engine_info="deltamq-lite-pull")
        self._tables: dict[str, Any] = {}  # delta-rs tables kept for MERGEs
        self._writers: dict[str, BlindAppender] = {}  # control tables changed by _rewrite
        self._merged: set[str] = set()  # tables _rewrite cannot write: changed by MERGE
        self._clients: dict[str, tuple[int, list[tuple[str, int | None]]]] = {}  # per group, at a version

    # --- reading --------------------------------------------------------------------------
    def snapshot(self, table: str) -> FileSnapshot:
        snap = self._snapshots.get(table)
        if snap is None:
            snap = self._snapshots[table] = FileSnapshot(self.storage, self.storage.join(table))
        try:
            snap.refresh()
        except Unsupported as e:
            raise ConfigError(f"reading {table} {_ENGINE_ONLY}: {e}") from e
        return snap

    def _rows(
        self, table: str, where: pc.Expression | None, columns: Sequence[str] | None = None
    ) -> list[dict]:
        snap = self.snapshot(table)
        names = list(columns) if columns is not None else snap.column_names
        return snap.read(snap.files(), names, where).to_pylist()

    # --- the catalog ----------------------------------------------------------------------
    def group(self, name: str) -> GroupConfig | None:
        rows = self._rows("group_config", pc.field("consumer_group") == name)
        if not rows:
            return None
        cfg = GroupConfig.from_row(rows[0])
        if cfg.dedup_key:
            raise ConfigError(
                f"group {name!r} de-duplicates by key {cfg.dedup_key!r}; pulling it {_ENGINE_ONLY}"
            )
        return cfg

    def group_names(self) -> list[str]:
        return sorted(r["consumer_group"] for r in self._rows("group_config", None, ["consumer_group"]))

    def listens(self, group: str) -> bool:
        return False  # push listeners are registered in a broker's process, not here

    def subscriptions(self, group: str) -> list[Subscription]:
        rows = self._rows(
            "subscription",
            pc.field("consumer_group") == group,
            ["consumer_group", "topic", "expr_type", "expression"],
        )
        return sorted((Subscription.from_row(r) for r in rows), key=lambda s: s.topic)

    def topic_queues(self, topic: str) -> int | None:
        rows = self._rows("topic_config", pc.field("topic") == topic, ["queues"])
        return int(rows[0]["queues"]) if rows else None

    # --- commits and errors ---------------------------------------------------------------
    def commit(self, attempt: Callable[[], R], *, what: str) -> R:
        """``attempt`` again (from a fresh read) while delta-rs' conflict checker refuses
        its commit or the store fails transiently, as ``commit_retries`` and
        ``commit_backoff_ms`` say."""

        def give_up(e: Exception, exhausted: bool) -> BaseException:
            if not exhausted:
                return e
            return StorageError(
                f"{what}: the commit was refused {self.config.commit_policy.retries + 1} times by "
                f"concurrent writers or the store at {self.storage.location}: {e}"
            )

        return retry_commits(attempt, self.config.commit_policy, give_up)

    @contextmanager
    def named(self) -> Iterator[None]:
        """A transient store fault raised inside becomes a StorageError naming the warehouse."""
        try:
            yield
        except Exception as e:
            if isinstance(e, DeltaMQError) or not is_transient(e):
                raise
            raise self.storage.error(
                "read from or write to the warehouse at", self.storage.location, e
            ) from e

    def before_pull(self) -> None:
        return None

    def _table(self, table: str) -> Any:
        """delta-rs' table, kept and brought up to date (a MERGE starts from the latest)."""
        dt = self._tables.get(table)
        if dt is None:
            dt = self._tables[table] = self.storage.delta_table(self.storage.join(table))
        else:
            dt.update_incremental()
        return dt

    def _merge(self, table: str, source: pa.Table, on: str) -> Any:
        return merge_rows_into(self._table(table), source, on)

    # --- clients --------------------------------------------------------------------------
    def heartbeat(self, group: str, client: str, now: int) -> None:
        source = pa.table(
            {
                "consumer_group": [group],
                "client_id": [client],
                "first_seen_ts": pa.array([now], pa.int64()),
                "last_seen_ts": pa.array([now], pa.int64()),
            }
        )
        on = "t.consumer_group = s.consumer_group AND t.client_id = s.client_id"

        def attempt() -> None:
            later = "CASE WHEN s.last_seen_ts > t.last_seen_ts THEN s.last_seen_ts ELSE t.last_seen_ts END"
            merge = self._merge("clients", source, on).when_matched_update({"last_seen_ts": later})
            merge.when_not_matched_insert_all().execute()

        self.commit(attempt, what="clients")

    def leave(self, group: str, client: str) -> None:
        where = f"consumer_group = {_text(group)} AND client_id = {_text(client)}"
        self.commit(lambda: self._table("clients").delete(where), what="clients")

    def live_clients(self, group: str, since: int) -> list[str]:
        """The group's clients seen at ``since`` or later; the table's rows of the group are
        read again only when it has a new version (every pull asks)."""
        snap = self.snapshot("clients")
        known = self._clients.get(group)
        if known is None or known[0] != snap.version:
            rows = snap.read(snap.files(), ["client_id", "last_seen_ts"], pc.field("consumer_group") == group)
            seen = zip(
                rows.column("client_id").to_pylist(), rows.column("last_seen_ts").to_pylist(), strict=True
            )
            known = self._clients[group] = (snap.version, list(seen))
        return sorted({client for client, ts in known[1] if ts is not None and ts >= since})

    # --- locks ----------------------------------------------------------------------------
    def read_locks(self, group: str) -> dict[Queue, LockEntry | None]:
        return lock_entries(self._rows("queue_lock", pc.field("consumer_group") == group, LOCK_COLUMNS))

    def write_locks(self, group: str, changes: list[tuple[Queue, LockEntry | None, LockEntry]]) -> None:
        """Compare-and-set: each (existing) row changes only if it still is what was read;
        the caller commits (:meth:`commit`). The files holding the changed rows are
        written again, with them changed, in one commit at the version after the one
        read, or none (:meth:`_rewrite`); a table that writer cannot write (its protocol)
        gets a delta-rs ``MERGE`` of the same rule."""
        wanted = {q: (old, new) for q, old, new in changes if old != new}
        if not wanted:
            return

        def change(row: dict[str, Any]) -> dict[str, Any] | None:
            old, new = wanted[(row["topic"], row["queue_id"])]
            expected = (old.owner, old.last_access_ts) if old else (None, None)
            if (row["owner"], row["last_access_ts"]) != expected:
                return None  # another writer's change came first: this row stays as it is
            return {**row, **_lock_values(new)}

        if "queue_lock" not in self._merged:
            try:
                self._rewrite("queue_lock", group, set(wanted), change)
                return
            except Unsupported:
                self._merged.add("queue_lock")  # from now on by MERGE
        self._merge_locks(group, wanted)

    def _merge_locks(self, group: str, wanted: dict[Queue, tuple[LockEntry | None, LockEntry]]) -> None:
        """:meth:`write_locks`' rule as a delta-rs ``MERGE`` (its conflict checker refuses
        the commit when another writer changed the files it read)."""
        items = sorted(wanted.items())
        olds = [old for _, (old, _) in items]
        news = [_lock_values(new) for _, (_, new) in items]
        source = pa.table(
            {
                "consumer_group": [group] * len(items),
                "topic": [t for (t, _), _ in items],
                "queue_id": pa.array([q for (_, q), _ in items], pa.int32()),
                "exp_owner": pa.array([o.owner if o else None for o in olds], pa.string()),
                "exp_access": pa.array([o.last_access_ts if o else None for o in olds], pa.int64()),
                **{c: pa.array([values[c] for values in news], _LOCK_TYPES[c]) for c in LOCK_COLUMNS[2:]},
            }
        )
        merge = self._merge("queue_lock", source, _SAME_QUEUE)
        merge.when_matched_update(
            {c: f"s.{c}" for c in LOCK_COLUMNS[2:]},
            predicate="(t.owner IS NOT DISTINCT FROM s.exp_owner) "
            "AND (t.last_access_ts IS NOT DISTINCT FROM s.exp_access)",
        ).execute()

    def _rewrite(
        self,
        table: str,
        group: str,
        queues: set[Queue],
        change: Callable[[dict[str, Any]], dict[str, Any] | None],
    ) -> None:
        """The rows of ``group``'s ``queues`` in ``table`` (a control table of a few
        rows a group and queue) through ``change`` (None: that row unchanged): the files
        holding a changed row are replaced by one file of their rows, changed, committed
        at the version after the snapshot's, or refused (``VersionTaken``: another writer
        came between, and :meth:`commit` runs the attempt again from a fresh read).
        Every live file is looked at (small, decoded once and kept), not only those
        whose statistics allow the rows: a writer's string statistics may be truncated.
        A delta-rs ``MERGE`` costs 20 ms alone and 100+ ms beside other clients on two
        cores (it plans a query); this reads what is decoded already and writes one file."""
        snap = self.snapshot(table)
        read_at = snap.version  # before the files: a refresh in between only makes it stale
        replaced: list[DataFile] = []
        rows: list[dict[str, Any]] = []
        schema: pa.Schema | None = None
        for f in snap.files():
            data = snap.whole(f)
            kept, changed = data.to_pylist(), False
            for i, row in enumerate(kept):
                if row["consumer_group"] == group and (row["topic"], row["queue_id"]) in queues:
                    new = change(row)
                    if new is not None and new != row:
                        kept[i], changed = new, True
            if changed:
                replaced.append(f)
                rows.extend(kept)
                schema = data.schema
        if not replaced:
            return
        assert schema is not None
        self._writer(table).replace(
            replaced,
            pa.Table.from_pylist(rows, schema=schema),
            at=read_at + 1,
            operation=("UPDATE", {"predicate": f"compare-and-set of {len(queues)} rows of group {group}"}),
        )

    def _writer(self, table: str) -> BlindAppender:
        writer = self._writers.get(table)
        if writer is None:
            writer = self._writers[table] = BlindAppender(
                self.storage, self.storage.join(table), engine_info="deltamq-lite-pull"
            )
        return writer

    def ensure_lock_rows(self, group: str, queues: Sequence[Queue]) -> None:
        """Ownerless lock rows for ``queues`` that have none (deltamq/tables/deliveries.py):
        appended in one commit at the version after the one read, or none (another writer
        came between: :meth:`commit` reads again, and finds the rows a racing client added).
        Four clients starting together each ran a delta-rs ``MERGE`` here (80-110 ms beside
        each other on two cores); the conditional append takes a few ms. A table the
        appender cannot write gets the ``MERGE``."""
        if not queues:
            return
        ordered = sorted(set(queues))
        if "queue_lock" not in self._merged:
            try:
                self.commit(lambda: self._insert_lock_rows(group, ordered), what="queue_lock")
                return
            except Unsupported:
                self._merged.add("queue_lock")
        source = pa.table(
            {
                "consumer_group": [group] * len(ordered),
                "topic": [t for t, _ in ordered],
                "queue_id": pa.array([q for _, q in ordered], pa.int32()),
            }
        )
        values = {
            "consumer_group": "s.consumer_group",
            "topic": "s.topic",
            "queue_id": "s.queue_id",
            "no_change_count": "CAST(0 AS INT)",
        }
        self.commit(
            lambda: self._merge("queue_lock", source, _SAME_QUEUE).when_not_matched_insert(values).execute(),
            what="queue_lock",
        )

    def _insert_lock_rows(self, group: str, queues: list[Queue]) -> None:
        snap = self.snapshot("queue_lock")
        read_at = snap.version  # before the rows: a refresh in between only makes it stale
        found = snap.read(snap.files(), ["topic", "queue_id"], pc.field("consumer_group") == group)
        topics, ids_ = found.column("topic").to_pylist(), found.column("queue_id").to_pylist()
        present = set(zip(topics, ids_, strict=True))
        missing = [q for q in queues if q not in present]
        if not missing:
            return
        schema = snap.read([], snap.column_names).schema
        rows = pa.Table.from_pylist(
            [{"consumer_group": group, "topic": t, "queue_id": q, "no_change_count": 0} for t, q in missing],
            schema=schema,
        )
        self._writer("queue_lock").replace(
            [],
            rows,
            at=read_at + 1,
            operation=("MERGE", {"predicate": f"lock rows of {len(missing)} queues of {group} where none"}),
        )

    # --- the index and the log ------------------------------------------------------------
    def heads(self, now: int) -> dict[Queue, int]:
        found, ahead = file_reads.heads(self), file_reads.not_due(self, now)
        assert found is not None and ahead is not None  # snapshot() raises rather than answer None
        return file_reads.clamped(found, ahead)

    def _log_rows(self, where: pc.Expression, queues: Iterable[Queue] | None = None) -> list[LogRow]:
        found = file_reads.log_rows(self, where, queues=queues)
        assert found is not None  # snapshot() raises rather than answer None
        return found

    def positions(self, group: str, queues: Sequence[Queue]) -> dict[Queue, tuple[int, int]]:
        """(acknowledged, delivered) per queue: the log read first, then the stored offsets
        (the fold writes offsets before it deletes log rows)."""
        where = (pc.field("consumer_group") == group) & file_reads.queues_filter(queues)
        found = file_reads.log_table(self, where, queues=queues)
        assert found is not None  # snapshot() raises rather than answer None
        logs = summarise(found)
        stored = {
            (group, r["topic"], r["queue_id"]): (r["next_offset"] or 0, r["delivered_offset"])
            for r in self._rows(
                "offsets",
                (pc.field("consumer_group") == group) & (pc.field("client_id") == ""),
                ["topic", "queue_id", "next_offset", "delivered_offset"],
            )
        }
        return positions_of(group, logs, stored, queues)

    def handout_rows(
        self,
        group: str,
        cfg: GroupConfig,
        subs: Sequence[Subscription],
        ranges: Sequence[tuple[str, int, int, int]],
        now: int,
    ) -> pa.Table:
        sql = [s.topic for s in subs if s.expr_type == "SQL92"]
        if sql:
            raise ConfigError(
                f"group {group!r} subscribes to {', '.join(sql)} by SQL92; pulling it {_ENGINE_ONLY}"
            )
        rows = file_reads.handout_rows(self, subs, ranges)
        assert rows is not None  # snapshot() raises rather than answer None
        return rows

    def open_rows(
        self, group: str, *, queues: Iterable[Queue] = (), handles: Iterable[str] = ()
    ) -> list[LogRow]:
        """INFLIGHT rows of ``group`` not ended yet, of ``queues`` or with ``handles``."""
        wanted = sorted(set(handles))
        if wanted:
            where = (pc.field("receipt_handle") >= wanted[0]) & (pc.field("receipt_handle") <= wanted[-1])
            rows = self._log_rows((pc.field("consumer_group") == group) & where)
            chosen = set(wanted)
            return still_open(r for r in rows if r[6] in chosen)
        of = list(queues)
        where = (pc.field("consumer_group") == group) & file_reads.queues_filter(of)
        return still_open(self._log_rows(where, of))

    def append_log(self, rows: list[LogRow]) -> None:
        self._log.append(log_table(rows))

    def record_keys(self, group: str, cfg: GroupConfig, acked: list[dict[str, Any]], now: int) -> None:
        raise ConfigError(f"group {group!r} de-duplicates by key; acknowledging it {_ENGINE_ONLY}")

    def nack(self, rows: list[LogRow], level: int) -> None:
        """A request per delivery, carried out by the broker's next tick: sent back at
        ``level`` (deltamq/jobs/pull_expiry.py), then ended NACKED."""
        if rows:
            self.append_log([(*r[:8], level, NACK_REQUESTED) for r in rows])


_SAME_QUEUE = "t.consumer_group = s.consumer_group AND t.topic = s.topic AND t.queue_id = s.queue_id"
_LOCK_TYPES = {
    "owner": pa.string(),
    "last_access_ts": pa.int64(),
    "last_delivered_offset": pa.int64(),
    "no_change_count": pa.int32(),
    "delivered_offset": pa.int64(),
}


def _lock_values(entry: LockEntry) -> dict[str, Any]:
    """A lock row's values (:data:`LOCK_COLUMNS` after the queue: ``LockEntry``'s
    fields) for ``entry``."""
    return {c: getattr(entry, c) for c in LOCK_COLUMNS[2:]}


def _text(value: str) -> str:
    """A SQL string literal (delta-rs predicates)."""
    return "'" + value.replace("'", "''") + "'"
