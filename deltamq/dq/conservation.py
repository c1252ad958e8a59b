"""The conservation query (minimal form; the data-quality issue extends it).

Checks that dispatch lost and repeated nothing: every ``commit_log`` row is indexed in
``consume_queue`` exactly once — except the committed message of a transaction that
another commit already made visible (dispatch drops such duplicates; they are counted) —
every index row points at a stored message, and offsets are dense per (topic, queue).
A DQ check, not a hot-path job: it reads the tables whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltamq.constants import TRANS_OP_HALF_TOPIC, Prop, SysFlag, TxState
from deltamq.tables.consume_queue import load_dispatch_state

if TYPE_CHECKING:
    from deltamq.engine import Views
    from deltamq.tables.warehouse import Warehouse

_SAMPLE = 20


@dataclass(frozen=True)
class DispatchConservation:
    stored: int
    indexed: int
    unindexed: tuple[str, ...]  # msg ids stored but not (yet) indexed
    duplicated: tuple[str, ...]  # msg ids indexed more than once
    orphans: tuple[str, ...]  # index rows with no stored message
    duplicate_offsets: tuple[tuple[str, int, int], ...]  # (topic, queue, offset) used twice
    gaps: tuple[tuple[str, int], ...]  # queues whose offsets are not 0..n-1 (or min..max)
    duplicate_commits: int = 0  # committed messages of a transaction already visible: not indexed

    @property
    def ok(self) -> bool:
        return not (self.unindexed or self.duplicated or self.orphans or self.duplicate_offsets or self.gaps)

    def describe(self) -> str:
        return (
            f"stored={self.stored} indexed={self.indexed} unindexed={len(self.unindexed)} "
            f"duplicated={len(self.duplicated)} orphans={len(self.orphans)} "
            f"duplicate_offsets={len(self.duplicate_offsets)} gaps={list(self.gaps)} "
            f"duplicate_commits={self.duplicate_commits}"
        )


def check_dispatch(wh: Warehouse, *, dispatched_only: bool = False) -> DispatchConservation:
    """Reconcile commit_log with consume_queue. ``dispatched_only``: rows of commits
    dispatch has not reached yet are not expected in the index (a live warehouse)."""
    with wh.engine.views() as views:
        return _check_dispatch(wh, views, dispatched_only)


def _check_dispatch(wh: Warehouse, views: Views, dispatched_only: bool) -> DispatchConservation:
    cl, cq = wh.ref("commit_log"), wh.ref("consume_queue")
    rows = wh.engine.rows
    stored = rows(f"SELECT count(*) AS n FROM {cl}")[0]["n"]
    indexed = rows(f"SELECT count(*) AS n FROM {cq}")[0]["n"]
    missing = f"(SELECT c.* FROM {cl} c LEFT ANTI JOIN {cq} q ON c.msg_id = q.msg_id)"
    if dispatched_only:
        from deltamq.tables import commit_log, deltalog

        version = load_dispatch_state(wh).version
        later = deltalog.commits_after(wh.storage, wh.uri("commit_log"), version, 10**9)
        new = commit_log.read_added(wh, later)
        if new is not None:
            undispatched = views.add(new.select("msg_id"), "undispatched")
            missing = f"(SELECT m.* FROM {missing} m LEFT ANTI JOIN {undispatched} u ON m.msg_id = u.msg_id)"
    # the transactions whose first end is indexed: a committed message (its topic), or, when
    # the first op record of the transaction is a rollback's, the topic it names: a COMMIT
    # after it is not indexed (a COMMIT first and a rollback after still needs its message)
    first_ops = (
        f"(SELECT properties['{Prop.TRAN_ID}'] AS tran, "
        f"min_by(struct(properties['{Prop.REAL_TOPIC}'] AS topic, properties['{Prop.TRAN_STATE}'] AS state), "
        "struct(cl_version, cl_batch_id, cl_batch_pos)) AS first "
        f"FROM {cq} WHERE topic = '{TRANS_OP_HALF_TOPIC}' GROUP BY properties['{Prop.TRAN_ID}'])"
    )
    visible = (
        f"(SELECT DISTINCT topic, properties['{Prop.TRAN_ID}'] AS tran FROM {cq} "
        f"WHERE properties['{Prop.TRAN_ID}'] IS NOT NULL "
        f"UNION SELECT first.topic AS topic, tran FROM {first_ops} "
        f"WHERE first.state = '{TxState.ROLLBACK.value}')"
    )
    duplicate_commit = (
        f"(u.sys_flag & 12) = {SysFlag.TRANSACTION_COMMIT_TYPE} AND u.topic = k.topic "
        f"AND u.properties['{Prop.TRAN_ID}'] = k.tran"
    )
    unindexed = rows(
        f"SELECT u.msg_id FROM {missing} u LEFT ANTI JOIN {visible} k ON {duplicate_commit} "
        f"ORDER BY u.msg_id LIMIT {_SAMPLE}"
    )
    duplicate_commits = rows(
        f"SELECT count(*) AS n FROM {missing} u LEFT SEMI JOIN {visible} k ON {duplicate_commit}"
    )[0]["n"]
    duplicated = rows(
        f"SELECT msg_id FROM {cq} GROUP BY msg_id HAVING count(*) > 1 ORDER BY msg_id LIMIT {_SAMPLE}"
    )
    orphans = rows(
        f"SELECT q.msg_id FROM {cq} q LEFT ANTI JOIN {cl} c ON c.msg_id = q.msg_id "
        f"ORDER BY q.msg_id LIMIT {_SAMPLE}"
    )
    dup_offsets = rows(
        f"SELECT topic, queue_id, queue_offset FROM {cq} GROUP BY topic, queue_id, queue_offset "
        f"HAVING count(*) > 1 ORDER BY 1, 2, 3 LIMIT {_SAMPLE}"
    )
    gaps = rows(
        f"SELECT topic, queue_id FROM {cq} GROUP BY topic, queue_id "
        "HAVING max(queue_offset) - min(queue_offset) + 1 <> count(DISTINCT queue_offset) "
        "OR min(queue_offset) <> 0 ORDER BY 1, 2"
    )
    return DispatchConservation(
        stored=stored,
        indexed=indexed,
        unindexed=tuple(r["msg_id"] for r in unindexed),
        duplicated=tuple(r["msg_id"] for r in duplicated),
        orphans=tuple(r["msg_id"] for r in orphans),
        duplicate_offsets=tuple((r[0], r[1], r[2]) for r in dup_offsets),
        gaps=tuple((r[0], r[1]) for r in gaps),
        duplicate_commits=duplicate_commits,
    )
