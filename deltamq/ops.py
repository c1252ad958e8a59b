"""Operator tooling: dead letters, message traces, rebuilding the index, the report.

Admin operations (CLI ``deltamq dlq|msg|rebuild-index|report`` and ``Broker`` methods),
not tick jobs. Look-ups by message id are pruned by the store time every id encodes
(``ids.parse_msg_id``); look-ups by key or SQL predicate scan ``consume_queue`` (no
bodies), narrowed by a time range when one is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from deltamq import ids
from deltamq.clock import ms_to_iso
from deltamq.constants import (
    DISPATCH_GROUP,
    DLQ_PREFIX,
    JOB_NAMES,
    RESEND_PRODUCER_GROUP,
    RETRY_PREFIX,
    SCHEDULE_TOPIC,
    TIMER_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    Prop,
)
from deltamq.errors import ConfigError, DeltaMQError, OperationError, TableDamaged, first_line
from deltamq.filters import subscription_filter
from deltamq.message import Message, validate_group_name
from deltamq.producer import Producer
from deltamq.tables import consume_queue
from deltamq.tables.bodies import join_bodies, read_bodies
from deltamq.tables.leases import Leases, LeaseTerms
from deltamq.tables.offsets import QueueKey, forget, group_positions

if TYPE_CHECKING:
    from deltamq.config import GroupConfig, Subscription
    from deltamq.context import Context
    from deltamq.tables.warehouse import Warehouse

# properties the broker sets; a resent message starts without them
_SYSTEM_PROPS = tuple(
    v for k, v in vars(Prop).items() if not k.startswith("_") and isinstance(v, str) and v != Prop.RESENT_FROM
)


# --- dead letters ---------------------------------------------------------------------------
def _id_floor(msg_id: str) -> int:
    """The smallest batch id a row derived from ``msg_id`` can have (its store time)."""
    try:
        batch, _ = ids.parse_msg_id(msg_id)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return (batch >> ids.BATCH_RANDOM_BITS) << ids.BATCH_RANDOM_BITS


def _time_range(since: int | None, until: int | None) -> Column:
    pred = F.lit(True)
    if since is not None:
        pred = pred & (F.col("cl_batch_id") >= F.lit(int(since) << ids.BATCH_RANDOM_BITS))
    if until is not None:
        pred = pred & (F.col("store_ts") < F.lit(int(until)))
    return pred


def dead_letters(
    ctx: Context,
    *,
    group: str | None = None,
    since: int | None = None,
    until: int | None = None,
    msg_ids: list[str] | None = None,
    where: str | None = None,
) -> DataFrame:
    """Dead letters (``%DLQ%<group>`` entries) selected by group, store-time range
    [since, until), ids (the dead letter's or the original's) and/or an SQL predicate over
    the ``consume_queue`` row (``properties['DLQ_REASON'] = 'max_reconsume'``, ``keys``…)."""
    if group is not None and ctx.catalog.group(validate_group_name(group)) is None:
        # a deleted group's dead letters stay selectable: its %DLQ% topic remains
        if DLQ_PREFIX + group not in ctx.catalog.topics():
            ctx.catalog.require_group(group, " and it has no dead letters")
    cq = ctx.warehouse.read("consume_queue")
    topics = F.col("topic") == F.lit(DLQ_PREFIX + group) if group else F.col("topic").startswith(DLQ_PREFIX)
    pred = topics & _time_range(since, until)
    if msg_ids:
        floor = min(_id_floor(m) for m in msg_ids)
        pred = (
            pred
            & (F.col("cl_batch_id") >= F.lit(floor))
            & (F.col("msg_id").isin(*msg_ids) | F.col("properties").getItem(Prop.UNIQ_KEY).isin(*msg_ids))
        )
    out = cq.where(pred)
    if where:
        try:
            out = out.where(F.expr(where))
            out.schema  # noqa: B018 - resolves the predicate now, so a bad one fails here
        except Exception as e:  # noqa: BLE001 - the engine's parse/analysis error
            raise ConfigError(f"where={where!r} is not a predicate over consume_queue columns: {e}") from None
    return out.select(
        F.expr(f"substring(topic, {len(DLQ_PREFIX) + 1})").alias("consumer_group"),
        "msg_id",
        F.coalesce(F.col("properties").getItem(Prop.UNIQ_KEY), F.col("msg_id")).alias("origin_id"),
        F.col("properties").getItem(Prop.RETRY_TOPIC).alias("original_topic"),
        F.col("properties").getItem(Prop.DLQ_REASON).alias("reason"),
        "reconsume_times",
        "store_ts",
        "tags",
        "keys",
        F.col("properties").getItem(Prop.LAST_ERROR).alias("last_error"),
        "queue_offset",
        "cl_date",
        "cl_batch_id",
        "cl_batch_pos",
    )


@dataclass(frozen=True, kw_only=True)
class ResendResult:
    selected: int
    resent: int
    already_resent: int
    msg_ids: tuple[str, ...]


def resent_as(ctx: Context, letters: list[dict[str, Any]]) -> dict[str, str]:
    """Of dead letters (rows with ``msg_id`` and ``cl_batch_id``), those resent already:
    ``{dead letter id: the resent message's id}`` (read from the letters' store time on)."""
    if not letters:
        return {}
    floor = min(r["cl_batch_id"] for r in letters) >> ids.BATCH_RANDOM_BITS << ids.BATCH_RANDOM_BITS
    return {
        r["f"]: r["msg_id"]
        for r in ctx.warehouse.read("commit_log")
        .where(
            (F.col("batch_id") >= F.lit(floor))
            & F.col("properties").getItem(Prop.RESENT_FROM).isin(*[r["msg_id"] for r in letters])
        )
        .select(F.col("properties").getItem(Prop.RESENT_FROM).alias("f"), "msg_id")
        .collect()
    }


def resend(ctx: Context, letters: DataFrame, *, rate_per_s: float | None = None) -> ResendResult:
    """Send dead letters back to their original topic as new messages (same body, tags,
    keys and user properties; ``RESENT_FROM`` = the dead letter's id), at most
    ``rate_per_s`` per second. A dead letter already resent (a re-run after a kill, or
    twice by hand) is skipped. Every original topic is checked before anything is sent."""
    if rate_per_s is not None and (isinstance(rate_per_s, bool) or not rate_per_s > 0):
        raise ConfigError(f"rate_per_s={rate_per_s!r} must be a number > 0")
    rows = [r.asDict() for r in letters.collect()]
    if not rows:
        return ResendResult(selected=0, resent=0, already_resent=0, msg_ids=())
    done = resent_as(ctx, rows)
    todo = [r for r in rows if r["msg_id"] not in done]
    for r in todo:
        if not r["original_topic"]:
            raise ConfigError(f"dead letter {r['msg_id']} has no RETRY_TOPIC: its original topic is unknown")
    for topic in sorted({r["original_topic"] for r in todo}):
        try:
            ctx.catalog.validate_writable_topic(topic)
        except DeltaMQError as e:
            named = [r["msg_id"] for r in todo if r["original_topic"] == topic]
            raise type(e)(
                f"{len(named)} of the {len(todo)} dead letters to resend go back to topic {topic!r}, which "
                f"cannot be written ({first_line(e)}); nothing was resent. Leave them out: where="
                f"\"properties['RETRY_TOPIC'] <> '{topic}'\", or by msg_ids (e.g. {', '.join(named[:3])})"
            ) from e
    sent: list[str] = []
    if todo:
        bodies = read_bodies(ctx.warehouse, (r["cl_date"] for r in todo), (r["cl_batch_id"] for r in todo))
        picked = ctx.engine.spark.createDataFrame(
            [(r["msg_id"], r["cl_batch_id"], r["cl_batch_pos"]) for r in todo],
            "msg_id string, cl_batch_id bigint, cl_batch_pos bigint",
        )
        full = {
            x["msg_id"]: x
            for x in join_bodies(picked, bodies, ["body", "properties", "flag", "born_ts"]).collect()
        }
        gone = [r["msg_id"] for r in todo if r["msg_id"] not in full]
        if gone:
            raise TableDamaged(
                f"the stored rows of {len(gone)} dead letters to resend are not in commit_log "
                f"({', '.join(gone[:3])}): removed since they were listed, or a damaged table "
                "(deltamq doctor); nothing was resent"
            )
        producer = Producer(ctx, RESEND_PRODUCER_GROUP)
        chunk = 1000 if rate_per_s is None else max(1, min(1000, int(rate_per_s)))
        for i in range(0, len(todo), chunk):
            started = time.monotonic()
            part = todo[i : i + chunk]
            messages = []
            for r in part:
                x = full[r["msg_id"]]
                props = {k: v for k, v in dict(x["properties"] or {}).items() if k not in _SYSTEM_PROPS}
                props[Prop.RESENT_FROM] = r["msg_id"]
                messages.append(
                    Message(
                        r["original_topic"],
                        bytes(x["body"]),
                        tags=r["tags"],
                        keys=r["keys"],
                        flag=x["flag"] or 0,
                        properties=props,
                    )
                )
            sent += producer.send_batch(messages)
            if rate_per_s is not None and i + chunk < len(todo):
                time.sleep(max(0.0, len(part) / rate_per_s - (time.monotonic() - started)))
    return ResendResult(
        selected=len(rows), resent=len(sent), already_resent=len(rows) - len(todo), msg_ids=tuple(sent)
    )


# --- traces -----------------------------------------------------------------------------------
def find_by_key(ctx: Context, key: str, *, since: int | None = None, until: int | None = None) -> list[str]:
    """Original ids of messages whose ``keys`` contain ``key`` (space-separated, as
    RocketMQ's KEYS), oldest first."""
    rows = (
        ctx.warehouse.read("consume_queue")
        .where(_time_range(since, until) & F.array_contains(F.split(F.col("keys"), " "), F.lit(key)))
        .select(
            F.coalesce(F.col("properties").getItem(Prop.UNIQ_KEY), F.col("msg_id")).alias("id"),
            "store_ts",
        )
        .groupBy("id")
        .agg(F.min("store_ts").alias("t"))
        .orderBy("t", "id")
        .collect()
    )
    return [r["id"] for r in rows]


def _kind(row: dict[str, Any], origin: str) -> str:
    topic, props = row["topic"], row["properties"] or {}
    if topic.startswith(DLQ_PREFIX):
        return f"dead-lettered by {topic[len(DLQ_PREFIX) :]} ({props.get(Prop.DLQ_REASON)})"
    if topic.startswith(RETRY_PREFIX):
        return f"retry {row['reconsume_times']} for {topic[len(RETRY_PREFIX) :]}"
    if topic == SCHEDULE_TOPIC:
        what = "sent" if row["msg_id"] == origin else f"retry {row['reconsume_times']} waiting"
        return f"{what}, delayed (level {props.get(Prop.DELAY)})"
    if topic == TIMER_TOPIC:
        what = "sent" if row["msg_id"] == origin else f"retry {row['reconsume_times']} waiting"
        return f"{what}, timer"
    if topic == TRANS_HALF_TOPIC:
        return "half message (transaction pending)"
    if topic == TRANS_OP_HALF_TOPIC:
        return f"transaction ended ({props.get(Prop.TRAN_STATE)})"
    if props.get(Prop.RESENT_FROM):
        return f"resent from the DLQ ({props[Prop.RESENT_FROM]})"
    if row["msg_id"] == origin:
        return "sent"
    if props.get(Prop.TRAN_ID):
        return "committed"
    return "promoted (due)"


def _lineage_root(ctx: Context, msg_id: str, floor: int) -> str:
    """The id of the message ``msg_id`` is a copy of (a promoted, retried or dead-lettered
    copy names its original in ``UNIQ_KEY``), or ``msg_id`` itself."""
    props = F.col("properties")
    root = F.coalesce(props.getItem(Prop.UNIQ_KEY), props.getItem(Prop.ORIGIN_MESSAGE_ID))
    for table, batch in (("consume_queue", "cl_batch_id"), ("commit_log", "batch_id")):
        found = (
            ctx.warehouse.read(table)
            .where((F.col(batch) >= F.lit(floor)) & (F.col("msg_id") == F.lit(msg_id)))
            .select(root.alias("root"))
            .limit(1)
            .collect()
        )
        if found:
            return found[0]["root"] or msg_id
    return msg_id


def _sent_back(ctx: Context, lineages: set[str], floor: int) -> dict[tuple[str, str, int], dict[str, Any]]:
    """The copies groups sent back of the messages ``lineages`` (their ``UNIQ_KEY``) —
    stored, indexed or not yet — by (message, group, retry number): where each went (retry
    or DLQ), when it is due, and why."""
    props = F.col("properties")
    rows = (
        ctx.warehouse.read("commit_log")
        .where(
            (F.col("batch_id") >= F.lit(floor))
            & (F.col("topic").startswith(RETRY_PREFIX) | F.col("topic").startswith(DLQ_PREFIX))
            & props.getItem(Prop.UNIQ_KEY).isin(*sorted(lineages))
        )
        .select("topic", "reconsume_times", "store_ts", "properties")
        .collect()
    )
    delays = dict(ctx.warehouse.levels())
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        p = r["properties"] or {}
        dead = r["topic"].startswith(DLQ_PREFIX)
        group = r["topic"][len(DLQ_PREFIX if dead else RETRY_PREFIX) :]
        if dead:
            due = None
        elif p.get(Prop.TIMER_DELIVER_MS):
            due = int(p[Prop.TIMER_DELIVER_MS])
        else:
            due = r["store_ts"] + delays.get(int(p.get(Prop.DELAY) or 0), 0)
        key = (p.get(Prop.UNIQ_KEY) or "", group, r["reconsume_times"] or 0)
        out[key] = {"dead": dead, "due": due, "reason": p.get(Prop.DLQ_REASON)}
    return out


def trace(ctx: Context, msg_id: str) -> list[dict[str, Any]]:
    """Every index row of message ``msg_id`` (or of the message it is a copy of) and its
    copies (they share its id as ``UNIQ_KEY``): sent, delayed, each retry, dead-lettered,
    resent — and for each row, per group subscribed to its topic: ``consumed``, ``sent
    back (retry n, due …)``, ``dead-lettered (reason)``, ``filtered`` (its subscription
    does not match) or ``pending`` (the group's offset has not passed it). A message stored
    but not yet dispatched is one row, ``stored, not yet dispatched``."""
    floor = _id_floor(msg_id)
    root = _lineage_root(ctx, msg_id, floor)
    floor = min(floor, _id_floor(root))
    index = _lineage_index(ctx, root, floor)
    subs = ctx.catalog.subscriptions()
    rows = _indexed_rows(index, subs)
    if not rows:
        return _undispatched(ctx, root, floor)
    offsets = group_positions(ctx.warehouse, {(r["topic"], r["queue_id"]) for r in rows})
    copies = _sent_back(ctx, {_lineage(r) for r in rows}, floor)
    groups = ctx.catalog.groups()
    return [_trace_event(r, root, _states_per_group(r, subs, groups, offsets, copies)) for r in rows]


def _lineage_index(ctx: Context, root: str, floor: int) -> DataFrame:
    """The ``consume_queue`` rows of message ``root`` and its copies (``UNIQ_KEY`` or
    ``TRAN_ID`` = ``root``), and of the resends of its dead letters (new messages that name
    the dead letter in ``RESENT_FROM``)."""
    props = F.col("properties")
    of_id = (
        (F.col("msg_id") == F.lit(root))
        | (props.getItem(Prop.UNIQ_KEY) == F.lit(root))
        | (props.getItem(Prop.TRAN_ID) == F.lit(root))
    )
    # its dead letters' resends are new messages; they name the dead letter in RESENT_FROM
    dead = F.col("topic").startswith(DLQ_PREFIX) & of_id
    cq = ctx.warehouse.read("consume_queue").where(F.col("cl_batch_id") >= F.lit(floor))
    letters = [r["msg_id"] for r in cq.where(dead).select("msg_id").collect()]
    if letters:
        of_id = of_id | props.getItem(Prop.RESENT_FROM).isin(*letters)
    return cq.where(of_id)


def _indexed_rows(index: DataFrame, subs: list[Subscription]) -> list[dict[str, Any]]:
    """The rows of ``index`` in commit order, each with ``_sub<i>``: whether subscription
    ``subs[i]`` matches it (null when the row is not on that subscription's topic)."""
    matched = [
        F.when(F.col("topic") == s.topic, subscription_filter(s)).alias(f"_sub{i}")
        for i, s in enumerate(subs)
    ]
    columns = [
        "topic",
        "queue_id",
        "queue_offset",
        "msg_id",
        "store_ts",
        "due_ts",
        "reconsume_times",
        "properties",
    ]
    rows = [r.asDict() for r in index.select(*columns, "cl_version", "cl_batch_pos", *matched).collect()]
    rows.sort(key=lambda r: (r["cl_version"], r["cl_batch_pos"], r["topic"]))  # commit order
    return rows


def _lineage(r: dict[str, Any]) -> str:
    """The id of the message the index row ``r`` is a copy of (its ``UNIQ_KEY``), or its own."""
    return (r["properties"] or {}).get(Prop.UNIQ_KEY) or r["msg_id"]


def _states_per_group(
    r: dict[str, Any],
    subs: list[Subscription],
    groups: dict[str, GroupConfig],
    offsets: dict[QueueKey, int],
    copies: dict[tuple[str, str, int], dict[str, Any]],
) -> list[str]:
    """``"<group>[/<client>]: <state>"`` for every group (and client) subscribed to the
    topic of index row ``r``, sorted (see :func:`_group_state`)."""
    states = []
    for i, sub in enumerate(subs):
        cfg = groups.get(sub.consumer_group)
        if sub.topic != r["topic"] or cfg is None:
            continue
        for client in cfg.clients:
            name = sub.consumer_group + (f"/{client}" if client else "")
            state = _group_state(
                r,
                bool(r[f"_sub{i}"]),
                offsets.get(QueueKey(cfg.name, client, r["topic"], r["queue_id"])),
                copies.get((_lineage(r), cfg.name, (r["reconsume_times"] or 0) + 1)),
            )
            states.append(f"{name}: {state}")
    return sorted(states)


def _trace_event(r: dict[str, Any], root: str, groups: list[str]) -> dict[str, Any]:
    """The trace entry of index row ``r`` (of the lineage of ``root``), with the groups' states."""
    stored = r["properties"] or {}
    return {
        "store_ts": r["store_ts"],
        "event": _kind(r, root),
        "topic": r["topic"],
        "queue_id": r["queue_id"],
        "queue_offset": r["queue_offset"],
        "msg_id": r["msg_id"],
        "due_ts": r["due_ts"],
        "reconsume_times": r["reconsume_times"] or 0,
        "error": stored.get(Prop.LAST_ERROR),
        "groups": groups,
    }


def _group_state(
    row: dict[str, Any], matched: bool, position: int | None, copy: dict[str, Any] | None
) -> str:
    """One group's state for one index row (see :func:`trace`): ``position`` is its offset
    on the row's queue, ``copy`` the copy it sent back of this delivery, if any."""
    if position is None or position <= row["queue_offset"]:
        return "pending"
    if not matched:
        return "filtered"
    if copy is None:
        return "consumed"
    if copy["dead"]:
        return f"dead-lettered ({copy['reason']})"
    return f"sent back (retry {(row['reconsume_times'] or 0) + 1}, due {ms_to_iso(copy['due'])})"


def _undispatched(ctx: Context, root: str, floor: int) -> list[dict[str, Any]]:
    """The message as stored, when dispatch has not indexed it yet (else nothing)."""
    found = (
        ctx.warehouse.read("commit_log")
        .where((F.col("batch_id") >= F.lit(floor)) & (F.col("msg_id") == F.lit(root)))
        .select("topic", "queue_id", "msg_id", "store_ts", "reconsume_times")
        .collect()
    )
    return [
        {
            "store_ts": r["store_ts"],
            "event": "stored, not yet dispatched",
            "topic": r["topic"],
            "queue_id": r["queue_id"],
            "queue_offset": None,
            "msg_id": r["msg_id"],
            "due_ts": None,
            "reconsume_times": r["reconsume_times"] or 0,
            "error": None,
            "groups": [],
        }
        for r in found
    ]


# --- rebuilding the index ---------------------------------------------------------------------
def _check_replayable(wh: Warehouse) -> None:
    """A rebuild replays every commit of commit_log from version 0: refuse (before touching
    anything) when retention, compaction or log cleanup changed that history."""
    from deltamq.tables import deltalog

    path = wh.uri("commit_log")
    first = deltalog.first_version(wh.storage, path)
    if first > 0:
        raise OperationError(
            f"rebuild-index needs commit_log's whole Delta log, but entries 0..{first - 1} were removed "
            "by log cleanup (log_retention_ms); the index cannot be rebuilt from the log"
        )
    for c in deltalog.commits_after(wh.storage, path, -1, 10**9):
        if c.rewrite:
            raise OperationError(
                f"rebuild-index replays commit_log from version 0, but version {c.version} "
                f"({c.operation or 'a rewrite'}) removed files (retention or compaction): replaying would "
                "index expired messages or read vacuumed files; the index was left as it is"
            )


def rebuild_index(ctx: Context, leases: Leases, now: int) -> dict[str, int]:
    """Rebuild ``consume_queue`` from ``commit_log``: holding every job lease, delete the
    index and dispatch's progress, then dispatch every commit again (offsets are a function
    of commit order, so the rebuilt index equals the old one). Consumers pause meanwhile;
    a run that is killed is simply run again. ``leases``: the caller's (its ticks may
    already hold them); the caller releases them."""
    from deltamq.jobs import dispatch

    wh = ctx.warehouse
    _check_replayable(wh)
    leases.acquire(JOB_NAMES, LeaseTerms.of(ctx.config), last_now=now)
    before = consume_queue.count(wh)
    ctx.commit(partial(consume_queue.wipe, wh), what="consume_queue")
    ctx.commit(lambda: forget(wh, DISPATCH_GROUP), what="offsets")
    passes = rows = 0
    while True:
        leases.check(["dispatch"])
        r = dispatch.run(ctx, now)
        passes += 1
        rows += r.rows_out
        if not r.commits_read:
            break
    after = consume_queue.count(wh)
    return {"rows_before": before, "rows_after": after, "passes": passes, "indexed": rows}
