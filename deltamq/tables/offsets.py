"""Typed writes to the ``offsets`` table (group offsets and system job progress)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from deltamq.tables.sqltext import USER_GROUPS, sql_long, sql_queues, sql_str

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse

ProgressRow = tuple[str, int, int | None, int | None]
"""(topic, queue_id, next_offset or None to keep, progress_version or None to keep)."""

KEEP = object()
"""``attempt_ts=KEEP``: leave ``attempt_ts`` as it is."""


def advance_offsets(
    wh: Warehouse,
    group: str,
    rows: Sequence[ProgressRow],
    now: int,
    client_id: str = "",
    *,
    attempt_ts: int | None | object = KEEP,
) -> None:
    """MERGE rows into ``offsets`` for ``group``; values only ever move forward.

    Self-contained (``greatest(t.x, s.x)`` inside the MERGE), so a re-run or a racing
    stale writer can never move an offset back. ``attempt_ts`` (an epoch ms, or None to
    clear it) marks or ends a job's pass in progress on every row given.
    """
    if not rows:
        return
    set_attempt = attempt_ts is not KEEP
    attempt = sql_long(attempt_ts if isinstance(attempt_ts, int) else None)
    values = ", ".join(
        f"({sql_str(group)}, {sql_str(topic)}, {int(qid)}, {sql_str(client_id)}, {sql_long(nxt)}, "
        f"{sql_long(progress)}, {attempt}, {sql_long(now)})"
        for topic, qid, nxt, progress in rows
    )
    wh.engine.execute(
        f"MERGE INTO {wh.ref('offsets')} t USING (SELECT * FROM VALUES {values} "
        "AS v(consumer_group, topic, queue_id, client_id, next_offset, progress_version, attempt_ts, "
        "updated_ts)) s "
        "ON t.consumer_group = s.consumer_group AND t.topic = s.topic AND t.queue_id = s.queue_id "
        "AND t.client_id = s.client_id "
        "WHEN MATCHED THEN UPDATE SET "
        "t.next_offset = CASE WHEN s.next_offset IS NULL THEN t.next_offset "
        "ELSE greatest(coalesce(t.next_offset, 0), s.next_offset) END, "
        "t.progress_version = CASE WHEN s.progress_version IS NULL THEN t.progress_version "
        "ELSE greatest(coalesce(t.progress_version, -1), s.progress_version) END, "
        + ("t.attempt_ts = s.attempt_ts, " if set_attempt else "")
        + "t.updated_ts = s.updated_ts "
        "WHEN NOT MATCHED THEN INSERT (consumer_group, topic, queue_id, client_id, next_offset, attempts, "
        "suspend_until, progress_version, attempt_ts, updated_ts) VALUES (s.consumer_group, s.topic, "
        "s.queue_id, s.client_id, s.next_offset, CAST(NULL AS INT), CAST(NULL AS BIGINT), "
        "s.progress_version, s.attempt_ts, s.updated_ts)"
    )


def group_positions(
    wh: Warehouse, queues: Iterable[tuple[str, int]] | None = None
) -> dict[tuple[str, str, str, int], int]:
    """Consumer groups' next offsets (not the jobs' progress rows), keyed by (group,
    client, topic, queue) — of ``queues`` only, if given."""
    where = USER_GROUPS if queues is None else f"{USER_GROUPS} AND {sql_queues(queues)}"
    return {
        (r["consumer_group"], r["client_id"] or "", r["topic"], r["queue_id"]): r["next_offset"] or 0
        for r in wh.engine.rows(
            "SELECT consumer_group, client_id, topic, queue_id, next_offset "
            f"FROM {wh.ref('offsets')} WHERE {where}"
        )
    }
