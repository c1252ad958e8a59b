"""Deliver: RocketMQ's concurrent push consumer on Delta (docs/behaviour.md §3).

Per CLUSTERING group, for every subscribed queue (its own ``%RETRY%<group>`` included):
take index rows from the group's offset (``pull_batch_size`` of them, or with the default 0
as many as the pass's byte budget allows: :func:`size_takes`), skip those whose tag
does not match the subscription (tag hash first, tag string after, as RocketMQ does),
join their bodies by batch-id ranges, and hand them to the group's listener in chunks
of ``consume_message_batch_max_size`` — inside the engine (``mapInArrow``), each call in
an isolated worker process (``listener_worker``).

Order of effects, so a kill anywhere loses nothing:
1. the attempt is recorded in ``offsets`` (``attempts + 1``, ``attempt_ts``) before any
   listener runs;
2. the listener outcomes are materialised exactly once (collected: one small row per
   message) and every later write is derived from them;
3. failures are sent back (one ``commit_log`` append; ids derived from the delivery,
   already-stored ones skipped);
4. offsets advance past every taken message and the attempt is cleared.
A kill before 4 redelivers the in-flight messages (at-least-once): the re-run takes the
same range with the recorded attempt time, so its sends-back have the same ids and are not
stored twice. A listener that kills its worker or hangs is handled inside the call
(``listener_worker``); should whole attempts keep ending without an outcome anyway, the
queue's head message is dead-lettered (``poison``) after ``poison_tries`` of them. An
attempt that raised in this process after the outcomes were in (a store error in steps
3-4) is not counted by the runner that saw it (:meth:`Memory.failed_pass`).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F

from deltamq import dedup, faults
from deltamq.constants import FailReason
from deltamq.consumer import ImportPathListener, is_columnar, resolve_listener
from deltamq.filters import compile_sql92, tags_match
from deltamq.jobs import consume_partition, deliver_files, sendback
from deltamq.jobs.deliver_outcomes import (
    Consumed,
    Counts,
    Failed,
    Taken,
    counts_of,
    deferred,
    later_copies,
    outcomes,
    poisoned,
    taken_of,
)
from deltamq.jobs.deliver_plan import POISON_TRIES, QueueTake, plan_takes
from deltamq.jobs.deliver_result import DeliverResult
from deltamq.jobs.listener_worker import Home
from deltamq.tables.bodies import join_bodies, read_bodies
from deltamq.tables.consume_queue import visible_heads
from deltamq.tables.offsets import (
    Carried,
    OffsetsMerge,
    Position,
    QueueKey,
    carrying,
    forward,
    positions,
    source,
)
from deltamq.tables.ranges import queue_ranges

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from deltamq.body_reads import BodyFiles
    from deltamq.config import GroupConfig
    from deltamq.context import Context
    from deltamq.engine import Views

log = logging.getLogger(__name__)
JOB = "deliver"
_PARALLEL_ABOVE = 10_000


@dataclass
class Memory:
    """What deliver remembers between passes (the tick runner owns it): the mean body size
    of the messages it handed over, which turns ``deliver_max_bytes`` into a number of
    messages for the automatic takes. A fresh one reads the last deliver on record."""

    bytes_per_message: float | None = None
    seeded: bool = False
    # per queue: (its offset, attempts there that failed with an error this process saw)
    failed: dict[QueueKey, tuple[int, int]] = field(default_factory=dict)

    def learn(self, messages: int, body_bytes: int) -> None:
        if messages > 0:
            self.bytes_per_message = max(1.0, body_bytes / messages)

    def failed_pass(self, takes: Iterable[QueueTake]) -> None:
        """A pass raised after its listeners' outcomes were in: its attempts are excused."""
        for t in takes:
            key = QueueKey(t.group, t.client, t.topic, t.queue_id)
            at, n = self.failed.get(key, (t.lo, 0))
            self.failed[key] = (t.lo, (n if at == t.lo else 0) + 1)

    def excused(self, offsets: Mapping[QueueKey, Position]) -> dict[QueueKey, int]:
        """The failed attempts that still stand at each queue's offset."""
        standing = {k: v for k, v in self.failed.items() if k in offsets and offsets[k].next_offset == v[0]}
        self.failed = standing
        return {k: n for k, (_, n) in self.failed.items()}


