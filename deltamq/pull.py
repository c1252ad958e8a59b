"""Pull consumers: consumers outside the engine (docs/behaviour.md §6).

``consumer = ctx.pull_consumer(group, client_id)``; ``consumer.pull(n)`` returns
messages, each with a ``receipt_handle``; ``consumer.ack(handles)`` /
``consumer.nack(handles, delay_level=None)`` end them.

- **Liveness and rebalancing.** Every pull or ack records the client in ``clients``. Per
  subscribed topic (its retry topic included), the group's live clients (seen within
  ``client_timeout_ms``) and the topic's queues are both sorted and the queues divided
  evenly (RocketMQ's rebalanceByTopic with AllocateMessageQueueAveragely): a client
  pulls only its share.
- **Access lock** (DeFiBus's ConsumeQueueAccessLockManager, ``queue_lock``). The owner's
  pulls refresh its last access and the delivered offset it saw. Anyone else is refused
  while the owner holds the queue; each refused attempt compares the queue's delivered
  offset with the one last seen (unchanged → the no-change counter goes up; changed →
  saved, counter reset); the owner's pulls never touch the counter. A non-owner takes the
  queue only when the owner timed out (``lock_queue_timeout_ms``) or everything
  delivered was acknowledged and the counter reached
  ``max_deliver_offset_no_change_times``; it then starts at the acknowledged offset.
  Lock rows change by compare-and-set MERGE and are read back: of racing clients
  exactly one wins.
- **In flight.** ``deliveries`` holds the messages handed out and not yet acknowledged
  (acked rows are deleted, so it stays small). Per queue, ``offsets.next_offset`` is the
  acknowledged offset — the lowest offset still in flight, so acks may come in any order
  — and ``offsets.delivered_offset`` the next offset to hand out. A delivery not acked
  within the group's ``invisible_time_ms`` counts as RECONSUME_LATER (the tick's
  ``pull_expiry`` step); a nack likewise, now: both take the push consumers' retry / DLQ
  path (``%RETRY%<group>`` with back-off, ``%DLQ%<group>`` at the maximum).

Delivery is at-least-once: a client killed between handing out and recording, or a
takeover after the owner timed out, can repeat messages (idempotent consumption and
exactly-once sinks deal with that). One client id is one puller: two threads pulling
under one id share its queues.
"""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F

from deltamq import dedup, faults
from deltamq.errors import CommitConflict, ConfigError, UnknownGroup
from deltamq.filters import subscriptions_filter
from deltamq.message import StoredMessage, stored_fields, validate_group_name
from deltamq.tables.bodies import join_bodies, read_bodies
from deltamq.tables.offsets import OffsetsMerge, forward, load_dispatch_state, source
from deltamq.tables.ranges import queue_offsets, queue_ranges
from deltamq.tables.sqltext import sql_int, sql_long, sql_queues, sql_str

if TYPE_CHECKING:
    from deltamq.context import Context

Queue = tuple[str, int]


@dataclass(frozen=True)
class PulledMessage(StoredMessage):
    """A pulled message: ack or nack it by ``receipt_handle``."""

    receipt_handle: str = ""


# --- rebalancing (pure) ---------------------------------------------------------------------
def allocate_averagely(queues: Sequence[Queue], clients: Sequence[str], me: str) -> list[Queue]:
    """RocketMQ's AllocateMessageQueueAveragely: both lists sorted, ``me``'s contiguous
    share (the first ``len(queues) % len(clients)`` clients get one more)."""
    mqs, cids = sorted(queues), sorted(set(clients))
    if me not in cids or not mqs:
        return []
    index, n, k = cids.index(me), len(mqs), len(cids)
    mod = n % k
    if n <= k:
        size = 1
    elif mod > 0 and index < mod:
        size = n // k + 1
    else:
        size = n // k
    start = index * size if mod > 0 and index < mod else index * size + mod
    return [mqs[(start + i) % n] for i in range(max(0, min(size, n - start)))]


def assign(queues: Sequence[Queue], clients: Sequence[str], me: str) -> list[Queue]:
    """``me``'s queues: per topic (RocketMQ's rebalanceByTopic), its averagely share."""
    by_topic: dict[str, list[Queue]] = defaultdict(list)
    for q in queues:
        by_topic[q[0]].append(q)
    return sorted(q for qs in by_topic.values() for q in allocate_averagely(qs, clients, me))


