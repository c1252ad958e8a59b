"""The tick's ``pull_expiry`` step (docs/behaviour.md §6): deliveries not acked within
their invisible time take the retry / DLQ path, then the deliveries log is folded into
``offsets`` and the rows below each queue's acknowledged offset are deleted. A nack
sends back through the same :func:`send_back`: at once from the broker's pull client,
here for a nack a client without an engine requested (``NACK_REQUESTED`` rows).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F

from deltamq import faults
from deltamq.constants import EXPIRED, NACKED, TAKEN
from deltamq.engine import is_commit_conflict
from deltamq.tables import deliveries
from deltamq.tables.deliveries import ended
from deltamq.tables.offsets import OffsetsMerge, forward, source
from deltamq.tables.sqltext import sql_long, sql_str

if TYPE_CHECKING:
    from deltamq.config import GroupConfig
    from deltamq.context import Context

log = logging.getLogger(__name__)


def fold(
    ctx: Context,
    now: int,
    logs: dict[tuple[str, str, int], deliveries.QueueLog] | None = None,
    groups: Mapping[str, GroupConfig] | None = None,
) -> int:
    """Fold the deliveries log into ``offsets`` (next and delivered offsets; a takeover's
    restart included), then delete the rows below each queue's acknowledged offset (all
    ended). Returns the rows' queues folded. A delete that meets a concurrent append is
    left to the next fold."""
    if logs is None or groups is None:  # the groups before the log (see expire)
        groups = ctx.catalog.groups()
        logs = deliveries.summary(ctx.warehouse)
    current = _current(ctx, groups)  # a deleted group's rows are not a new one's of the name
    logs = {k: v for k, v in logs.items() if k[0] in current}
    if not logs:
        return 0
    stored = deliveries.read_positions(ctx.warehouse, {g for g, _, _ in logs})
    merge = OffsetsMerge(("next_offset", "delivered_offset", "restart"), now, extra={"restart": "boolean"})
    drops: dict[str, list[str]] = defaultdict(list)
    for (group, t, q), s in sorted(logs.items()):
        old = stored.get((group, t, q))
        acked, delivered = deliveries.position(s, old)
        if old is None or old[0] != acked or old[1] != delivered or s.taken_ts is not None:
            restart = s.taken_ts is not None
            merge.add(group, t, q, next_offset=acked, delivered_offset=delivered, restart=restart)
        if s.lowest is None or s.lowest >= acked:
            continue  # nothing ended below the acknowledged offset yet
        # A takeover appended after the log was read leaves a TAKEN row just below the
        # acknowledged offset: it is the new owner's start and stays.
        keep = f" AND NOT (state = {sql_str(TAKEN)} AND delivered_ts > {sql_long(s.seen_ts or 0)})"
        if s.taken_ts is not None and s.old_hi is not None and s.old_hi >= acked:
            # the previous owners' rows above the acknowledged offset still count until the
            # new owner's acks pass them: only their rows go (the TAKEN row and the new
            # owner's rows after it say where the queue restarted)
            keep = f" AND delivered_ts < {sql_long(s.taken_ts)}"
        at = f"consumer_group = {sql_str(group)} AND topic = {sql_str(t)} AND queue_id = {int(q)}"
        drops[group].append(f"({at} AND queue_offset < {sql_long(acked)}{keep})")
    update = {
        "next_offset": forward("next_offset"),
        "delivered_offset": "CASE WHEN s.restart THEN s.delivered_offset "
        "ELSE greatest(coalesce(t.delivered_offset, 0), s.delivered_offset) END",
    }
    insert = {"next_offset": source("next_offset"), "delivered_offset": source("delivered_offset")}
    if merge.rows:
        ctx.commit_offsets(merge, groups, update, insert)
    faults.point("pull_expiry.after_offsets_commit")
    current = _current(ctx, groups) if drops else set()  # a group created again meanwhile:
    kept = [d for g, ds in drops.items() if g in current for d in ds]  # its rows are its own
    if kept:
        statement = f"DELETE FROM {ctx.warehouse.ref('deliveries')} WHERE {' OR '.join(kept)}"
        for pause in (0.02, 0.05, 0.1, 0.0):  # clients keep appending: a few tries, then the next fold
            try:
                ctx.engine.execute(statement)
                break
            except Exception as e:
                if not is_commit_conflict(e):
                    raise
                time.sleep(pause)
    return len(logs)


def _current(ctx: Context, groups: Mapping[str, GroupConfig]) -> set[str]:
    """The names in ``groups`` (settings read before the log) still as read: a group
    deleted since, or deleted and created again, leaves rows that are not its own."""
    return set(groups) - ctx.catalog.changed(groups)


def send_back(
    ctx: Context,
    rows: list[dict[str, Any]],
    level: int,
    why: str,
    groups: Mapping[str, GroupConfig] | None = None,
) -> int:
    """Failed pull deliveries (nacked or expired) → the retry / DLQ path, ids derived from
    the delivery (its time and queue position), already-stored ones skipped. Returns how
    many could not be sent back because retention removed the message while it was in
    flight (each logged as a warning, naming its group and queue position). ``groups``:
    the settings as read before ``rows`` were, holding every row's group (None: read
    now)."""
    if not rows:
        return 0
    from deltamq.jobs import sendback

    wh = ctx.warehouse
    groups = ctx.catalog.groups() if groups is None else groups
    max_level = ctx.catalog.max_delay_level()
    pred = deliveries.at_offsets(rows)
    index = {
        (x["topic"], x["queue_id"], x["queue_offset"]): x.asDict()
        for x in wh.read("consume_queue").where(pred).select(*sendback.DELIVERY_COLUMNS).collect()
    }
    failures: list[sendback.Failure] = []
    gone = 0
    for r in rows:
        src = index.get((r["topic"], r["queue_id"], r["queue_offset"]))
        if src is None:
            gone += 1
            log.warning(
                "pull: %s of group %s at %s/%s offset %s (%s) has no retry: retention removed "
                "the message while it was in flight",
                r.get("msg_id"),
                r["consumer_group"],
                r["topic"],
                r["queue_id"],
                r["queue_offset"],
                why,
            )
            continue
        failures.append(
            sendback.failure(
                groups[r["consumer_group"]],
                sendback.Delivered.of(src),
                attempt_ts=r["delivered_ts"],
                requested_level=level,
                reason=None,
                max_level=max_level,
                error=f"pull: {why}",
            )
        )
    if failures:
        sendback.store(ctx, failures)
    return gone


@dataclass(frozen=True)
class Expiry:
    """What a ``pull_expiry`` step did: deliveries that ``expired`` (not acked within their
    invisible time), and deliveries expired or nacked that are ``gone``: retention removed
    their message while it was in flight, so no retry carries it."""

    expired: int = 0
    gone: int = 0


def expire(ctx: Context, now: int, *, fence: Callable[[], None] | None = None) -> Expiry:
    """The tick's ``pull_expiry`` step. Deliveries not acked within their invisible time:
    RECONSUME_LATER (retry / DLQ path), then ended in the log; then the log is folded into
    ``offsets`` (:func:`fold`). An empty log costs one read."""
    logs = deliveries.summary(ctx.warehouse)
    if not logs:
        return Expiry()
    # the groups, then the log again: the fold writes positions only for groups as they
    # were before its rows were read (one deleted and created again since keeps its own)
    groups = ctx.catalog.groups()
    logs = deliveries.summary(ctx.warehouse)
    n = gone = 0
    if any(s.due is not None and s.due <= now for s in logs.values()):
        requested = deliveries.nack_requests(ctx.warehouse)
        due = F.col("invisible_until") <= F.lit(now)
        if requested:
            due = due | F.col("receipt_handle").isin(sorted(requested))
        rows = deliveries.open_rows(ctx.warehouse, F.lit(True), due)
        current = _current(ctx, groups) if rows else set()
        rows = [r for r in rows if r[0] in current]  # LOG_COLUMNS: the group first
        if rows:
            if fence:
                fence()
            nacked = [r for r in rows if r[6] in requested]
            expired = [r for r in rows if r[6] not in requested]
            expiring = [deliveries.as_dict(r) for r in expired]
            gone = send_back(ctx, expiring, 0, "not acked within the invisible time", groups)
            for level in sorted({requested[r[6]] for r in nacked}):
                same = [deliveries.as_dict(r) for r in nacked if requested[r[6]] == level]
                gone += send_back(ctx, same, level, "nack", groups)
            faults.point("pull_expiry.after_sendback_commit")
            ends = [ended(r, EXPIRED) for r in expired] + [ended(r, NACKED) for r in nacked]
            ctx.commit(partial(deliveries.append, ctx.warehouse, ends), what="deliveries")
            n = len(expired)
            logs = deliveries.summary(ctx.warehouse)
    if fence:
        fence()
    fold(ctx, now, logs, groups)
    return Expiry(n, gone)