def _parallelism(spark: SparkSession) -> int:
    try:
        return max(1, int(spark.conf.get("spark.default.parallelism", "0") or 0) or (os.cpu_count() or 1))
    except Exception:  # noqa: BLE001 - engines without the setting
        return os.cpu_count() or 1


def _listener_bytes(ctx: Context, group: str, path: str | None) -> bytes | None:
    from pyspark import cloudpickle

    fn = ctx.catalog.listeners.get(group)
    if fn is not None:
        pickled: bytes = cloudpickle.dumps(fn)  # type: ignore[no-untyped-call]
        return pickled
    if path:
        return pickle.dumps(ImportPathListener(path))
    return None


def _is_columnar(ctx: Context, group: str, cfg: GroupConfig) -> bool:
    """Whether the group's listener is columnar (an import path that cannot be imported
    here is taken as not: its workers report why)."""
    fn = ctx.catalog.listeners.get(group)
    if fn is None and cfg.listener:
        try:
            fn = resolve_listener(cfg.listener)
        except Exception:  # noqa: BLE001 - whatever stops the import, the workers report it
            return False
    return is_columnar(fn)


def auto_budget(ctx: Context, memory: Memory | None, now: int) -> int | None:
    """Messages the automatic takes of this pass may hand over together:
    ``deliver_max_bytes`` over the mean body size deliver last saw (None while unknown)."""
    if memory is None:
        return None
    if not memory.seeded:
        memory.seeded = True
        if memory.bytes_per_message is None:
            _seed(ctx, memory, now)
    if memory.bytes_per_message is None:
        return None
    return max(1, int(ctx.config.deliver_max_bytes / memory.bytes_per_message))


def _seed(ctx: Context, memory: Memory, now: int) -> None:
    """The mean body size of the last deliver on record (the last two days of job_runs)."""
    since = (datetime.fromtimestamp(now / 1000, UTC) - timedelta(days=1)).date()
    rows = ctx.engine.rows(
        "SELECT details['handed_over'] AS n, details['body_bytes'] AS b "
        f"FROM {ctx.warehouse.ref('job_runs')} "
        f"WHERE run_date >= DATE'{since.isoformat()}' AND job = '{JOB}' AND details['body_bytes'] > 0 "
        "ORDER BY end_ts DESC LIMIT 1"
    )
    if rows and rows[0]["n"]:
        memory.learn(rows[0]["n"], rows[0]["b"])


# --- running: plan → take → consume → decide → write --------------------------------------------
@dataclass(frozen=True)
class Pass:
    """What one pass works on: the push groups (those with a listener), their listeners
    (pickled for the workers) and what each takes from which queue."""

    groups: dict[str, GroupConfig]
    listeners: dict[str, bytes]
    takes: list[QueueTake]
    heads: dict[tuple[str, int], int]
    skipped: tuple[str, ...]  # groups without a listener (pull or sink groups)
    sinks: tuple[str, ...]

    @property
    def attempt_ts(self) -> dict[tuple[str, str, str, int], int]:
        return {(t.group, t.client, t.topic, t.queue_id): t.attempt_ts for t in self.takes}


# (next offset, suspends, suspended until) a queue moves to instead of past its take
Held = tuple[int, int, int | None]


@dataclass(frozen=True)
class Decided:
    """Where every failure goes, where each queue's offset moves, and what the decisions
    counted (``retried``, ``dead_lettered``, ``suspended``, ...)."""

    failures: tuple[sendback.Failure, ...]
    positions: Mapping[QueueKey, Held]
    errors: tuple[tuple[str, str, str], ...]
    setup_errors: Mapping[str, str]  # group -> why its listener could not be loaded
    counts: Counts