# --- the access lock (pure) -----------------------------------------------------------------
@dataclass(frozen=True)
class LockEntry:
    owner: str
    last_access_ts: int
    last_delivered_offset: int  # the delivered offset last seen (the no-change counter's reference)
    no_change_count: int = 0
    delivered_offset: int | None = None  # the end of the owner's last reserved range


_NOBODY = LockEntry("", 0, 0)


def decide_lock(
    entry: LockEntry | None,
    me: str,
    now: int,
    delivered: int,
    acked: int,
    *,
    timeout_ms: int,
    max_no_change: int,
) -> tuple[str, LockEntry]:
    """docs/behaviour.md §6 for one pull attempt of ``me``: ("acquired" | "owner" | "refused", the
    entry to store)."""
    if entry is None:
        return "acquired", LockEntry(me, now, delivered, 0, delivered)
    if entry.owner == me:
        return "owner", LockEntry(me, now, delivered, entry.no_change_count, entry.delivered_offset)
    if delivered == entry.last_delivered_offset:
        count, seen = entry.no_change_count + 1, entry.last_delivered_offset
    else:
        count, seen = 0, delivered
    hold_timeout = now - entry.last_access_ts > timeout_ms
    if hold_timeout or (delivered == acked and count >= max_no_change):
        return "acquired", LockEntry(me, now, delivered, 0, entry.delivered_offset)
    return "refused", LockEntry(entry.owner, entry.last_access_ts, seen, count, entry.delivered_offset)


