"""Sending without Spark: the rules every producer follows.

Message validation, queue choice (round-robin, key, selector), ids and the commit_log
row layout, shared by the Spark producer (:mod:`deltamq.producer`) and the Spark-free one
(:mod:`deltamq.lite`); also the topic rules (exists, writable, not a system topic) over a
short-lived cache of ``topic_config``. Imports nothing from PySpark.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from deltamq import ids, sending_arrow
from deltamq.clock import Clock
from deltamq.config import BrokerConfig
from deltamq.constants import Perm, Prop, SysFlag, is_system_topic
from deltamq.errors import InvalidMessage, InvalidTimer, TopicNotWritable, UnknownTopic
from deltamq.message import (
    Message,
    body_bytes,
    timer_due_ms,
    validate_born_ts,
    validate_delay_level,
    validate_flag,
    validate_group_name,
    validate_optional_text,
    validate_properties,
    validate_topic_name,
)
from deltamq.sending_arrow import warn_clamped

log = logging.getLogger(__name__)

Selector = Callable[[int, Message, Any], int]
"""RocketMQ's MessageQueueSelector: (queue count, message, arg) -> queue id."""

TOPIC_CACHE_TTL_S = 5.0

COMMIT_LOG_ARROW = pa.schema(
    [
        ("msg_id", pa.string()),
        ("topic", pa.string()),
        ("queue_id", pa.int32()),
        ("tags", pa.string()),
        ("keys", pa.string()),
        ("body", pa.binary()),
        ("flag", pa.int32()),
        ("properties", pa.map_(pa.string(), pa.string())),
        ("born_ts", pa.int64()),
        ("store_ts", pa.int64()),
        ("reconsume_times", pa.int32()),
        ("sys_flag", pa.int32()),
        ("producer_group", pa.string()),
        ("batch_id", pa.int64()),
        ("batch_pos", pa.int64()),
        ("store_date", pa.date32()),
    ]
)


def queue_for_key(key: str | bytes, queues: int) -> int:
    """Queue of a selector key: crc32 of its UTF-8 bytes mod the queue count.

    The same function as ``pmod(crc32(key), queues)`` in Spark, so Python sends and
    DataFrame sends put equal keys in one queue.
    """
    import zlib

    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    return zlib.crc32(data) % queues


def rows_to_arrow(rows: list[dict[str, Any]]) -> pa.Table:
    """commit_log rows (dicts) as an Arrow table with the commit_log schema (rows written
    by hand: the producers build theirs a column at a time, ``BaseProducer._store``)."""
    cols = {name: [r[name] for r in rows] for name in COMMIT_LOG_ARROW.names}
    cols["properties"] = [list(r["properties"].items()) for r in rows]
    return pa.table(cols, schema=COMMIT_LOG_ARROW)


@dataclass(frozen=True)
class Stored:
    """What one send stored: its commit_log rows as appended (``table``), and per message
    its id, topic and queue, and the delay level and timer stored with it."""

    table: pa.Table
    msg_ids: list[str]
    topics: list[str]
    queue_ids: list[int]
    delay_levels: list[int]  # as stored: clamped to the highest level, 0 for none
    timers: list[int | None]  # a timer's due time (epoch ms)