def run(
    ctx: Context,
    now: int,
    *,
    fence: Callable[[], None] | None = None,
    memory: Memory | None = None,
    only: Collection[tuple[str, int]] | None = None,
    carried: Carried | None = None,
    heads: Mapping[tuple[str, int], int] | None = None,
) -> DeliverResult:
    """One deliver pass at ``now`` (the module docstring gives the order of effects).
    ``memory`` (the tick runner's) sizes the automatic takes and learns from the pass;
    without it they take :data:`AUTO_FIRST_TAKE` per queue. ``only``: the (topic, queue)
    pairs to take from (default: every queue). ``carried``: other jobs' progress rows
    written with the attempt record (left unwritten when the pass takes nothing);
    ``heads``: the index heads, when the caller has them (dispatch's pass just now)."""
    work = plan(ctx, now, auto_budget(ctx, memory, now), only, heads, memory)
    if not work.takes:
        return DeliverResult(groups=len(work.groups), skipped_groups=work.skipped, sinks=work.sinks)
    # 1. record the attempt before any listener runs
    if fence:
        fence()
    _record_attempts(ctx, work, now, carried)
    faults.point("deliver.after_attempt_commit")
    # 2. take, filter, call the listeners; outcomes materialised once: from the tables'
    # files for a small pass (deliver_files), else through the engine
    with ctx.engine.views() as views:
        done = _from_files(ctx, work)
        if done is not None:
            taken, consumed = done
        else:
            taken = take(ctx, views, work, now)
            consumed = consume(ctx, work, taken)
        # 3. failures → retry / DLQ; 4. keys, then offsets past everything taken
        with _excused_on_error(memory, work.takes):
            faults.point("deliver.after_listener")
            decided = decide(ctx, work, taken, consumed, now)
    with _excused_on_error(memory, work.takes):
        write(ctx, work, consumed, decided, now, fence)
    if memory is not None:
        memory.learn(consumed.handed_over, consumed.body_bytes)
    return _result(work, taken, consumed, decided)


@contextmanager
def _excused_on_error(memory: Memory | None, takes: list[QueueTake]) -> Iterator[None]:
    """An error raised here, once the listeners' outcomes are in, is this process's (a
    store that failed, say), not a listener that never answered: the runner's memory
    keeps the attempt from counting towards the poison rule."""
    try:
        yield
    except Exception:
        if memory is not None:
            memory.failed_pass(takes)
        raise


def plan(
    ctx: Context,
    now: int,
    budget: int | None = None,
    only: Collection[tuple[str, int]] | None = None,
    heads: Mapping[tuple[str, int], int] | None = None,
    memory: Memory | None = None,
) -> Pass:
    """The push groups, their listeners, and what each takes (:func:`plan_takes`;
    ``budget``: messages the automatic takes share, None while unknown; ``only``: the
    (topic, queue) pairs to take from, default all; ``heads``: the index heads, read when
    not given)."""
    all_groups = ctx.catalog.groups()
    # a sink's messages are the sink's: a listener registered for its group is not called
    found = {g: _listener_bytes(ctx, g, cfg.listener) for g, cfg in all_groups.items() if not cfg.sink_table}
    listeners = {g: b for g, b in found.items() if b is not None}
    groups = {g: cfg for g, cfg in all_groups.items() if g in listeners}
    skipped = tuple(sorted(set(all_groups) - set(groups)))
    sinks = tuple(sorted(g for g, cfg in all_groups.items() if cfg.sink_table))
    if not groups:
        return Pass({}, {}, [], {}, skipped, sinks)
    visible = visible_heads(ctx.warehouse, now, heads)
    if only is not None:
        visible = {q: h for q, h in visible.items() if q in only}
    offsets = positions(ctx.warehouse, sorted(groups))
    excused = memory.excused(offsets) if memory is not None else None
    takes = plan_takes(
        groups, ctx.catalog.subscriptions(), visible, offsets, now, auto_budget=budget, excused=excused
    )
    return Pass(groups, listeners, takes, visible, skipped, sinks)