# --- the consumer ---------------------------------------------------------------------------
class PullConsumer:
    """A pull client of one CLUSTERING group."""

    def __init__(self, ctx: Context, group: str, client_id: str) -> None:
        self.ctx = ctx
        self.group = validate_group_name(group)
        self.client_id = validate_group_name(client_id, "client id")
        cfg = ctx.catalog.groups().get(self.group)
        if cfg is None:
            raise UnknownGroup(f"consumer group {self.group!r} does not exist; create it first")
        if cfg.mode != "CLUSTERING":
            raise ConfigError(
                f"group {self.group!r} is {cfg.mode}; pull consumers share a CLUSTERING group's "
                "queues (a BROADCASTING group is consumed by push instances)"
            )
        if cfg.listener or self.group in ctx.catalog.listeners:
            raise ConfigError(
                f"group {self.group!r} has a push listener; a queue is consumed by push or by pull "
                "clients, not both: create a separate group for pull clients"
            )
        if cfg.sink_table:
            raise ConfigError(
                f"group {self.group!r} is a sink into {cfg.sink_table}; create a separate group for "
                "pull clients"
            )
        self._cfg = cfg
        self._taken_over: set[Queue] = set()
        self._seen: int | None = None  # the last heartbeat this client committed

    # --- helpers ------------------------------------------------------------------------------
    def _now(self, now: int | None) -> int:
        return self.ctx.clock.now_ms() if now is None else int(now)

    def _ref(self, table: str) -> str:
        return self.ctx.warehouse.ref(table)

    def _keep_alive(self, now: int) -> None:
        """A heartbeat when a quarter of ``client_timeout_ms`` has passed since the last
        one (pulls and acks call it): a busy client stays live without a commit a call."""
        if (
            self._seen is None
            or now - self._seen >= self.ctx.config.client_timeout_ms // 4
            or now < self._seen
        ):
            self.heartbeat(now)

    def heartbeat(self, now: int | None = None) -> None:
        """Record this client as alive now."""
        now = self._now(now)
        statement = (
            f"MERGE INTO {self._ref('clients')} t USING (SELECT {sql_str(self.group)} AS consumer_group, "
            f"{sql_str(self.client_id)} AS client_id, {sql_long(now)} AS first_seen_ts, "
            f"{sql_long(now)} AS last_seen_ts) s "
            "ON t.consumer_group = s.consumer_group AND t.client_id = s.client_id "
            "WHEN MATCHED THEN UPDATE SET t.last_seen_ts = greatest(t.last_seen_ts, s.last_seen_ts) "
            "WHEN NOT MATCHED THEN INSERT *"
        )
        self.ctx.engine.commit(lambda: self.ctx.engine.execute(statement), what="clients")
        self._seen = now

    def close(self) -> None:
        """Leave the group now (instead of after the client timeout)."""
        statement = (
            f"DELETE FROM {self._ref('clients')} WHERE consumer_group = {sql_str(self.group)} "
            f"AND client_id = {sql_str(self.client_id)}"
        )
        self.ctx.engine.commit(lambda: self.ctx.engine.execute(statement), what="clients")
        self._seen = None

    def assignment(self, now: int | None = None) -> list[Queue]:
        """The queues this client may pull now: per subscribed topic (as RocketMQ's
        rebalanceByTopic), its share of the topic's queues among the live clients."""
        return assign(group_queues(self.ctx, self.group), self._live(self._now(now)), self.client_id)

    def _live(self, now: int) -> list[str]:
        return live_clients(self.ctx, self.group, now) + [self.client_id]

    # --- pulling ------------------------------------------------------------------------------
    def pull(self, max_messages: int = 32, now: int | None = None) -> list[PulledMessage]:
        """Up to ``max_messages`` messages from this client's queues, each invisible to
        every other client until acked, nacked or ``invisible_time_ms`` has passed."""
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ConfigError(f"max_messages={max_messages!r} must be an integer >= 1")
        now = self._now(now)
        self.ctx.engine.recycle_if_large()
        self._keep_alive(now)
        mine = self.assignment(now)
        if not mine:
            return []

        heads = load_dispatch_state(self.ctx.warehouse).heads
        takes = self._lock(mine, now, heads, max_messages)
        faults.point("pull.after_lock_commit")
        if not takes:
            return []
        ranges = [(t, q, lo, hi) for (t, q), (lo, hi) in sorted(takes.items()) if hi > lo]
        messages = self._read(ranges, now) if ranges else []
        # fence: a client that lost the queue meanwhile (it paused past the lock timeout)
        # records nothing; what it read is handed out again by the new owner
        current = read_locks(self.ctx, self.group)
        mine_still = {q for q in takes if (current.get(q) or _NOBODY).owner == self.client_id}
        messages = [m for m in messages if m.topic_queue in mine_still]
        if messages:
            self._record(messages, now)
        faults.point("pull.after_deliveries_commit")
        # recorded through the end of each range (a queue just taken over: from its acked offset)
        set_positions(
            self.ctx,
            self.group,
            {q: takes[q][1] for q in sorted(mine_still)},
            now,
            restart=self._taken_over & mine_still,
        )
        faults.point("pull.after_offsets_commit")
        return [m.message for m in sorted(messages, key=lambda m: (m.topic_queue, m.message.queue_offset))]

    def _lock(
        self, mine: list[Queue], now: int, heads: dict[Queue, int], budget: int
    ) -> dict[Queue, tuple[int, int]]:
        """Take or refresh the access lock of ``mine`` and reserve the ranges to hand out,
        in one compare-and-set of the lock rows; returns {queue: (start, end)} of the
        queues this client holds. The owner starts where its deliveries are recorded
        (``offsets.delivered_offset``: a range reserved by a pull killed before recording
        is handed out again); a new owner at the acknowledged offset."""
        engine = self.ctx.engine
        cfg = self.ctx.config
        result: dict[Queue, tuple[int, int]] = {}
        taken_over: dict[Queue, int] = {}

        def attempt() -> None:
            result.clear()
            taken_over.clear()
            locks = read_locks(self.ctx, self.group)
            positions = read_positions(self.ctx, self.group)
            changes = []
            ranges: dict[Queue, tuple[int, int]] = {}
            left = budget
            for q in mine:
                acked, recorded = positions.get(q, (0, None))
                recorded = acked if recorded is None else recorded
                entry = locks.get(q)
                reserved = (
                    entry.delivered_offset if entry and entry.delivered_offset is not None else recorded
                )
                verdict, new = decide_lock(
                    entry,
                    self.client_id,
                    now,
                    reserved,
                    acked,
                    timeout_ms=cfg.lock_queue_timeout_ms,
                    max_no_change=cfg.max_deliver_offset_no_change_times,
                )
                if verdict != "refused":
                    start = acked if verdict == "acquired" else recorded
                    end = max(start, min(heads.get(q, 0), start + max(left, 0)))
                    left -= end - start
                    ranges[q] = (start, end)
                    new = replace(new, last_delivered_offset=end, delivered_offset=end)
                    if verdict == "acquired" and entry is not None:
                        taken_over[q] = acked
                changes.append((q, entry, new))
            write_locks(self.ctx, self.group, changes)
            mine_now = read_locks(self.ctx, self.group)
            for q, (start, end) in ranges.items():
                got = mine_now.get(q)
                if (
                    got is not None
                    and got.owner == self.client_id
                    and got.last_access_ts == now
                    and got.delivered_offset == end
                ):
                    result[q] = (start, end)

        if any(q not in read_locks(self.ctx, self.group) for q in mine):
            ensure_lock_rows(self.ctx, self.group, mine)
        engine.commit(attempt, what="queue_lock")
        taken_over = {q: s for q, s in taken_over.items() if q in result}
        self._taken_over = set(taken_over)
        if taken_over:
            # the previous owner's in-flight messages are handed out again from the acked offset
            revoke(self.ctx, self.group, taken_over, self.client_id)
        return result

    def _read(self, takes: list[tuple[str, int, int, int]], now: int) -> list[_Handout]:
        wh = self.ctx.warehouse
        matches = subscriptions_filter(self.ctx.catalog.subscriptions(self.group), default=True)
        cq = wh.read("consume_queue").where(queue_ranges(takes))
        cq = cq.withColumn("matched", matches).where(F.col("matched"))
        # idempotent consumption: a key the group consumed within its window is skipped
        # (treated as acknowledged: never in flight, the acked offset passes it)
        cq = dedup.mark(
            wh, cq.withColumn("consumer_group", F.lit(self.group)), {self.group: self._cfg}, now
        ).where(~F.col("dup"))
        index = cq.select("cl_date", "cl_batch_id").distinct().collect()
        if not index:
            return []
        bodies = read_bodies(wh, (r["cl_date"] for r in index), (r["cl_batch_id"] for r in index))
        rows = join_bodies(
            cq.drop("properties", "born_ts"), bodies, ["body", "born_ts", "flag", "sys_flag", "properties"]
        )
        out = []
        for r in rows.collect():
            d = r.asDict()
            msg = PulledMessage(**stored_fields(d), receipt_handle=secrets.token_hex(12))
            out.append(_Handout(msg, (d["topic"], d["queue_id"]), d["msg_id"], d["reconsume_times"] or 0))
        return out

    def _record(self, messages: list[_Handout], now: int) -> None:
        invisible = now + self._cfg.invisible_time_ms
        rows = [
            (
                self.group,
                self.client_id,
                m.topic_queue[0],
                m.topic_queue[1],
                m.message.queue_offset,
                m.stored_id,
                m.message.receipt_handle,
                now,
                invisible,
                "INFLIGHT",
            )
            for m in messages
        ]
        df = self.ctx.engine.spark.createDataFrame(
            rows,
            "consumer_group string, client_id string, topic string, queue_id int, queue_offset bigint, "
            "msg_id string, receipt_handle string, delivered_ts bigint, invisible_until bigint, state string",
        )
        self.ctx.engine.commit(lambda: self.ctx.warehouse.append("deliveries", df), what="deliveries")

    # --- acknowledging ------------------------------------------------------------------------
    def ack(self, handles: Iterable[str], now: int | None = None) -> int:
        """Acknowledge messages (any order). Returns how many handles were in flight; a
        handle that expired, was nacked or revoked by a takeover is not counted."""
        now = self._now(now)
        handles = _handles(handles)
        if not handles:
            return 0
        self._keep_alive(now)
        found = end_deliveries(self.ctx, self.group, handles)
        if self._cfg.dedup_key and found:
            self._record_keys(found, now)
        set_positions(self.ctx, self.group, {}, now, queues={(r["topic"], r["queue_id"]) for r in found})
        return len(found)

    def _record_keys(self, acked: list[dict[str, Any]], now: int) -> None:
        """Keys of acknowledged messages (docs/behaviour.md §7), from their consume_queue rows."""
        rows = (
            self.ctx.warehouse.read("consume_queue")
            .where(_at_offsets(acked))
            .select(dedup.key_column(self._cfg.dedup_key or "").alias("k"), "msg_id")
            .collect()
        )
        dedup.record(self.ctx.warehouse, [(self.group, r["k"], r["msg_id"]) for r in rows], now)

    def nack(self, handles: Iterable[str], delay_level: int | None = None, now: int | None = None) -> int:
        """Give messages back: each is retried through ``%RETRY%<group>`` (level
        ``delay_level``, default 3 + retries; < 0: straight to ``%DLQ%<group>``)."""
        now = self._now(now)
        handles = _handles(handles)
        if not handles:
            return 0
        if delay_level is not None and (isinstance(delay_level, bool) or not isinstance(delay_level, int)):
            raise ConfigError(f"delay_level={delay_level!r} must be an integer or None")
        self._keep_alive(now)
        values = ", ".join(f"({sql_str(h)})" for h in handles)
        rows = read_deliveries(
            self.ctx,
            f"consumer_group = {sql_str(self.group)} AND receipt_handle IN "
            f"(SELECT receipt_handle FROM VALUES {values} AS v(receipt_handle))",
        )
        send_back(self.ctx, rows, delay_level or 0, "nack")
        found = end_deliveries(self.ctx, self.group, [r["receipt_handle"] for r in rows])
        set_positions(self.ctx, self.group, {}, now, queues={(r["topic"], r["queue_id"]) for r in found})
        return len(found)


