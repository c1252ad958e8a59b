"""Send-back: failed deliveries → ``%RETRY%<group>`` with back-off, or ``%DLQ%<group>``.

RocketMQ's ``sendMessageBack`` (docs/behaviour.md §3): a failed message becomes a new message in the
group's retry topic (queue 0) with ``reconsume_times + 1``, ``RETRY_TOPIC`` = its
original topic (set once), ``ORIGIN_MESSAGE_ID`` = the first message's id, and delay
level ``delay_level_when_next_consume`` if > 0 else ``3 + reconsume_times``; a retry
policy replaces the levels with absolute timers (a timeout is retried the same way).
With ``reconsume_times >= max_reconsume_times``, a level < 0, or no outcome at all
(poison), it goes to ``%DLQ%<group>`` instead, with ``DLQ_REASON``, and is never
delivered again unless an operator resends it. A message sent back untried (``DEFERRED``:
its listener timed out earlier in the pass) keeps its ``reconsume_times``.

Ids are derived from the failed delivery: store time = the delivery attempt's ``now``
(recorded before the listener was called, so a re-run after a kill gets the same one),
then a hash of (group, topic, queue, offset).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import date
from typing import TYPE_CHECKING, Any, NamedTuple

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from deltamq import ids
from deltamq.config import GroupConfig
from deltamq.constants import DlqReason, FailReason, Prop, dlq_topic, retry_topic
from deltamq.consumer import retry_delay_ms
from deltamq.tables.bodies import join_bodies, read_bodies, restore_columns, restored_message, stored_ids

if TYPE_CHECKING:
    from deltamq.context import Context

FAILURE_SCHEMA = (
    "consumer_group string, topic string, queue_id int, queue_offset bigint, msg_id string, "
    "cl_batch_id bigint, cl_batch_pos bigint, cl_date date, attempt_ts bigint, target string, "
    "level int, timer_ms bigint, dlq_reason string, max_reconsume int, error string, untried boolean"
)
# Rewritten below (system values are recomputed from the original properties).
_REMOVED = (
    Prop.DELAY,
    Prop.REAL_TOPIC,
    Prop.REAL_QID,
    Prop.TIMER_DELIVER_MS,
    Prop.DLQ_REASON,
    Prop.RETRY_TOPIC,
    Prop.ORIGIN_MESSAGE_ID,
    Prop.RECONSUME_TIME,
    Prop.MAX_RECONSUME_TIMES,
    Prop.LAST_ERROR,
)


@dataclass(frozen=True)
class Decision:
    target: str  # "retry" or "dlq"
    level: int | None = None
    timer_ms: int | None = None
    dlq_reason: DlqReason | None = None


@dataclass(frozen=True)
class Delivered:
    """A delivered consume_queue row, as much of it as a send-back needs (its fields are
    the :data:`DELIVERY_COLUMNS`)."""

    topic: str
    queue_id: int
    queue_offset: int
    msg_id: str
    cl_batch_id: int
    cl_batch_pos: int
    cl_date: date
    reconsume_times: int

    @classmethod
    def of(cls, row: Mapping[str, Any] | Any) -> Delivered:
        """From a row (a ``Row`` or a mapping) holding the :data:`DELIVERY_COLUMNS`."""
        values = {c: row[c] for c in DELIVERY_COLUMNS}
        return cls(**values | {"reconsume_times": values["reconsume_times"] or 0})


DELIVERY_COLUMNS = tuple(f.name for f in fields(Delivered))
"""The consume_queue columns a send-back needs of its delivery (:func:`failure`)."""


class Failure(NamedTuple):
    """One failed delivery on its way to its group's retry or dead-letter topic: the
    delivery, where it goes (:class:`Decision`) and why (``FAILURE_SCHEMA``'s columns)."""

    consumer_group: str
    topic: str
    queue_id: int
    queue_offset: int
    msg_id: str
    cl_batch_id: int
    cl_batch_pos: int
    cl_date: date
    attempt_ts: int
    target: str
    level: int | None
    timer_ms: int | None
    dlq_reason: DlqReason | None
    max_reconsume: int
    error: str | None
    untried: bool = False  # never handed to the listener: its copy keeps the retry count


def failure(
    cfg: GroupConfig,
    delivered: Delivered,
    *,
    attempt_ts: int,
    requested_level: int,
    reason: FailReason | None,
    max_level: int,
    error: str | None,
) -> Failure:
    """The send-back of one failed delivery, push or pull alike: ``delivered`` is its
    consume_queue row, ``attempt_ts`` the delivery's time (the send-back's ids
    derive from it), ``requested_level`` the listener's delay level (0: the default
    ladder), ``reason`` how it failed when not by the listener's answer."""
    d = decide(
        reconsume_times=delivered.reconsume_times,
        requested_level=requested_level,
        reason=reason,
        max_reconsume=cfg.max_reconsume_times,
        max_level=max_level,
        retry_policy=cfg.retry_policy,
        attempt_ts=attempt_ts,
    )
    return Failure(
        cfg.consumer_group,
        delivered.topic,
        delivered.queue_id,
        delivered.queue_offset,
        delivered.msg_id,
        delivered.cl_batch_id,
        delivered.cl_batch_pos,
        delivered.cl_date,
        attempt_ts,
        d.target,
        d.level,
        d.timer_ms,
        d.dlq_reason,
        cfg.max_reconsume_times,
        error,
        reason == FailReason.DEFERRED,
    )


LATER_COPY_DELAY_MS = 1_000
"""When a warehouse has no delay level, how long a later copy of a key waits (as a timer)."""


def decide(
    *,
    reconsume_times: int,
    requested_level: int,
    reason: FailReason | None,
    max_reconsume: int,
    max_level: int,
    retry_policy: Mapping[str, Any] | None,
    attempt_ts: int,
) -> Decision:
    """Where one failed message goes (pure): poison or an orderly queue's last suspend go
    to the DLQ; a negative level, too; past ``max_reconsume`` retries, too (a timeout is
    retried like any failure); otherwise a retry, at the requested level, by the retry
    policy, or at 3 + retries. A later copy of a de-duplication key (``LATER_COPY``) and a
    message a timed-out listener left untried (``DEFERRED``) go back at level 1, never
    dead-lettered for it."""
    if reason in (FailReason.POISON, FailReason.ORDERLY_MAX):
        return Decision("dlq", dlq_reason=DlqReason(reason))
    if reason in (FailReason.LATER_COPY, FailReason.DEFERRED):
        # not a failure: checked again once the first copy's outcome is known (or tried
        # at all), soon, and never dead-lettered for it
        if max_level >= 1:
            return Decision("retry", level=1)
        return Decision("retry", timer_ms=attempt_ts + LATER_COPY_DELAY_MS)
    if requested_level < 0:
        return Decision("dlq", dlq_reason=DlqReason.NEGATIVE_LEVEL)
    if max_reconsume >= 0 and reconsume_times >= max_reconsume:
        # a timeout is retried like a failure (RocketMQ sends back what ran past its
        # consume timeout); at the maximum the reason says how the last try ended
        last = DlqReason.TIMEOUT if reason == FailReason.TIMEOUT else DlqReason.MAX_RECONSUME
        return Decision("dlq", dlq_reason=last)
    if retry_policy is not None and requested_level == 0:
        return Decision("retry", timer_ms=attempt_ts + retry_delay_ms(retry_policy, reconsume_times))
    level = requested_level if requested_level > 0 else 3 + reconsume_times
    return Decision("retry", level=min(level, max_level))


def store(ctx: Context, failures: Sequence[Failure], fence: Callable[[], None] | None = None) -> None:
    """Append the sends-back of ``failures`` in one commit,
    skipping ids already stored (a re-run after a kill writes nothing twice)."""
    wh = ctx.warehouse
    fdf = ctx.engine.spark.createDataFrame(failures, FAILURE_SCHEMA)
    bodies = read_bodies(wh, (f.cl_date for f in failures), (f.cl_batch_id for f in failures))
    rows = plan_sendback(fdf, bodies)
    stored = stored_ids(wh, [(t, t) for t in sorted({f.attempt_ts for f in failures})])
    fresh = rows.join(stored, "msg_id", "left_anti")
    if fence:
        fence()
    ctx.commit(lambda: wh.append("commit_log", fresh), what="sendback")


def plan_sendback(failures: DataFrame, bodies: DataFrame) -> DataFrame:
    """Pure plan: failures (FAILURE_SCHEMA) + their commit_log rows → new commit_log rows."""
    j = join_bodies(failures, bodies, restore_columns())
    is_dlq = F.col("target") == F.lit("dlq")
    kind = F.when(is_dlq, F.lit(ids.KIND_DLQ)).otherwise(F.lit(ids.KIND_RETRY))
    batch = ids.engine_batch_id_col(F.col("attempt_ts"), kind)
    # (group, topic, queue, offset) names the delivery; its 64-bit hash is the row's position
    # in the batch (unique among all sends-back of one attempt) and the id's suffix.
    delivery = F.xxhash64(F.col("consumer_group"), F.col("topic"), F.col("queue_id"), F.col("queue_offset"))
    digest = F.lpad(F.hex(delivery), 16, "0")
    props = F.col("orig_props")
    empty = F.create_map().cast("map<string,string>")
    kept = F.map_filter(F.coalesce(props, empty), lambda k, v: ~k.isin(*_REMOVED))
    new_reconsume = F.col("orig_reconsume") + F.when(F.col("untried"), F.lit(0)).otherwise(F.lit(1))
    system = F.create_map(
        F.lit(Prop.RETRY_TOPIC),
        F.coalesce(props.getItem(Prop.RETRY_TOPIC), F.col("topic")),
        F.lit(Prop.ORIGIN_MESSAGE_ID),
        F.coalesce(props.getItem(Prop.ORIGIN_MESSAGE_ID), props.getItem(Prop.UNIQ_KEY), F.col("msg_id")),
        F.lit(Prop.RECONSUME_TIME),
        new_reconsume.cast("string"),
        F.lit(Prop.MAX_RECONSUME_TIMES),
        F.col("max_reconsume").cast("string"),
    )
    last_error = F.when(
        F.col("error").isNotNull(), F.create_map(F.lit(Prop.LAST_ERROR), F.col("error"))
    ).otherwise(empty)
    extra = (
        F.when(is_dlq, F.create_map(F.lit(Prop.DLQ_REASON), F.col("dlq_reason")))
        .when(
            F.col("timer_ms").isNotNull(),
            F.create_map(F.lit(Prop.TIMER_DELIVER_MS), F.col("timer_ms").cast("string")),
        )
        .otherwise(F.create_map(F.lit(Prop.DELAY), F.col("level").cast("string")))
    )
    target_topic = F.when(is_dlq, F.concat(F.lit(dlq_topic("")), F.col("consumer_group"))).otherwise(
        F.concat(F.lit(retry_topic("")), F.col("consumer_group"))
    )
    return restored_message(
        j,
        msg_id=F.concat(ids.msg_id_col(batch, F.lit(0)).substr(1, 16), digest),
        topic=target_topic,
        queue_id=F.lit(0),
        properties=F.map_concat(kept, system, extra, last_error),
        store_ts=F.col("attempt_ts"),
        reconsume_times=new_reconsume,
        batch_id=batch,
        batch_pos=delivery,
    )