def take(ctx: Context, views: Views, work: Pass, now: int) -> Taken:
    """The index rows of every take, matched against the subscription (tag hash and tag, or
    SQL92), marked poison (a head whose attempts keep ending without an outcome) or
    duplicate (a key consumed within the group's window); left in a view of ``views``."""
    spark = ctx.engine.spark
    takes = work.takes
    take_df = spark.createDataFrame(
        [
            (
                t.group,
                t.client,
                t.topic,
                t.queue_id,
                t.lo,
                t.hi,
                list(t.tags) if t.tags is not None else None,
                t.poison,
                t.suspends,
            )
            for t in takes
        ],
        "consumer_group string, client_id string, t_topic string, t_qid int, lo bigint, hi bigint, "
        "tag_list array<string>, "
        "poison boolean, suspends int",
    )
    pred = queue_ranges((t.topic, t.queue_id, t.lo, t.hi) for t in takes)
    cq = ctx.warehouse.read("consume_queue").where(pred)
    taken = cq.join(
        F.broadcast(take_df),
        (F.col("topic") == F.col("t_topic"))
        & (F.col("queue_id") == F.col("t_qid"))
        & (F.col("queue_offset") >= F.col("lo"))
        & (F.col("queue_offset") < F.col("hi")),
    )
    matches = tags_match(F.col("tag_list"))
    for g, topic, expression in sorted({(t.group, t.topic, t.sql92) for t in takes if t.sql92}):
        matches = F.when(
            (F.col("consumer_group") == g) & (F.col("t_topic") == topic), compile_sql92(expression)
        ).otherwise(matches)
    # orderly: the suspend count belongs to the queue's head message only
    taken = taken.withColumn("matched", F.coalesce(matches, F.lit(False))).withColumn(
        "suspends", F.when(F.col("queue_offset") == F.col("lo"), F.col("suspends")).otherwise(F.lit(0))
    )
    # idempotent consumption: keys the group already consumed within its window
    taken = dedup.mark(ctx.warehouse, taken, work.groups, now)
    # ... and copies of one key taken together: the first goes to the listener, the later
    # ones wait for its outcome (sent back, LATER_COPY)
    taken = dedup.later_copies(taken, work.groups, F.col("matched") & ~F.col("poison"))
    view = views.add(taken, "deliver_taken")
    # What was taken, summarised in the engine (one row per group, outcome class and body
    # batch): the counts, and the batch ranges the bodies are read by.
    summary = ctx.engine.rows(
        "SELECT consumer_group, matched, poison, dup, later, cl_date, cl_batch_id, count(*) AS n "
        f"FROM {view} GROUP BY consumer_group, matched, poison, dup, later, cl_date, cl_batch_id"
    )
    return taken_of(view, summary)


def _from_files(ctx: Context, work: Pass) -> tuple[Taken, Consumed] | None:
    """The take and the listener calls of a small pass from the tables' files
    (deliver_files); None when the pass is the engine's."""
    local = ctx.warehouse.storage.is_local
    if not deliver_files.eligible(work.groups, work.takes, ctx.engine.mode == "embedded", local):
        return None
    table = deliver_files.taken_rows(ctx.warehouse, work.takes)
    if table is None:
        return None
    taken = taken_of("", deliver_files.summary(table), table)
    if not taken.deliverable:
        return taken, Consumed()
    orderly = any(cfg.orderly for cfg in work.groups.values())
    rows = deliver_files.consume(
        ctx.warehouse, table, lambda files: _consumer(ctx, work, None, files), os.cpu_count() or 1, orderly
    )
    if rows is None:
        return None
    return taken, outcomes(rows, sum(r["n"] for r in taken.deliverable))