class Topics:
    """Topic look-ups over a cache of ``topic_config`` (reloaded after
    :data:`TOPIC_CACHE_TTL_S` or on a miss); subclasses load the rows."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._topics: dict[str, tuple[int, str, bool]] = {}
        self._topics_loaded_at = 0.0

    def _topic_rows(self) -> list[tuple[str, int, str, bool]]:
        """(topic, queues, perm, ordered) of every topic."""
        raise NotImplementedError

    def _load_topics(self) -> None:
        rows = self._topic_rows()
        with self._lock:
            self._topics = {t: (q, p, bool(o)) for t, q, p, o in rows}
            self._topics_loaded_at = time.monotonic()

    def _topic(self, topic: str) -> tuple[int, str, bool] | None:
        stale = time.monotonic() - self._topics_loaded_at > TOPIC_CACHE_TTL_S
        if stale or topic not in self._topics:
            self._load_topics()
        return self._topics.get(topic)

    def topics(self) -> dict[str, dict[str, Any]]:
        """Every topic with its queues, perm and order flag."""
        self._load_topics()
        return {t: {"queues": q, "perm": p, "ordered": o} for t, (q, p, o) in sorted(self._topics.items())}

    def _existing(self) -> str:
        """The user topics there are, for an error about one that is not."""
        with self._lock:
            names = sorted(t for t in self._topics if not is_system_topic(t))
        if not names:
            return "there are no topics yet"
        return "the topics are " + ", ".join(names[:12]) + (" …" if len(names) > 12 else "")

    def topic_queues(self, topic: str) -> int:
        info = self._topic(topic)
        if info is None:
            raise UnknownTopic(
                f"topic {topic!r} does not exist ({self._existing()}); create it with create_topic({topic!r})"
            )
        return info[0]

    def validate_writable_topic(self, topic: Any) -> str:
        """Producer rules: name, not a system topic, exists, writable."""
        validate_topic_name(topic)
        info = self._topic(topic)
        if info is None:
            raise UnknownTopic(
                f"topic {topic!r} does not exist ({self._existing()}); create it first "
                f"(deltamq topic create {topic})"
            )
        if not Perm(info[1]).writable:
            raise TopicNotWritable(f"topic {topic!r} has perm {info[1]}; producers need RW or W")
        return topic


@dataclass(frozen=True)
class SendResult:
    """What RocketMQ's SendResult says that is known when a message is stored: its status,
    id, topic and queue. Its queue offset is not: dispatch assigns it later, in commit
    order. ``delay_level`` is the level stored (a requested level above the warehouse's
    highest is clamped to it, as RocketMQ's store does: ``clamped``); ``deliver_at`` the due
    time of a timer message (epoch ms)."""

    status: str
    msg_id: str
    topic: str
    queue_id: int
    requested_delay_level: int = 0
    delay_level: int = 0
    deliver_at: int | None = None

    @property
    def clamped(self) -> bool:
        return self.delay_level != self.requested_delay_level


SEND_OK = "SEND_OK"


class Target(Protocol):
    """What a producer sends through."""

    @property
    def config(self) -> BrokerConfig: ...
    @property
    def clock(self) -> Clock: ...

    def validate_writable_topic(self, topic: Any) -> str: ...
    def topic_queues(self, topic: str) -> int: ...
    def max_delay_level(self) -> int: ...
    def append_commit_log(self, rows: pa.Table, *, what: str) -> None: ...


class BaseProducer:
    """Validates messages, derives their queues and ids, and appends their commit_log
    rows in one commit through ``target`` (a Broker, or :class:`deltamq.lite.Warehouse`)."""

    def __init__(self, ctx: Target, group: str) -> None:
        self.ctx = ctx
        self.group = validate_group_name(group, "producer group")
        self._rr: dict[str, int] = {}

    # --- helpers -------------------------------------------------------------------------
    def _next_queue(self, topic: str, queues: int) -> int:
        return self._run_start(topic, queues, 1) % queues

    def _run_start(self, topic: str, queues: int, rows: int) -> int:
        """The queue a run of ``rows`` messages starts at: the topic's round-robin, moved
        on by ``rows``."""
        start = self._rr.get(topic)
        if start is None:
            start = random.randrange(queues)
        self._rr[topic] = (start + rows) % queues
        return start

    def _topic_queues(self, topic: str) -> int:
        """The queues of ``topic``, checked to exist and be writable."""
        self.ctx.validate_writable_topic(topic)
        return self.ctx.topic_queues(topic)

    def _prepare(
        self, m: Message, now: int, topics: dict[str, int] | None = None
    ) -> tuple[Message, bytes, dict[str, str], int]:
        """``m`` checked; ``topics``: the queues of topics already checked in this batch
        (each topic is checked once per batch)."""
        if not isinstance(m, Message):
            raise InvalidMessage(f"expected a deltamq.Message, got {type(m).__name__}: {m!r}")
        if topics is None:
            self.ctx.validate_writable_topic(m.topic)
        elif m.topic not in topics:
            topics[m.topic] = self._topic_queues(m.topic)
        if (
            type(m.body) is bytes
            and m.properties is None
            and type(m.delay_level) is int
            and m.delay_level == 0
            and type(m.flag) is int
            and m.flag == 0
            and m.deliver_at is None
            and m.delay is None
            and m.born_ts is None
            and (m.tags is None or type(m.tags) is str)
            and (m.keys is None or type(m.keys) is str)
            and len(m.body) <= self.ctx.config.max_body_bytes
        ):
            return m, m.body, {}, 0  # the usual message: what the checks below would find
        body = body_bytes(m.body, self.ctx.config.max_body_bytes)
        props = validate_properties(m.properties)
        level = validate_delay_level(m.delay_level)
        validate_optional_text(m.tags, "tags")
        validate_optional_text(m.keys, "keys")
        validate_flag(m.flag)
        validate_born_ts(m.born_ts, now)
        if level > 0 and (m.deliver_at is not None or (m.delay is not None and m.delay != timedelta(0))):
            # deltamq's own timer arguments, as the CLI's options, exclude a level (checked
            # before the time itself: the conflict is the error); a TIMER_DELIVER_MS property
            # beside DELAY is routed as a timer (§2's order)
            given = "deliver_at" if m.deliver_at is not None else "delay"
            raise InvalidTimer(f"{m!r} has both delay_level={level} and {given}; give one of them")
        due = timer_due_ms(m, props, now, self.ctx.config.timer_horizon_ms)
        if due is not None:
            props[Prop.TIMER_DELIVER_MS] = str(due)
        return m, body, props, level

    # --- sending -------------------------------------------------------------------------
    def send(
        self,
        message: Message,
        *,
        queue_key: str | None = None,
        selector: Selector | None = None,
        arg: Any = None,
    ) -> str:
        """Store one message; returns its msg id.

        Queue choice: round-robin, or ``queue_key`` (equal keys → one queue), or a
        RocketMQ-style ``selector(queue_count, message, arg) -> queue_id``.
        """
        keys = None if queue_key is None else [queue_key]
        return self.send_batch([message], queue_keys=keys, selector=selector, arg=arg)[0]

    def send_batch(
        self,
        messages: Sequence[Message],
        *,
        queue_keys: Sequence[str | None] | None = None,
        selector: Selector | None = None,
        arg: Any = None,
    ) -> list[str]:
        """Store several messages in one commit; returns their msg ids in order.

        Nothing is stored unless every message is valid.
        """
        return self._store(list(messages), queue_keys, selector, arg, transactional=False).msg_ids

    def send_results(
        self,
        messages: Sequence[Message],
        *,
        queue_keys: Sequence[str | None] | None = None,
        selector: Selector | None = None,
        arg: Any = None,
    ) -> list[SendResult]:
        """:meth:`send_batch`, returning each message's :class:`SendResult` (queue, the
        delay level stored, the timer's due time) instead of its id alone."""
        messages = list(messages)
        stored = self._store(messages, queue_keys, selector, arg, transactional=False)
        return [
            SendResult(SEND_OK, mid, topic, qid, m.delay_level, level, timer)
            for m, mid, topic, qid, level, timer in zip(
                messages,
                stored.msg_ids,
                stored.topics,
                stored.queue_ids,
                stored.delay_levels,
                stored.timers,
                strict=True,
            )
        ]

    def send_arrow(self, table: pa.Table, *, queue_key: str | None = None) -> pa.Table:
        """Store every row of an Arrow table in one commit, checked and built a column at a
        time (a million messages cost about what writing their Parquet file does); returns
        ``msg_id, topic, queue_id`` per row, in the table's order.

        Columns: ``topic``, ``body`` (binary or string) and optionally ``tags``, ``keys``,
        ``flag``, ``queue_id``, ``properties`` (map<string, string>), ``delay_level``,
        ``deliver_at_ms`` (a timer, epoch ms); ``queue_key`` names a column whose equal
        values land in one queue (the queue ``send(queue_key=...)`` picks). Otherwise each
        topic's rows go to its queues in equal runs of consecutive rows. Nothing is stored
        unless every row is valid."""
        config = self.ctx.config
        now = self.ctx.clock.now_ms()
        batch = sending_arrow.check(table, queue_key, config.max_body_bytes, now, config.timer_horizon_ms)
        with self._named_faults():
            topics = {t: self._topic_queues(t) for t in pc.unique(batch.topic).to_pylist()}
            qids = sending_arrow.queues_of(batch, topics, self._run_start, queue_for_key)
            max_level = self.ctx.max_delay_level()
            rows, mids = sending_arrow.rows(batch, qids, COMMIT_LOG_ARROW, now, self.group, max_level)
            if rows.num_rows:
                self.ctx.append_commit_log(rows, what="send")
        return pa.table({"msg_id": mids, "topic": batch.topic, "queue_id": qids})

    def _store(
        self,
        messages: list[Message],
        queue_keys: Sequence[str | None] | None,
        selector: Selector | None,
        arg: Any,
        *,
        transactional: bool,
    ) -> Stored:
        """Validate, build and append the commit_log rows of ``messages`` (one commit).

        ``transactional``: half messages (docs/behaviour.md §5) — ``TRAN_MSG``, ``PGROUP``, ``TRAN_ID``
        (= the msg id) and the prepared ``sys_flag``; delays and timers are refused.
        """
        if not messages:
            return Stored(COMMIT_LOG_ARROW.empty_table(), [], [], [], [], [])
        if queue_keys is not None and len(queue_keys) != len(messages):
            raise InvalidMessage(
                f"queue_keys has {len(queue_keys)} entries for {len(messages)} messages; give one per message"
            )
        with self._named_faults():
            now = self.ctx.clock.now_ms()
            topics: dict[str, int] = {}
            prepared = [self._prepare(m, now, topics) for m in messages]
            if transactional:
                _check_not_delayed(prepared)
            stored = self._commit_log_rows(prepared, topics, queue_keys, selector, arg, now, transactional)
            self.ctx.append_commit_log(stored.table, what="send_half" if transactional else "send")
        return stored

    def _named_faults(self) -> AbstractContextManager[None]:
        """Where a fault of the store while sending is named (the Spark producer: by the
        warehouse; the Spark-free one names its own)."""
        return nullcontext()

    def _commit_log_rows(
        self,
        prepared: list[tuple[Message, bytes, dict[str, str], int]],
        topics: dict[str, int],
        queue_keys: Sequence[str | None] | None,
        selector: Selector | None,
        arg: Any,
        now: int,
        transactional: bool,
    ) -> Stored:
        """The commit_log rows of the ``prepared`` messages (stored at ``now``), under one
        fresh producer batch: message ``pos`` gets id ``msg_id(batch, pos)``. Built a
        column at a time: a message without properties, delay or transaction (the usual
        one) costs no dictionary of its own."""
        max_level = self.ctx.max_delay_level()
        flag = SysFlag.TRANSACTION_PREPARED_TYPE if transactional else SysFlag.TRANSACTION_NOT_TYPE
        batch = ids.new_batch_id(now)
        n = len(prepared)
        mids = ids.msg_ids(batch, n)
        messages = [p[0] for p in prepared]
        if selector is None and queue_keys is None:
            qids = self._round_robin([m.topic for m in messages], topics)
        else:
            qids = [
                self._queue_id(
                    m, topics[m.topic], queue_keys[pos] if queue_keys is not None else None, selector, arg
                )
                for pos, m in enumerate(messages)
            ]
        levels = [min(level, max_level) if level > 0 else 0 for _, _, _, level in prepared]
        warn_clamped((level for _, _, _, level in prepared if level > max_level), max_level, log)
        if not transactional and not any(props or level for _, _, props, level in prepared):
            offsets = pa.array(range(n + 1), pa.int32())
            names = pa.repeat(pa.scalar(Prop.UNIQ_KEY), n)
            properties = pa.MapArray.from_arrays(offsets, names, pa.array(mids, pa.string()))
            timers: list[int | None] = [None] * n
        else:
            stored = [
                self._row_properties(props, mid, level, max_level, transactional)
                for (_, _, props, level), mid in zip(prepared, mids, strict=True)
            ]
            properties = pa.array(
                [list(p.items()) for p in stored], COMMIT_LOG_ARROW.field("properties").type
            )
            timers = [int(p[Prop.TIMER_DELIVER_MS]) if Prop.TIMER_DELIVER_MS in p else None for p in stored]
        columns = {
            "msg_id": mids,
            "topic": [m.topic for m in messages],
            "queue_id": qids,
            "tags": [m.tags for m in messages],
            "keys": [m.keys for m in messages],
            "body": [p[1] for p in prepared],
            "flag": [m.flag for m in messages],
            "properties": properties,
            "born_ts": [now if m.born_ts is None else m.born_ts for m in messages],
            "store_ts": pa.repeat(pa.scalar(now, pa.int64()), n),
            "reconsume_times": pa.repeat(pa.scalar(0, pa.int32()), n),
            "sys_flag": pa.repeat(pa.scalar(flag, pa.int32()), n),
            "producer_group": pa.repeat(pa.scalar(self.group), n),
            "batch_id": pa.repeat(pa.scalar(batch, pa.int64()), n),
            "batch_pos": pa.array(range(n), pa.int64()),
            "store_date": pa.repeat(pa.scalar(ids.store_date(now), pa.date32()), n),
        }
        table = pa.table(columns, schema=COMMIT_LOG_ARROW)
        return Stored(table, mids, columns["topic"], qids, levels, timers)

    def _round_robin(self, names: list[str], topics: dict[str, int]) -> list[int]:
        """Each message's queue by its topic's round-robin (what :meth:`_next_queue` gives
        one message after another); a batch of one topic without a call per message."""
        if len(topics) != 1:
            return [self._next_queue(t, topics[t]) for t in names]
        ((topic, queues),) = topics.items()
        start = self._run_start(topic, queues, len(names))
        return [(start + i) % queues for i in range(len(names))]

    def _queue_id(self, m: Message, queues: int, key: str | None, selector: Selector | None, arg: Any) -> int:
        """The queue of ``m`` among its topic's ``queues``: the ``selector``'s (checked), or
        that of its queue ``key``, or the topic's next round-robin."""
        if selector is not None:
            qid = selector(queues, m, arg)
            if isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < queues:
                raise InvalidMessage(
                    f"selector returned queue {qid!r} for topic {m.topic!r}; allowed 0..{queues - 1}"
                )
            return qid
        if key is not None:
            return queue_for_key(key, queues)
        return self._next_queue(m.topic, queues)

    def _row_properties(
        self, props: dict[str, str], mid: str, level: int, max_level: int, transactional: bool
    ) -> dict[str, str]:
        """The properties stored with message ``mid``: a copy of ``props`` with ``UNIQ_KEY``,
        a half message's transaction properties, and the delay level clamped to
        ``max_level`` (or none)."""
        props = dict(props)
        props[Prop.UNIQ_KEY] = mid
        if transactional:
            props.pop(Prop.TRANSACTION_CHECK_TIMES, None)  # the first check sets it to 1
            props.update({Prop.TRAN_MSG: "true", Prop.PGROUP: self.group, Prop.TRAN_ID: mid})
        if level > 0:
            props[Prop.DELAY] = str(min(level, max_level))  # clamp, as RocketMQ's store does
        else:
            props.pop(Prop.DELAY, None)
        return props


def _check_not_delayed(prepared: list[tuple[Message, bytes, dict[str, str], int]]) -> None:
    """Refuse a transactional batch with a delayed or timed message (a delay level or a timer)."""
    for m, _, props, level in prepared:
        if level > 0 or Prop.TIMER_DELIVER_MS in props:
            raise InvalidMessage(
                f"{m!r} is delayed (delay_level={m.delay_level}, timer="
                f"{props.get(Prop.TIMER_DELIVER_MS)}); a transactional message cannot be "
                "delayed: send it without delay_level, deliver_at or delay"
            )
