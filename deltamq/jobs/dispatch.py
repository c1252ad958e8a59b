"""Dispatch: RocketMQ's reput service on Delta — new ``commit_log`` rows → ``consume_queue``.

The indexing itself belongs to the index's owner (``deltamq/tables/consume_queue.py``:
how new rows are found, routed, ordered and given dense offsets, exactly once). This
job runs it under its lease and writes the hint afterwards: the ``%DISPATCH%`` rows of
``offsets`` (per-queue next offset, and the version reached). On start, the indexer
reads the hint and then the ``consume_queue`` rows newer than it (a range that file
statistics prune), so a kill between the two commits loses and repeats nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from deltamq import faults
from deltamq.constants import DISPATCH_GROUP
from deltamq.tables import consume_queue
from deltamq.tables.offsets import Carried, ProgressRow, advance_offsets

if TYPE_CHECKING:
    from deltamq.context import Context
    from deltamq.tables.warehouse import Warehouse

JOB = "dispatch"
PROGRESS_POINT = "dispatch.after_progress_commit"


class DispatchResult(consume_queue.Indexed):
    """What a dispatch pass indexed (:class:`consume_queue.Indexed`)."""

    @property
    def details(self) -> dict[str, int]:
        out = {f"route_{k}": v for k, v in self.routes.items()} | {"commits_read": self.commits_read}
        out |= {"duplicate_commits": self.duplicate_commits} if self.duplicate_commits else {}
        return out | ({"repeated": self.repeated} if self.repeated else {})


def run(
    ctx: Context, now: int, *, fence: Callable[[], None] | None = None, defer_progress: bool = False
) -> DispatchResult:
    """Index every commit_log row committed since the last run, then record the hint.

    Due times come from store times, so ``now`` only stamps the progress rows.
    ``fence`` is called before the index commit (lease check). ``defer_progress``: the
    hint is left to the caller (:func:`deferred`, written with the tick's next
    offsets commit: deliver's attempt record); until then readers correct the old hint
    from the index rows newer than it, so nothing is missed.
    """
    wh = ctx.warehouse

    def index() -> DispatchResult:
        done = consume_queue.index_new(wh, ctx.config.dispatch_max_versions, fence=fence, job=JOB)
        return DispatchResult(**vars(done))

    result = ctx.commit(index, what=JOB)
    if (result.commits_read or result.queues) and not defer_progress:
        ctx.commit(lambda: write_progress(wh, result.to_version, result.queues, now), what="offsets")
        faults.point(PROGRESS_POINT)
    return result


def deferred(result: consume_queue.Indexed) -> Carried | None:
    """The hint a pass run with ``defer_progress`` leaves to the tick's next offsets
    commit (``%DISPATCH%`` rows); None when the pass had nothing to record."""
    if not (result.commits_read or result.queues):
        return None
    return Carried({DISPATCH_GROUP: _hint(result.to_version, result.queues)}, PROGRESS_POINT)


def write_deferred(ctx: Context, carried: Carried, now: int) -> None:
    """The deferred hint committed on its own (no offsets commit carried it)."""
    rows = carried.rows[DISPATCH_GROUP]
    ctx.commit(lambda: advance_offsets(ctx.warehouse, DISPATCH_GROUP, rows, now), what="offsets")
    carried.landed()


def _hint(version: int, queues: dict[tuple[str, int], int]) -> list[ProgressRow]:
    """The version reached, then each moved queue's next offset."""
    return [("", -1, None, version)] + [(t, q, o, None) for (t, q), o in sorted(queues.items())]


def write_progress(wh: Warehouse, version: int, queues: dict[tuple[str, int], int], now: int) -> None:
    """Record the hint: version reached and per-queue next offsets (%DISPATCH% rows)."""
    advance_offsets(wh, DISPATCH_GROUP, _hint(version, queues), now)