def consume(ctx: Context, work: Pass, taken: Taken) -> Consumed:
    """Join the deliverable rows with their bodies and hand them to the listeners inside
    the engine (``mapInArrow``, each call in a worker process); collect the outcomes."""
    if not taken.deliverable:
        return Consumed()
    engine, spark, wh = ctx.engine, ctx.engine.spark, ctx.warehouse
    groups = work.groups
    n_deliverable = sum(r["n"] for r in taken.deliverable)
    bodies = read_bodies(
        wh, (r["cl_date"] for r in taken.deliverable), (r["cl_batch_id"] for r in taken.deliverable)
    )
    taken_rows = spark.table(taken.view).where(
        F.col("matched") & ~F.col("poison") & ~F.col("dup") & ~F.col("later")
    )
    msgs = join_bodies(
        taken_rows.drop("properties", "born_ts"),
        bodies,
        ["body", "born_ts", "flag", "sys_flag", "properties"],
    ).select(
        "consumer_group",
        "client_id",
        *consume_partition.MESSAGE_COLUMNS,
        "cl_date",
        "cl_batch_id",
        "cl_batch_pos",
        "dkey",
    )
    orderly = any(cfg.orderly for cfg in groups.values())
    # the embedded server runs this in its own process: listeners get the broker's
    # environment and path (never shipped to a remote endpoint)
    consumer = _consumer(ctx, work, Home.here() if engine.mode == "embedded" else None)
    if orderly:
        # whole queues per partition (orderly needs them), spread over the engine's cores
        msgs = msgs.repartition(_parallelism(spark), "consumer_group", "client_id", "topic", "queue_id")
    elif n_deliverable > _PARALLEL_ABOVE and not all(_is_columnar(ctx, g, cfg) for g, cfg in groups.items()):
        # concurrent groups need no whole queues: even partitions, one per core (by queue,
        # 4 queues on 2 cores split 3:1). Columnar listeners cost little per message, so
        # for them the shuffle of every body costs more than uneven partitions do
        # (consume of 1M x 1 KiB: 1.3 s without it, 1.8-1.9 s with it).
        msgs = msgs.repartition(_parallelism(spark))
    return outcomes(msgs.mapInArrow(consumer, consume_partition.OUT_SCHEMA).collect(), n_deliverable)


def _consumer(ctx: Context, work: Pass, home: Home | None, files: BodyFiles | None = None) -> Any:
    """The partition function of the pass's groups (``consume_partition``), its listeners
    run in worker processes with ``home``'s environment (None: this process's), reading
    their bodies from ``files`` when given."""
    groups = work.groups
    return consume_partition.make_consumer(
        {g: work.listeners[g] for g in groups},
        {g: cfg.consume_batch_size for g, cfg in groups.items()},
        {g: cfg.consume_timeout_ms / 1000.0 for g, cfg in groups.items()},
        POISON_TRIES,
        frozenset(g for g, cfg in groups.items() if cfg.orderly),
        home,
        files,
    )


def _suspend(
    work: Pass,
    takes: Mapping[QueueKey, QueueTake],
    failures: Iterable[Failed],
    positions: dict[QueueKey, Held],
    counted: list[tuple[str, str, int]],
    until: int,
) -> list[Failed]:
    """Orderly queues with a suspended chunk: each waits at the chunk's head until
    ``until`` (``positions``), or, suspended ``max_reconsume_times`` already, the chunk is
    returned to be dead-lettered and the queue moves past it."""
    suspended: dict[QueueKey, list[Failed]] = defaultdict(list)
    for o in failures:
        if o.reason == FailReason.SUSPEND:
            suspended[o.queue].append(o)
    to_dlq: list[Failed] = []
    for qkey, chunk in suspended.items():
        t = takes[qkey]
        chunk.sort(key=lambda o: o.delivered.queue_offset)
        first = chunk[0].delivered.queue_offset
        reconsumed = t.suspends if first == t.lo else 0
        if 0 <= work.groups[qkey.group].max_reconsume_times <= reconsumed:
            to_dlq += [replace(o, reason=FailReason.ORDERLY_MAX) for o in chunk]
            positions[qkey] = (chunk[-1].delivered.queue_offset + 1, 0, None)
        else:
            counted.append((qkey.group, "suspended", len(chunk)))
            positions[qkey] = (first, reconsumed + 1, until)
    return to_dlq


