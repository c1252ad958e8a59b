"""When a tick next has work that falls due: the loop sleeps until then, not a whole
interval (``TickRunner.loop``).

Everything deltamq holds for later has its due time in a table before it is due: the
head of each delay level (levels are FIFO by due time, so the head is the level's
earliest), the timer index (partitioned by due hour), orderly queues suspended until a
time (``offsets.suspend_until``), pull deliveries until their invisible time, and the
next transaction check (``transaction_check_interval_ms`` after the last pass, when the
half queue holds something). One statement reads the first four; the check state is
the check job's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltamq.jobs import check_transactions, promote
from deltamq.tables.consume_queue import earliest_due_query
from deltamq.tables.offsets import earliest_resume_query
from deltamq.tables.sqltext import sql_long

if TYPE_CHECKING:
    from deltamq.context import Context


def next_due(
    ctx: Context, after: int, levels: int | None = None, state: promote.PromoteState | None = None
) -> int | None:
    """The earliest due time later than ``after`` (epoch ms) of anything held, or None.
    ``levels``: the warehouse's number of delay levels (read when not given); ``state``:
    promote's committed state, when the caller remembers it (read when not given)."""
    wh = ctx.warehouse
    state = promote.load_state(wh) if state is None else state
    n_levels = ctx.catalog.max_delay_level() if levels is None else levels
    level_heads = {q: state.level_offsets.get(q, 0) for q in range(n_levels)}
    parts = [
        *earliest_due_query(wh, level_heads, max(state.timer_watermark, after), after),
        earliest_resume_query(wh, after),
        f"SELECT min(invisible_until) AS d FROM {wh.ref('deliveries')} "
        f"WHERE invisible_until > {sql_long(after)}",
    ]
    found = [r["d"] for r in ctx.engine.rows(" UNION ALL ".join(parts)) if r["d"] is not None]
    check = check_transactions.load_state(wh)
    if check.head > check.half_offset and check.last_pass is not None:
        due = check.last_pass + ctx.config.transaction_check_interval_ms
        if due > after:
            found.append(due)
    return min(found) if found else None
