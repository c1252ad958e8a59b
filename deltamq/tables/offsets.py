"""The ``offsets`` table's one owner: every write to it, and the dispatch heads.

Every ``MERGE INTO offsets`` in deltamq is rendered by :class:`OffsetsMerge`: rows of
typed values (rendered through :mod:`deltamq.tables.sqltext` from the table's schema),
matched on the table's key (group, client, topic, queue), with an update rule per
column and, optionally, an insert. :func:`advance_offsets` is the common case: values
that only ever move forward.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa

from deltamq import faults, file_reads
from deltamq.constants import DISPATCH_GROUP
from deltamq.schemas import TABLES
from deltamq.tables.sqltext import USER_GROUPS, sql_bool, sql_in, sql_int, sql_long, sql_queues, sql_str

if TYPE_CHECKING:
    from deltamq.tables.warehouse import Warehouse

ProgressRow = tuple[str, int, int | None, int | None]
"""(topic, queue_id, next_offset or None to keep, progress_version or None to keep)."""

KEEP = object()
"""``attempt_ts=KEEP``: leave ``attempt_ts`` as it is."""

KEY = ("consumer_group", "client_id", "topic", "queue_id")
_ON = " AND ".join(f"t.{c} = s.{c}" for c in KEY)

_ARROW = {"string": pa.string(), "int": pa.int32(), "bigint": pa.int64(), "boolean": pa.bool_()}
_CAST = {"string": "VARCHAR", "int": "INT", "bigint": "BIGINT", "boolean": "BOOLEAN"}

_RENDER: dict[str, Callable[[Any], str]] = {
    "string": sql_str,
    "int": sql_int,
    "bigint": sql_long,
    "boolean": sql_bool,
}
OFFSETS_TYPES = {f.name: f.dataType.simpleString() for f in TABLES["offsets"].schema.fields}
"""Column → SQL type of the ``offsets`` table, from its schema."""


def forward(column: str, floor: int = 0) -> str:
    """Update rule: the larger of the stored and the new value (never back)."""
    return f"greatest(coalesce(t.{column}, {floor}), s.{column})"


def forward_unless_null(column: str, floor: int = 0) -> str:
    """Update rule: a NULL new value keeps the stored one; otherwise :func:`forward`."""
    return f"CASE WHEN s.{column} IS NULL THEN t.{column} ELSE {forward(column, floor)} END"


def fresh_head(when: str | None = None) -> dict[str, str]:
    """Update rules that start a queue's head afresh (no attempts, suspends or pause), as
    after an offset move; ``when``: only where that condition over ``t``/``s`` holds."""
    fresh = {
        "attempts": "0",
        "suspends": "0",
        "suspend_until": "CAST(NULL AS BIGINT)",
        "attempt_ts": "CAST(NULL AS BIGINT)",
    }
    if when is None:
        return fresh
    return {c: f"CASE WHEN {when} THEN {v} ELSE t.{c} END" for c, v in fresh.items()}


def source(column: str) -> str:
    """Update or insert rule: the new value as given."""
    return f"s.{column}"


@dataclass
class OffsetsMerge:
    """One ``MERGE INTO offsets``: rows keyed by (group, client, topic, queue) carrying the
    ``columns`` given (offsets columns, or extra ones typed in ``extra``), the update rule
    of each column changed on a match, and the insert values of a new row (None: no
    insert). ``updated_ts`` is set to ``now`` on both paths."""

    columns: Sequence[str]
    now: int
    extra: Mapping[str, str] = field(default_factory=dict)
    rows: list[str] = field(default_factory=list)
    values: list[tuple[Any, ...]] = field(default_factory=list)  # the rows' values, as given

    def __post_init__(self) -> None:
        for c in self.columns:
            if c in KEY or (c not in OFFSETS_TYPES and c not in self.extra):
                raise ValueError(f"{c!r} is not a value column of offsets; declare extra columns' types")

    def add(self, group: str, topic: str, queue_id: int, client_id: str = "", **values: Any) -> None:
        """One source row; every column of ``columns`` must be given (None is NULL)."""
        if set(values) != set(self.columns):
            raise ValueError(f"offsets row needs exactly {list(self.columns)}, got {sorted(values)}")
        types = {**OFFSETS_TYPES, **self.extra}
        cells = [sql_str(group), sql_str(client_id), sql_str(topic), sql_int(int(queue_id))]
        cells += [_RENDER[types[c]](values[c]) for c in self.columns]
        self.rows.append("(" + ", ".join(cells) + ")")
        self.values.append((group, client_id, topic, int(queue_id), *(values[c] for c in self.columns)))

    def without(self, groups: Collection[str]) -> OffsetsMerge:
        """This MERGE less the rows of ``groups``."""
        if not groups:
            return self
        kept = [i for i, v in enumerate(self.values) if v[0] not in groups]
        return replace(self, rows=[self.rows[i] for i in kept], values=[self.values[i] for i in kept])

    def _rules(
        self, update: Mapping[str, str], insert: Mapping[str, str] | None
    ) -> tuple[dict[str, str], dict[str, str] | None]:
        """The update rules and, with an insert, every column's insert value, both with
        ``updated_ts`` set to ``now``."""
        now = sql_long(self.now)
        sets = {**update, "updated_ts": now}
        if insert is None:
            return sets, None
        given = {**{c: f"s.{c}" for c in KEY}, **insert, "updated_ts": now}
        return sets, {c: given.get(c, f"CAST(NULL AS {t.upper()})") for c, t in OFFSETS_TYPES.items()}

    def render(self, wh: Warehouse, update: Mapping[str, str], insert: Mapping[str, str] | None) -> str:
        """The statement (the rows must not be empty)."""
        if not self.rows:
            raise ValueError("an offsets MERGE needs at least one row")
        sets, values = self._rules(update, insert)
        statement = (
            f"MERGE INTO {wh.ref('offsets')} t USING (SELECT * FROM VALUES {', '.join(self.rows)} "
            f"AS v({', '.join((*KEY, *self.columns))})) s ON {_ON} WHEN MATCHED THEN UPDATE SET "
            + ", ".join(f"t.{c} = {rule}" for c, rule in sets.items())
        )
        if values is None:
            return statement
        columns, cells = ", ".join(values), ", ".join(values.values())
        return f"{statement} WHEN NOT MATCHED THEN INSERT ({columns}) VALUES ({cells})"

    def arrow(self) -> pa.Table:
        """The rows as an Arrow table (the key, then ``columns``), typed as the table is."""
        types = {**OFFSETS_TYPES, **self.extra}
        names = (*KEY, *self.columns)
        return pa.table(
            {
                name: pa.array([row[i] for row in self.values], _ARROW[types[name]])
                for i, name in enumerate(names)
            }
        )

    def execute(self, wh: Warehouse, update: Mapping[str, str], insert: Mapping[str, str] | None) -> None:
        """Run the MERGE (nothing for no rows): written by delta-rs where the warehouse
        allows (``Warehouse.merge_rows``: a few milliseconds), else by the engine. The
        caller commits (``Context.commit``)."""
        if not self.rows:
            return
        sets, values = self._rules(update, insert)

        def typed(rules: Mapping[str, str]) -> dict[str, str]:  # delta-rs keeps the expression's type
            return {c: f"CAST({rule} AS {_CAST[OFFSETS_TYPES[c]]})" for c, rule in rules.items()}

        if not wh.merge_rows(
            "offsets", self.arrow(), _ON, typed(sets), None if values is None else typed(values)
        ):
            wh.engine.execute(self.render(wh, update, insert))


@dataclass
class Carried:
    """Progress rows of other jobs (group → rows, :func:`advance_offsets`' rule) that the
    next offsets commit of the tick writes along with its own, so the tick makes one commit
    fewer (issue: one offsets commit per tick). ``written`` is set once they are."""

    rows: dict[str, list[ProgressRow]]
    point: str | None = None  # the fault point right after the rows are committed
    written: bool = False

    def landed(self) -> None:
        """The rows are committed (by whichever commit carried them)."""
        self.written = True
        if self.point:
            faults.point(self.point)

    def add_to(self, merge: OffsetsMerge) -> None:
        """Add the rows to ``merge``, whose columns must include :data:`CARRY_COLUMNS`."""
        for group, rows in self.rows.items():
            for topic, qid, nxt, version in rows:
                values: dict[str, Any] = {c: None for c in merge.columns}
                values |= {"next_offset": nxt, "progress_version": version, "carried": True}
                merge.add(group, topic, qid, "", **values)


CARRY_COLUMNS = ("next_offset", "progress_version")
"""The columns carried rows set (forward only, a NULL keeping the stored value)."""


def carrying(update: Mapping[str, str]) -> dict[str, str]:
    """``update``'s rules for the merge's own rows (``s.carried`` false), and for carried
    rows :func:`advance_offsets`' rule on :data:`CARRY_COLUMNS` (every other column kept)."""
    rules = {c: f"CASE WHEN s.carried THEN t.{c} ELSE {rule} END" for c, rule in update.items()}
    own = {c: update.get(c, f"t.{c}") for c in CARRY_COLUMNS}
    floors = {"progress_version": -1}
    for c in CARRY_COLUMNS:
        rules[c] = f"CASE WHEN s.carried THEN {forward_unless_null(c, floors.get(c, 0))} ELSE {own[c]} END"
    return rules


def advance_offsets(
    wh: Warehouse,
    group: str,
    rows: Sequence[ProgressRow],
    now: int,
    client_id: str = "",
    *,
    attempt_ts: int | None | object = KEEP,
    also: Mapping[str, Sequence[ProgressRow]] | None = None,
) -> None:
    """MERGE rows into ``offsets`` for ``group``; values only ever move forward.

    Self-contained (``greatest(t.x, s.x)`` inside the MERGE), so a re-run or a racing
    stale writer can never move an offset back. ``attempt_ts`` (an epoch ms, or None to
    clear it) marks or ends a job's pass in progress on every row given. ``also``: rows
    of other groups (client ``""``) moved in the same MERGE, so in the same commit.
    """
    merge = OffsetsMerge(("next_offset", "progress_version", "attempt_ts"), now)
    attempt = attempt_ts if isinstance(attempt_ts, int) else None
    batches = [(group, client_id, rows)] + [(g, "", more) for g, more in (also or {}).items()]
    for g, client, group_rows in batches:
        for topic, qid, nxt, progress in group_rows:
            merge.add(g, topic, qid, client, next_offset=nxt, progress_version=progress, attempt_ts=attempt)
    update = {
        "next_offset": forward_unless_null("next_offset"),
        "progress_version": forward_unless_null("progress_version", -1),
    }
    if attempt_ts is not KEEP:
        update["attempt_ts"] = source("attempt_ts")
    insert = {c: source(c) for c in ("next_offset", "progress_version", "attempt_ts")}
    merge.execute(wh, update, insert)


class QueueKey(NamedTuple):
    """One position's key in ``offsets``: a group (and, broadcasting, its instance) on a queue."""

    group: str
    client: str  # "" but for a BROADCASTING group's instance
    topic: str
    queue_id: int


@dataclass(frozen=True)
class Position:
    """Where a consumer group stands on a queue: a row of ``offsets``, typed (a group
    with no row for a queue stands at :data:`START`)."""

    next_offset: int = 0
    attempts: int = 0  # deliver passes begun on the range from next_offset without an outcome
    attempt_ts: int | None = None  # the broker time of the first of them
    suspends: int = 0  # orderly groups: SUSPEND_CURRENT_QUEUE_A_MOMENT answers in a row
    suspend_until: int | None = None
    delivered_offset: int | None = None  # pull clients: handed out up to here


START = Position()

_POSITION_COLUMNS = "next_offset, attempts, attempt_ts, suspends, suspend_until, delivered_offset"


def positions(
    wh: Warehouse,
    groups: Sequence[str] | None = None,
    queues: Iterable[tuple[str, int]] | None = None,
) -> dict[QueueKey, Position]:
    """The consumer groups' positions (of ``groups`` and ``queues`` only, if given; the
    jobs' own progress rows never)."""
    if groups is not None and not groups:
        return {}
    found = file_reads.all_rows(wh, "offsets")
    if found is not None:
        wanted_groups = None if groups is None else set(groups)
        wanted_queues = None if queues is None else set(queues)
        rows: list[Any] = [
            r
            for r in found
            if not r["consumer_group"].startswith("%")
            and (wanted_groups is None or r["consumer_group"] in wanted_groups)
            and (wanted_queues is None or (r["topic"], r["queue_id"]) in wanted_queues)
        ]
    else:
        where = [USER_GROUPS]
        if groups is not None:
            where.append(f"consumer_group IN {sql_in(groups)}")
        if queues is not None:
            where.append(sql_queues(queues))
        rows = wh.engine.rows(
            f"SELECT consumer_group, client_id, topic, queue_id, {_POSITION_COLUMNS} "
            f"FROM {wh.ref('offsets')} WHERE {' AND '.join(where)}"
        )
    return {
        QueueKey(r["consumer_group"], r["client_id"] or "", r["topic"], r["queue_id"]): Position(
            r["next_offset"] or 0,
            r["attempts"] or 0,
            r["attempt_ts"],
            r["suspends"] or 0,
            r["suspend_until"],
            r["delivered_offset"],
        )
        for r in rows
    }


def earliest_resume_query(wh: Warehouse, after: int) -> str:
    """SQL (one row, column ``d``): the earliest time after ``after`` at which a suspended
    orderly queue resumes — a part of the wake-up query (jobs/wake.py) that asks every
    held-back table at once."""
    return f"SELECT min(suspend_until) AS d FROM {wh.ref('offsets')} WHERE suspend_until > {sql_long(after)}"


def clients_with_offsets(wh: Warehouse, group: str, topic: str) -> set[str]:
    """Whose positions ``group`` has on ``topic`` yet: ``{""}`` for a group's own, a
    BROADCASTING group's instances by name; empty before it first subscribes."""
    rows = wh.engine.rows(
        f"SELECT DISTINCT client_id FROM {wh.ref('offsets')} "
        f"WHERE consumer_group = {sql_str(group)} AND topic = {sql_str(topic)}"
    )
    return {r["client_id"] or "" for r in rows}


def start_positions(
    wh: Warehouse, group: str, clients: Sequence[str], topic: str, starts: Mapping[int, int], now: int
) -> None:
    """Place each of ``clients`` of ``group`` at ``starts`` (queue → offset) on ``topic`` in
    one ``MERGE``, so one commit: a kill leaves every instance placed or none. An offset
    already stored only moves forward."""
    merge = OffsetsMerge(("next_offset",), now)
    for client in clients:
        for q, o in sorted(starts.items()):
            merge.add(group, topic, q, client, next_offset=o)
    if merge.rows:
        merge.execute(
            wh, {"next_offset": forward_unless_null("next_offset")}, {"next_offset": source("next_offset")}
        )


def forget_clients(wh: Warehouse, group: str, keep: Sequence[str]) -> None:
    """Delete the positions of every instance of BROADCASTING ``group`` not in ``keep``."""
    wh.engine.execute(
        f"DELETE FROM {wh.ref('offsets')} WHERE consumer_group = {sql_str(group)} "
        f"AND client_id NOT IN ({', '.join(sql_str(c) for c in keep)})"
    )


def drop_positions(wh: Warehouse, group: str, clients: Sequence[str] | None = None) -> None:
    """Delete ``group``'s positions: those of ``clients`` (BROADCASTING instances), or
    every row of the group for None."""
    where = f"consumer_group = {sql_str(group)}"
    if clients is not None:
        where += f" AND client_id IN ({', '.join(sql_str(c) for c in clients)})"
    wh.engine.execute(f"DELETE FROM {wh.ref('offsets')} WHERE {where}")


def holds_positions(wh: Warehouse, group: str, clients: Sequence[str] | None = None) -> bool:
    """Whether ``offsets`` has a row of ``group`` (of one of ``clients``, if given)."""
    found = file_reads.all_rows(wh, "offsets", ("consumer_group", "client_id"))
    if found is not None:
        held = {r["client_id"] or "" for r in found if r["consumer_group"] == group}
    else:
        where = f"consumer_group = {sql_str(group)}"
        held = {
            r["client_id"] or ""
            for r in wh.engine.rows(f"SELECT client_id FROM {wh.ref('offsets')} WHERE {where}")
        }
    return bool(held if clients is None else held & set(clients))


@dataclass(frozen=True)
class Progress:
    """A job's progress row (groups named ``%...%``, client ""): per queue its next
    offset, and on a queue-less row (``queue_id`` -1) the version or time it reached."""

    topic: str
    queue_id: int
    next_offset: int | None
    progress_version: int | None
    attempt_ts: int | None


def progress(wh: Warehouse, wanted: Mapping[str, Sequence[str] | None]) -> dict[str, list[Progress]]:
    """The progress rows of each job group in ``wanted`` (of the topics given, or all
    of them for None), in one query: ``{group: [Progress, ...]}``."""
    found = file_reads.all_rows(wh, "offsets")
    if found is not None:
        rows: list[Any] = [
            r
            for r in found
            if r["client_id"] == ""
            and r["consumer_group"] in wanted
            and (wanted[r["consumer_group"]] is None or r["topic"] in (wanted[r["consumer_group"]] or ()))
        ]
    else:
        conds = []
        for group, topics in sorted(wanted.items()):
            cond = f"consumer_group = {sql_str(group)}"
            if topics is not None:
                cond += f" AND topic IN {sql_in(topics)}"
            conds.append(f"({cond})")
        rows = wh.engine.rows(
            f"SELECT consumer_group, topic, queue_id, next_offset, progress_version, attempt_ts "
            f"FROM {wh.ref('offsets')} WHERE client_id = '' AND ({' OR '.join(conds)})"
        )
    out: dict[str, list[Progress]] = {g: [] for g in wanted}
    for r in rows:
        out[r["consumer_group"]].append(
            Progress(r["topic"], r["queue_id"], r["next_offset"], r["progress_version"], r["attempt_ts"])
        )
    return out


def forget(wh: Warehouse, group: str) -> None:
    """Delete every row of ``group`` (one commit; rebuild-index forgets dispatch's hint)."""
    wh.engine.execute(f"DELETE FROM {wh.ref('offsets')} WHERE consumer_group = {sql_str(group)}")


def group_positions(wh: Warehouse, queues: Iterable[tuple[str, int]] | None = None) -> dict[QueueKey, int]:
    """Consumer groups' next offsets (not the jobs' progress rows) — of ``queues`` only,
    if given."""
    return {k: p.next_offset for k, p in positions(wh, queues=queues).items()}


def dispatch_hint(wh: Warehouse) -> tuple[int, dict[tuple[str, int], int]]:
    """Dispatch's hint (``%DISPATCH%`` rows): the commit_log version it recorded as
    indexed (-1: none) and the next offset it recorded per queue. The index may be ahead
    of it (``consume_queue.load_dispatch_state`` corrects it)."""
    listed: list[Any] | None = file_reads.dispatch_hint(wh)
    if listed is None:
        listed = wh.engine.rows(
            f"SELECT topic, queue_id, next_offset, progress_version FROM {wh.ref('offsets')} "
            f"WHERE consumer_group = {sql_str(DISPATCH_GROUP)}"
        )
    return file_reads.hint_of(listed)