def decide(ctx: Context, work: Pass, taken: Taken, consumed: Consumed, now: int) -> Decided:
    """Orderly queues stop at their suspended chunk (its head waits, or at the maximum goes
    to the DLQ and the queue moves on); every other failure goes the send-back way
    (:func:`sendback.failure`), a BROADCASTING one is logged and dropped."""
    groups = work.groups
    counted: list[tuple[str, str, int]] = []
    positions: dict[QueueKey, Held] = {}
    takes_by_queue = {QueueKey(t.group, t.client, t.topic, t.queue_id): t for t in work.takes}
    # a listener that cannot be loaded consumed nothing: its queues stay where they were
    # (no retry, no dead letter; the tick says so) until the listener is fixed
    setup_errors: dict[str, str] = {}

    def hold_at(q: QueueKey, offset: int) -> None:  # the queue stays here (or at an earlier one held)
        held = min(positions.get(q, (offset, 0, None))[0], offset)
        positions[q] = (held, takes_by_queue[q].suspends, None)

    def hold(o: Failed) -> None:
        hold_at(o.queue, o.delivered.queue_offset)

    for q, (offset, n, why) in consumed.setup.items():  # per queue (deliver_outcomes.outcomes)
        hold_at(q, offset)
        counted.append((q.group, "setup_failed", n))
        setup_errors.setdefault(q.group, why)
    # not handed over (a suspended queue's position comes below), or left by a listener
    # that timed out: held, or sent back untried below messages the pass handled
    holds, untried = deferred(ctx, taken, consumed.deferred)
    for q, offset in holds.items():
        hold_at(q, offset)
    for q, offset in consumed.held.items():  # behind an orderly queue's stop
        hold_at(q, offset)
    # a later copy of a key waits for the first one's outcome; a group that consumed
    # nothing (its listener cannot load) has none yet: the copy holds its queue as well
    later: list[Failed] = []
    for o in later_copies(ctx, taken):
        if o.group in setup_errors:
            hold(o)
        else:
            later.append(o)
    to_dlq = _suspend(
        work, takes_by_queue, consumed.failures, positions, counted, now + ctx.config.orderly_suspend_ms
    )
    attempt_ts = work.attempt_ts
    max_level = ctx.catalog.max_delay_level()
    failures: list[sendback.Failure] = []
    errors: list[tuple[str, str, str]] = []
    for o in [*consumed.failures, *untried, *to_dlq, *poisoned(ctx, taken), *later]:
        # a suspended orderly chunk's error too (a listener that cannot load is in setup_errors)
        if o.error and len(errors) < 20 and o.reason != FailReason.LATER_COPY:
            errors.append((o.group, o.delivered.msg_id, o.error))
        if o.reason == FailReason.SUSPEND:  # holds its queue (_suspend), not sent back
            continue
        g = o.group
        cfg = groups[g]
        if cfg.mode == "BROADCASTING":  # logged and dropped, never retried (docs/behaviour.md §3)
            counted.append((g, "dropped", 1))
            log.warning("broadcast %s/%s dropped %s: %s", g, o.client, o.delivered.msg_id, o.error)
            continue
        d = sendback.failure(
            cfg,
            o.delivered,
            attempt_ts=attempt_ts[o.queue],
            requested_level=o.level,
            reason=o.reason,
            max_level=max_level,
            error=o.error,
        )
        if o.reason == FailReason.DEFERRED:  # not a failure: sent back before any try
            counted.append((g, "sent_back_untried", 1))
        elif o.reason != FailReason.LATER_COPY:  # counted by the take
            counted.append((g, "retried" if d.target == "retry" else "dead_lettered", 1))
        if o.reason == FailReason.POISON or (o.reason == FailReason.TIMEOUT and d.target == "dlq"):
            counted.append((g, "poison", 1))
        failures.append(d)
    return Decided(tuple(failures), positions, tuple(errors), setup_errors, counts_of(counted))


def write(
    ctx: Context,
    work: Pass,
    consumed: Consumed,
    decided: Decided,
    now: int,
    fence: Callable[[], None] | None,
) -> None:
    """Sends-back first, then the consumed keys, then the offsets (the attempt cleared);
    nothing of a group deleted (or deleted and created again) while its listeners ran."""
    gone = ctx.catalog.changed(work.groups)
    if gone:
        log.warning(
            "deliver: group(s) %s deleted during the pass: their outcomes are not written", sorted(gone)
        )
    failures = [f for f in decided.failures if f.consumer_group not in gone]
    if failures:
        sendback.store(ctx, failures, fence)
    faults.point("deliver.after_sendback_commit")
    # keys of what was consumed, before the offsets move (a re-run skips them)
    keys = [k for k in consumed.keys if k[0] not in gone]
    if keys:
        if fence:
            fence()
        dedup.record(ctx.warehouse, keys, now, policy=ctx.config.commit_policy)
        dedup.prune(ctx.warehouse, work.groups, now, policy=ctx.config.commit_policy)
    faults.point("deliver.after_keys_commit")
    if fence:  # a runner fenced while its listeners ran moves no offset
        fence()
    _advance(ctx, work, now, decided.positions)
    faults.point("deliver.after_offsets_commit")