@dataclass(frozen=True)
class _Handout:
    message: PulledMessage
    topic_queue: Queue
    stored_id: str
    reconsume_times: int


def _at_offsets(rows: Iterable[dict[str, Any]]):
    """consume_queue rows at the (topic, queue, offset) of ``rows`` (deliveries)."""
    return queue_offsets((r["topic"], r["queue_id"], r["queue_offset"]) for r in rows)


def _handles(handles: Iterable[str]) -> list[str]:
    if isinstance(handles, str):
        handles = [handles]
    out = []
    for h in handles:
        if not isinstance(h, str) or not h or not all(c in "0123456789abcdef" for c in h):
            raise ConfigError(f"{h!r} is not a receipt handle (hex text returned by pull)")
        out.append(h)
    return sorted(set(out))


# --- shared reads and writes ----------------------------------------------------------------
def group_queues(ctx: Context, group: str) -> list[Queue]:
    """Every queue of every topic the group subscribes to (its retry topic included)."""
    out = []
    for sub in ctx.catalog.subscriptions(group):
        topic = sub.topic
        try:
            n = ctx.catalog.topic_queues(topic)
        except Exception:  # noqa: BLE001 - a deleted topic has no queues
            continue
        out += [(topic, q) for q in range(n)]
    return sorted(out)


