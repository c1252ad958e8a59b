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
from deltamq.tables.offsets import advance_offsets

if TYPE_CHECKING:
    from deltamq.context import Context
    from deltamq.tables.warehouse import Warehouse

JOB = "dispatch"


class DispatchResult(consume_queue.Indexed):
    """What a dispatch pass indexed (:class:`consume_queue.Indexed`)."""

    @property
    def details(self) -> dict[str, int]:
        out = {f"route_{k}": v for k, v in self.routes.items()} | {"commits_read": self.commits_read}
        out |= {"duplicate_commits": self.duplicate_commits} if self.duplicate_commits else {}
        return out | ({"repeated": self.repeated} if self.repeated else {})


def run(ctx: Context, now: int, *, fence: Callable[[], None] | None = None) -> DispatchResult:
    """Index every commit_log row committed since the last run, then record the hint.

    Due times come from store times, so ``now`` only stamps the progress rows.
    ``fence`` is called before the index commit (lease check).
    """
    wh = ctx.warehouse

    def index() -> DispatchResult:
        done = consume_queue.index_new(wh, ctx.config.dispatch_max_versions, fence=fence, job=JOB)
        return DispatchResult(**vars(done))

    result = ctx.commit(index, what=JOB)
    if result.commits_read or result.queues:
        ctx.commit(lambda: write_progress(wh, result.to_version, result.queues, now), what="offsets")
        faults.point("dispatch.after_progress_commit")
    return result


def write_progress(wh: Warehouse, version: int, queues: dict[tuple[str, int], int], now: int) -> None:
    """Record the hint: version reached and per-queue next offsets (%DISPATCH% rows)."""
    rows = [("", -1, None, version)] + [(t, q, o, None) for (t, q), o in sorted(queues.items())]
    advance_offsets(wh, DISPATCH_GROUP, rows, now)