def _result(work: Pass, taken: Taken, consumed: Consumed, decided: Decided) -> DeliverResult:
    by_group = counts_of(
        [
            (g, k, n)
            for counts in (taken.counts, decided.counts)
            for g, c in counts.items()
            for k, n in c.items()
        ]
        + [(g, "consumed", n) for g, n in consumed.consumed.items()]
    )
    total: defaultdict[str, int] = defaultdict(int)
    for c in by_group.values():
        for k, v in c.items():
            total[k] += v
    behind: defaultdict[str, int] = defaultdict(int)
    for t in work.takes:
        behind[t.group] += work.heads.get((t.topic, t.queue_id), t.hi) - t.lo
    return DeliverResult(
        backlog=sum(behind.values()),
        backlog_by_group=dict(behind),
        taken=taken.rows,
        handed_over=consumed.handed_over,
        body_bytes=consumed.body_bytes,
        consumed=total["consumed"],
        deduplicated=total["deduplicated"],
        later_copies=total["later_copies"],
        setup_failed=total["setup_failed"],
        setup_errors=tuple(sorted(decided.setup_errors.items())),
        filtered=total["filtered"],
        retried=total["retried"],
        dead_lettered=total["dead_lettered"],
        poison=total["poison"],
        dropped=total["dropped"],
        suspended=total["suspended"],
        groups=len(work.groups),
        errors=tuple(decided.errors),
        skipped_groups=work.skipped,
        by_group={g: by_group.get(g, {}) for g in work.groups},
        sinks=work.sinks,
    )


def _record_attempts(ctx: Context, work: Pass, now: int, carried: Carried | None = None) -> None:
    """Mark the attempt in flight on every queue taken (``attempts`` + 1, its ``attempt_ts``).
    The count written is the one read when the take was planned, plus one: a commit re-run
    after its answer was lost (it landed) writes the same count again, never one more.
    ``carried``: other jobs' progress rows (dispatch's hint) written in the same commit."""
    pending = carried if carried is not None and not carried.written else None
    columns = ("next_offset", "attempts", "attempt_ts") + (("progress_version", "carried") if pending else ())
    merge = OffsetsMerge(columns, now, extra={"carried": "boolean"} if pending else {})
    more = {"progress_version": None, "carried": False} if pending else {}
    for t in work.takes:
        merge.add(
            t.group,
            t.topic,
            t.queue_id,
            t.client,
            next_offset=t.lo,
            attempts=t.attempts + 1,
            attempt_ts=t.attempt_ts,
            **more,
        )
    update = {"attempts": source("attempts"), "attempt_ts": source("attempt_ts")}
    insert = {
        "next_offset": source("next_offset"),
        "attempts": source("attempts"),
        "attempt_ts": source("attempt_ts"),
    }
    if pending is not None:
        pending.add_to(merge)
        update = carrying(update)
        insert["progress_version"] = source("progress_version")
    ctx.commit_offsets(merge, work.groups, update, insert)
    if pending is not None:
        pending.landed()


def _advance(ctx: Context, work: Pass, now: int, positions: Mapping[QueueKey, Held]) -> None:
    """Offsets past everything taken (or, for a suspended orderly queue, to its head with
    the suspend count and time); the attempt is cleared."""
    merge = OffsetsMerge(("next_offset", "suspends", "suspend_until"), now)
    for t in work.takes:
        nxt, suspends, until = positions.get(
            QueueKey(t.group, t.client, t.topic, t.queue_id), (t.hi, 0, None)
        )
        merge.add(
            t.group, t.topic, t.queue_id, t.client, next_offset=nxt, suspends=suspends, suspend_until=until
        )
    update = {
        "next_offset": forward("next_offset"),
        "suspends": source("suspends"),
        "suspend_until": source("suspend_until"),
        "attempts": "0",
        "attempt_ts": "CAST(NULL AS BIGINT)",
    }
    ctx.commit_offsets(merge, work.groups, update, None)