def live_clients(ctx: Context, group: str, now: int) -> list[str]:
    rows = ctx.engine.rows(
        f"SELECT client_id FROM {ctx.warehouse.ref('clients')} WHERE consumer_group = {sql_str(group)} "
        f"AND last_seen_ts >= {sql_long(now - ctx.config.client_timeout_ms)}"
    )
    return sorted(r["client_id"] for r in rows)


def read_locks(ctx: Context, group: str) -> dict[Queue, LockEntry | None]:
    """Lock rows of the group; a queue whose row has no owner maps to None."""
    rows = ctx.engine.rows(
        f"SELECT topic, queue_id, owner, last_access_ts, last_delivered_offset, no_change_count, "
        f"delivered_offset FROM {ctx.warehouse.ref('queue_lock')} WHERE consumer_group = {sql_str(group)}"
    )
    return {
        (r["topic"], r["queue_id"]): None
        if r["owner"] is None
        else LockEntry(
            r["owner"],
            r["last_access_ts"],
            r["last_delivered_offset"] or 0,
            r["no_change_count"] or 0,
            r["delivered_offset"],
        )
        for r in rows
    }


def ensure_lock_rows(ctx: Context, group: str, queues: Iterable[Queue]) -> None:
    """Ownerless lock rows for ``queues`` that have none. Taking a lock is then always an
    update of an existing row: concurrent takers conflict (a non-append commit) or fail
    the compare-and-set, never both insert. Two racing inserts here leave identical
    ownerless rows, which every later update changes together."""
    values = ", ".join(f"({sql_str(group)}, {sql_str(t)}, {q})" for t, q in sorted(queues))
    if not values:
        return
    statement = (
        f"MERGE INTO {ctx.warehouse.ref('queue_lock')} t USING (SELECT * FROM VALUES {values} "
        "AS v(consumer_group, topic, queue_id)) s "
        "ON t.consumer_group = s.consumer_group AND t.topic = s.topic AND t.queue_id = s.queue_id "
        "WHEN NOT MATCHED THEN INSERT (consumer_group, topic, queue_id, owner, last_access_ts, "
        "last_delivered_offset, no_change_count, delivered_offset) VALUES (s.consumer_group, s.topic, "
        "s.queue_id, CAST(NULL AS STRING), CAST(NULL AS BIGINT), CAST(NULL AS BIGINT), 0, "
        "CAST(NULL AS BIGINT))"
    )
    ctx.engine.commit(lambda: ctx.engine.execute(statement), what="queue_lock")


