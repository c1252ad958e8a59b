"""When a tick next has work that falls due: the loop sleeps until then, not a whole
interval (``TickRunner.loop``).

Everything deltamq holds for later has its due time in a table before it is due: the
head of each delay level (levels are FIFO by due time, so the head is the level's
earliest), the timer index (partitioned by due hour), orderly queues suspended until a
time (``offsets.suspend_until``), pull deliveries until their invisible time, and the
next transaction check (``transaction_check_interval_ms`` after the last pass, when the
half queue holds something). One statement reads the first four; the check state is
the check job's own. Copies promoted ahead (``promote_ahead_ms``) wait in their queues
for their due times, which the index rows carry (``consume_queue.not_due``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltamq.jobs import check_transactions, promote
from deltamq.tables.consume_queue import earliest_due_query, not_due
from deltamq.tables.offsets import earliest_resume_query
from deltamq.tables.sqltext import sql_long

if TYPE_CHECKING:
    from deltamq.context import Context


def next_due(
    ctx: Context, after: int, levels: int | None = None, state: promote.PromoteState | None = None
) -> int | None:
    """The earliest time later than ``after`` (epoch ms) at which a tick has held work, or
    None. ``levels``: the warehouse's number of delay levels (read when not given);
    ``state``: promote's committed state, when the caller remembers it (read when not
    given). A held entry is promoted ``promote_ahead_ms`` before its due time, and its
    copy handed out at its due time: both are wake-ups."""
    wh = ctx.warehouse
    state = promote.load_state(wh) if state is None else state
    n_levels = ctx.catalog.max_delay_level() if levels is None else levels
    level_heads = {q: state.level_offsets.get(q, 0) for q in range(n_levels)}
    held = [
        f"SELECT true AS held, d FROM ({q})"
        for q in earliest_due_query(wh, level_heads, max(state.timer_watermark, after), after)
    ]
    parts = [
        *held,
        f"SELECT false AS held, d FROM ({earliest_resume_query(wh, after)})",
        f"SELECT false AS held, min(invisible_until) AS d FROM {wh.ref('deliveries')} "
        f"WHERE invisible_until > {sql_long(after)}",
    ]
    ahead = ctx.promote_ahead_ms
    found = [
        max(r["d"] - ahead, after + 1) if r["held"] else r["d"]
        for r in ctx.engine.rows(" UNION ALL ".join(parts))
        if r["d"] is not None
    ]
    found.extend(due for _, due in not_due(wh, after).values())  # copies promoted ahead
    check = check_transactions.load_state(wh)
    if check.head > check.half_offset and check.last_pass is not None:
        due = check.last_pass + ctx.config.transaction_check_interval_ms
        if due > after:
            found.append(due)
    return min(found) if found else None