def write_locks(ctx: Context, group: str, changes: list[tuple[Queue, LockEntry | None, LockEntry]]) -> None:
    """Compare-and-set: each (existing, see :func:`ensure_lock_rows`) row changes only if it
    still is what was read."""
    changes = [c for c in changes if c[1] != c[2]]
    if not changes:
        return
    values = ", ".join(
        f"({sql_str(group)}, {sql_str(t)}, {q}, {sql_str(old.owner if old else None)}, "
        f"{sql_long(old.last_access_ts if old else None)}, {sql_str(new.owner)}, "
        f"{sql_long(new.last_access_ts)}, "
        f"{sql_long(new.last_delivered_offset)}, {sql_int(new.no_change_count)}, "
        f"{sql_long(new.delivered_offset)})"
        for (t, q), old, new in changes
    )
    ctx.engine.execute(
        f"MERGE INTO {ctx.warehouse.ref('queue_lock')} t USING (SELECT * FROM VALUES {values} AS v("
        "consumer_group, topic, queue_id, exp_owner, exp_access, owner, last_access_ts, "
        "last_delivered_offset, no_change_count, delivered_offset)) s "
        "ON t.consumer_group = s.consumer_group AND t.topic = s.topic AND t.queue_id = s.queue_id "
        "WHEN MATCHED AND t.owner <=> s.exp_owner AND t.last_access_ts <=> s.exp_access THEN UPDATE SET "
        "t.owner = s.owner, t.last_access_ts = s.last_access_ts, "
        "t.last_delivered_offset = s.last_delivered_offset, t.no_change_count = s.no_change_count, "
        "t.delivered_offset = s.delivered_offset"
    )


def read_positions(ctx: Context, group: str) -> dict[Queue, tuple[int, int | None]]:
    """Per queue: (acknowledged offset, delivered offset or None)."""
    rows = ctx.engine.rows(
        f"SELECT topic, queue_id, next_offset, delivered_offset FROM {ctx.warehouse.ref('offsets')} "
        f"WHERE consumer_group = {sql_str(group)} AND client_id = ''"
    )
    return {(r["topic"], r["queue_id"]): (r["next_offset"] or 0, r["delivered_offset"]) for r in rows}


def read_deliveries(ctx: Context, where: str) -> list[dict[str, Any]]:
    return [
        r.asDict() for r in ctx.engine.rows(f"SELECT * FROM {ctx.warehouse.ref('deliveries')} WHERE {where}")
    ]


def end_deliveries(ctx: Context, group: str, handles: list[str]) -> list[dict[str, Any]]:
    """Remove deliveries from the in-flight set; returns the rows that were there. (A
    MERGE … DELETE joined to the handles: Sail evaluates a long ``IN`` list row by row.)"""
    if not handles:
        return []
    values = ", ".join(f"({sql_str(h)})" for h in handles)
    source = f"(SELECT * FROM VALUES {values} AS v(receipt_handle))"
    ref = ctx.warehouse.ref("deliveries")
    delete = (
        f"MERGE INTO {ref} t USING {source} s ON t.receipt_handle = s.receipt_handle "
        f"AND t.consumer_group = {sql_str(group)} WHEN MATCHED THEN DELETE"
    )
    found: list[dict[str, Any]] = []

    def attempt() -> None:
        found[:] = [
            r.asDict()
            for r in ctx.engine.rows(
                f"SELECT d.* FROM {ref} d JOIN {source} s ON d.receipt_handle = s.receipt_handle "
                f"WHERE d.consumer_group = {sql_str(group)}"
            )
        ]
        if found:
            ctx.engine.execute(delete)

    remaining = (
        f"SELECT count(*) AS n FROM {ref} d JOIN {source} s ON d.receipt_handle = s.receipt_handle "
        f"WHERE d.consumer_group = {sql_str(group)}"
    )
    ctx.engine.commit(attempt, what="deliveries")
    _until_gone(ctx, delete, remaining, f"deliveries of {group!r}")
    return found


def _until_gone(ctx: Context, delete: str, remaining: str, what: str) -> None:
    """Read back after a delete, and delete again until ``remaining`` counts nothing.

    Sail can run a DML statement on an older snapshot of the table than the read just
    before it (seen with several processes writing; docs/engines.md): rows appended
    since are then not matched and nothing is committed, with no error."""
    for pause in _backoff(ctx):
        if not ctx.engine.rows(remaining)[0]["n"]:
            return
        time.sleep(pause)
        ctx.engine.commit(lambda: ctx.engine.execute(delete), what="deliveries")
        ctx.engine.stats.stale_dml_repeats += 1
    if ctx.engine.rows(remaining)[0]["n"]:
        raise CommitConflict(f"{what} could not be removed after repeated attempts")


def _backoff(ctx: Context):
    """Pauses (s) between read-back checks: the engine's commit retry budget."""
    base = max(ctx.config.commit_backoff_ms, 10) / 1000.0
    return [base * (k + 1) for k in range(max(ctx.config.commit_retries, 1) + 1)]


def revoke(ctx: Context, group: str, queues: dict[Queue, int], new_owner: str) -> None:
    """After a takeover: the previous owner's in-flight messages of ``queues`` leave the
    in-flight set (the new owner hands them out again from the acknowledged offset)."""
    where = (
        f"WHERE consumer_group = {sql_str(group)} AND client_id <> {sql_str(new_owner)} "
        f"AND {sql_queues(queues)}"
    )
    ref = ctx.warehouse.ref("deliveries")
    statement = f"DELETE FROM {ref} {where}"
    ctx.engine.commit(lambda: ctx.engine.execute(statement), what="deliveries")
    remaining = f"SELECT count(*) AS n FROM {ref} {where}"
    _until_gone(ctx, statement, remaining, f"revoked deliveries of {group!r}")


def set_positions(
    ctx: Context,
    group: str,
    delivered: dict[Queue, int],
    now: int,
    queues: set[Queue] | None = None,
    restart: set[Queue] | None = None,
) -> None:
    """Store the recorded-delivered offsets given (only the queue's owner, right after
    recording its deliveries) and, for those queues and ``queues``, move the acknowledged
    offset forward to the lowest offset still in flight (else the delivered one); an ack
    never writes the delivered offset, so a late ack of a former owner cannot move it.
    The delivered offset only moves forward, except for the ``restart`` queues (just taken
    over: the new owner restarts at the acknowledged offset), so a delayed write of a
    client that lost the queue cannot move it back."""
    targets = set(delivered) | set(queues or ())
    if not targets:
        return
    inflight: defaultdict[tuple[str, int], int | None] = defaultdict(lambda: None)
    for r in ctx.engine.rows(
        f"SELECT topic, queue_id, min(queue_offset) AS lo FROM {ctx.warehouse.ref('deliveries')} "
        f"WHERE consumer_group = {sql_str(group)} AND {sql_queues(targets)} GROUP BY topic, queue_id"
    ):
        inflight[(r["topic"], r["queue_id"])] = r["lo"]
    positions = read_positions(ctx, group)
    merge = OffsetsMerge(
        ("next_offset", "delivered_offset", "set_delivered", "restart"),
        now,
        extra={"set_delivered": "boolean", "restart": "boolean"},
    )
    for q in sorted(targets):
        acked, old_delivered = positions.get(q, (0, None))
        d = delivered.get(q, old_delivered if old_delivered is not None else acked)
        lo = inflight[q]
        merge.add(
            group,
            q[0],
            q[1],
            next_offset=d if lo is None else min(lo, d),
            delivered_offset=d,
            set_delivered=q in delivered,
            restart=q in (restart or ()),
        )
    update = {
        "next_offset": forward("next_offset"),
        "delivered_offset": "CASE WHEN NOT s.set_delivered THEN t.delivered_offset "
        "WHEN s.restart THEN s.delivered_offset ELSE greatest(coalesce(t.delivered_offset, 0), "
        "s.delivered_offset) END",
    }
    insert = {"next_offset": source("next_offset"), "delivered_offset": source("delivered_offset")}
    ctx.engine.commit(partial(merge.execute, ctx.warehouse, update, insert), what="offsets")


def send_back(ctx: Context, rows: list[dict[str, Any]], level: int, why: str) -> None:
    """Failed pull deliveries (nacked or expired) → the retry / DLQ path, ids derived from
    the delivery (its time and queue position), already-stored ones skipped."""
    if not rows:
        return
    from deltamq.jobs import sendback

    wh = ctx.warehouse
    groups = ctx.catalog.groups()
    max_level = ctx.catalog.max_delay_level()
    pred = _at_offsets(rows)
    index = {
        (x["topic"], x["queue_id"], x["queue_offset"]): x.asDict()
        for x in wh.read("consume_queue").where(pred).select(*sendback.DELIVERY_COLUMNS).collect()
    }
    failures: list[sendback.Failure] = []
    for r in rows:
        src = index.get((r["topic"], r["queue_id"], r["queue_offset"]))
        if src is None:
            continue
        failures.append(
            sendback.failure(
                groups[r["consumer_group"]],
                src,
                attempt_ts=r["delivered_ts"],
                requested_level=level,
                reason=None,
                max_level=max_level,
                error=f"pull: {why}",
            )
        )
    if failures:
        sendback.store(ctx, failures)


def expire(ctx: Context, now: int, *, fence=None) -> int:
    """Deliveries not acked within their invisible time: RECONSUME_LATER (retry / DLQ
    path), then out of the in-flight set. Returns how many."""
    rows = read_deliveries(ctx, f"invisible_until <= {sql_long(now)}")
    if not rows:
        return 0
    if fence:
        fence()
    send_back(ctx, rows, 0, "not acked within the invisible time")
    faults.point("pull_expiry.after_sendback_commit")
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_group[r["consumer_group"]].append(r)
    n = 0
    for group, items in sorted(by_group.items()):
        found = end_deliveries(ctx, group, [r["receipt_handle"] for r in items])
        set_positions(ctx, group, {}, now, queues={(r["topic"], r["queue_id"]) for r in found})
        n += len(found)
    return n


def status(ctx: Context, now: int) -> list[dict[str, Any]]:
    """Per pull group and live client: its assigned queues (the rebalance), the queues it
    holds the lock of, and its messages in flight."""
    wh = ctx.warehouse
    clients = ctx.engine.rows(
        f"SELECT consumer_group, client_id, last_seen_ts FROM {wh.ref('clients')} "
        f"WHERE last_seen_ts >= {sql_long(now - ctx.config.client_timeout_ms)} ORDER BY 1, 2"
    )
    inflight = {
        (r["consumer_group"], r["client_id"]): r["n"]
        for r in ctx.engine.rows(
            f"SELECT consumer_group, client_id, count(*) AS n FROM {wh.ref('deliveries')} GROUP BY 1, 2"
        )
    }
    owners: dict[tuple[str, str], list[Queue]] = defaultdict(list)
    for r in ctx.engine.rows(
        f"SELECT consumer_group, owner, topic, queue_id FROM {wh.ref('queue_lock')} WHERE owner IS NOT NULL"
    ):
        owners[(r["consumer_group"], r["owner"])].append((r["topic"], r["queue_id"]))
    by_group: dict[str, list[str]] = defaultdict(list)
    for r in clients:
        by_group[r["consumer_group"]].append(r["client_id"])
    out = []
    for r in clients:
        group, client = r["consumer_group"], r["client_id"]
        assigned = assign(group_queues(ctx, group), by_group[group], client)
        out.append(
            {
                "group": group,
                "client": client,
                "last_seen": r["last_seen_ts"],
                "assigned": assigned,
                "locked": sorted(owners.get((group, client), [])),
                "in_flight": inflight.get((group, client), 0),
            }
        )
    return out
