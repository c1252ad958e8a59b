"""Messages and the validation rules of docs/behaviour.md §1.

Every rule has its own error class (``deltamq.errors``) and a message that names the
bad value and the rule. Validation runs before anything is written.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from deltamq.constants import (
    GROUP_MAX_LENGTH,
    GROUP_PATTERN,
    MAX_BODY_BYTES,
    RETRY_PREFIX,
    TOPIC_MAX_LENGTH,
    TOPIC_PATTERN,
    Prop,
    is_system_topic,
)
from deltamq.errors import (
    BodyTooLarge,
    InvalidDelayLevel,
    InvalidGroup,
    InvalidMessage,
    InvalidProperties,
    InvalidTimer,
    InvalidTopic,
    SystemTopicError,
)


@dataclass(frozen=True)
class Message:
    """A message to send (docs/behaviour.md §1).

    Example:
        >>> Message("orders", b'{"id": 1}', tags="created", keys="order-1")
        Message(topic='orders', ...)
    """

    topic: str
    body: bytes | str
    tags: str | None = None
    keys: str | None = None
    delay_level: int = 0
    properties: Mapping[str, str] | None = None
    flag: int = 0
    born_ts: int | None = field(default=None, compare=False)
    deliver_at: int | datetime | None = None
    delay: timedelta | None = None

    def __repr__(self) -> str:
        size = len(self.body) if isinstance(self.body, bytes | bytearray | str) else "?"
        return (
            f"Message(topic={self.topic!r}, body=<{size} bytes>, tags={self.tags!r}, "
            f"keys={self.keys!r}, delay_level={self.delay_level!r})"
        )


@dataclass(frozen=True)
class StoredMessage:
    """A message as stored and handed to consumers."""

    msg_id: str
    topic: str
    queue_id: int
    queue_offset: int | None
    body: bytes
    tags: str | None
    keys: str | None
    properties: dict[str, str]
    born_ts: int
    store_ts: int
    reconsume_times: int = 0
    flag: int = 0
    sys_flag: int = 0


def stored_fields(r: Mapping[str, Any]) -> dict[str, Any]:
    """A consume_queue + commit_log row as the consumer sees it (StoredMessage fields): a
    retried message shows its original topic and id (RocketMQ clients show UNIQ_KEY), and
    an orderly queue head's ``suspends`` count as reconsumes (RocketMQ keeps them in client
    memory; here they are stored with the queue offset)."""
    props = dict(r["properties"] or [])
    topic = r["topic"]
    if topic.startswith(RETRY_PREFIX) and props.get(Prop.RETRY_TOPIC):
        topic = props[Prop.RETRY_TOPIC]
    return {
        "msg_id": props.get(Prop.UNIQ_KEY) or props.get(Prop.ORIGIN_MESSAGE_ID) or r["msg_id"],
        "topic": topic,
        "queue_id": r["queue_id"],
        "queue_offset": r["queue_offset"],
        "body": r["body"],
        "tags": r["tags"],
        "keys": r["keys"],
        "properties": props,
        "born_ts": r["born_ts"],
        "store_ts": r["store_ts"],
        "reconsume_times": (r["reconsume_times"] or 0) + (r.get("suspends") or 0),
        "flag": r["flag"] or 0,
        "sys_flag": r["sys_flag"] or 0,
    }


M = TypeVar("M", bound=StoredMessage)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block that builds many acyclic objects:
    every few hundred new objects would start it again, and each start walks the objects
    alive (building 1 000 messages: 3.0 µs a message with it, 1.75 µs without)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def messages_of(table: Any, cls: type[M], **more: Sequence[Any]) -> list[M]:
    """The messages (``cls``: StoredMessage or a subclass) of an Arrow table or record
    batch of consume_queue + commit_log columns, each as :func:`stored_fields` makes it;
    ``more``: further fields, one value per row. Built column by column, and each object
    by filling its ``__dict__`` (a frozen dataclass's ``__init__`` sets every field
    through ``object.__setattr__``, several times slower), with the cyclic collector
    paused: the per-message cost of pull clients and listeners."""
    with collector_paused():
        return _messages_of(table, cls, more)


def _messages_of(table: Any, cls: type[M], more: Mapping[str, Sequence[Any]]) -> list[M]:
    n = table.num_rows
    names = set(table.schema.names)

    def col(name: str) -> list[Any]:
        if name not in names:
            return [None] * n
        column = table.column(name)  # all null (keys, often): no conversion
        return [None] * n if column.null_count == n else column.to_pylist()

    topics, qids, offsets, ids_ = col("topic"), col("queue_id"), col("queue_offset"), col("msg_id")
    bodies, tags, keys = col("body"), col("tags"), col("keys")
    props = map_dicts(table.column("properties")) if "properties" in names else [{} for _ in range(n)]
    born, stored, reconsumes, suspends = (
        col("born_ts"),
        col("store_ts"),
        col("reconsume_times"),
        col("suspends"),
    )
    flags, sys_flags = col("flag"), col("sys_flag")
    extra = list(more.items())
    out: list[M] = []
    for i in range(n):
        p = props[i]
        topic = topics[i]
        if topic.startswith(RETRY_PREFIX) and p.get(Prop.RETRY_TOPIC):
            topic = p[Prop.RETRY_TOPIC]
        m = object.__new__(cls)
        m.__dict__.update(
            msg_id=p.get(Prop.UNIQ_KEY) or p.get(Prop.ORIGIN_MESSAGE_ID) or ids_[i],
            topic=topic,
            queue_id=qids[i],
            queue_offset=offsets[i],
            body=bodies[i],
            tags=tags[i],
            keys=keys[i],
            properties=p,
            born_ts=born[i],
            store_ts=stored[i],
            reconsume_times=(reconsumes[i] or 0) + (suspends[i] or 0),
            flag=flags[i] or 0,
            sys_flag=sys_flags[i] or 0,
        )
        for name, values in extra:
            m.__dict__[name] = values[i]
        out.append(m)
    return out


def map_dicts(column: Any) -> list[dict[Any, Any]]:
    """A map column (an Arrow array or chunked array) as one dict per row ({} for a null
    map), from its flattened keys and values sliced by its offsets: half the time of
    converting each map's entries to tuples (``to_pylist``) and then to a dict."""
    chunks = column.chunks if hasattr(column, "chunks") else [column]
    out: list[dict[Any, Any]] = []
    for arr in chunks:
        at = arr.offsets.to_numpy().tolist()  # absolute: into the whole child arrays
        first = at[0] if at else 0
        span = (at[-1] - first) if at else 0
        names = arr.keys.slice(first, span).to_pylist()  # a slice's entries only
        values = arr.items.slice(first, span).to_pylist()
        if span == len(arr) and not arr.null_count and at == list(range(first, first + span + 1)):
            # one entry each (the usual message: its id alone): a dict per pair
            out += [{k: v} for k, v in zip(names, values, strict=True)]
            continue
        at = [a - first for a in at]
        valid = arr.is_valid().to_pylist() if arr.null_count else None
        for i in range(len(arr)):
            lo, hi = at[i], at[i + 1]
            if valid is not None and not valid[i]:
                out.append({})
            elif hi - lo == 1:  # the usual message: its id alone
                out.append({names[lo]: values[lo]})
            else:
                out.append(dict(zip(names[lo:hi], values[lo:hi], strict=True)))
    return out


def validate_topic_name(topic: Any, *, allow_system: bool = False) -> str:
    """Check a topic name against docs/behaviour.md §1; returns it."""
    if not isinstance(topic, str) or not topic:
        raise InvalidTopic(f"topic {topic!r} is not allowed: a topic is a non-empty string")
    if len(topic) > TOPIC_MAX_LENGTH:
        raise InvalidTopic(
            f"topic {topic[:40]!r}... is {len(topic)} characters; at most {TOPIC_MAX_LENGTH} are allowed"
        )
    if not TOPIC_PATTERN.match(topic):
        raise InvalidTopic(
            f"topic {topic!r} is not allowed: use only letters, digits, '%', '|', '_' and '-' "
            f"(pattern {TOPIC_PATTERN.pattern})"
        )
    if not allow_system and is_system_topic(topic):
        raise SystemTopicError(
            f"topic {topic!r} is a system topic (SCHEDULE_TOPIC_XXXX, RMQ_SYS_TRANS_*, "
            "TRANS_CHECK_MAX_TIME_TOPIC, %RETRY%*, %DLQ%*); only the engine writes it"
        )
    return topic


def validate_group_name(group: Any, what: str = "group") -> str:
    """Check a consumer/producer group name; it becomes part of %RETRY%<group>."""
    if not isinstance(group, str) or not group:
        raise InvalidGroup(f"{what} {group!r} is not allowed: a {what} name is a non-empty string")
    if len(group) > GROUP_MAX_LENGTH:
        raise InvalidGroup(
            f"{what} {group[:40]!r}... is {len(group)} characters; at most {GROUP_MAX_LENGTH} are allowed"
        )
    if not GROUP_PATTERN.match(group):
        raise InvalidGroup(
            f"{what} {group!r} is not allowed: use only letters, digits, '_' and '-' "
            f"(pattern {GROUP_PATTERN.pattern})"
        )
    return group


def body_bytes(body: Any, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body as bytes (str is UTF-8 encoded); refuses other types and oversize bodies."""
    if isinstance(body, str):
        data = body.encode("utf-8")
    elif isinstance(body, bytes | bytearray | memoryview):
        data = bytes(body)
    else:
        raise InvalidMessage(f"body must be bytes or str, got {type(body).__name__}")
    if len(data) > max_bytes:
        raise BodyTooLarge(f"body is {len(data)} bytes; at most {max_bytes} bytes are allowed")
    return data


def validate_properties(props: Any) -> dict[str, str]:
    """Properties must be a string→string mapping."""
    if props is None:
        return {}
    if not isinstance(props, Mapping):
        raise InvalidProperties(f"properties must be a mapping of str to str, got {type(props).__name__}")
    out: dict[str, str] = {}
    for k, v in props.items():
        if not isinstance(k, str) or not k:
            raise InvalidProperties(f"property name {k!r} is not allowed: names are non-empty strings")
        if not isinstance(v, str):
            raise InvalidProperties(
                f"property {k!r} has value {v!r} of type {type(v).__name__}; values must be str"
            )
        out[k] = v
    if Prop.DELAY in out:
        # RocketMQ's putUserProperty refuses its system names; this one would be dropped
        raise InvalidProperties(
            f"property {Prop.DELAY!r}={out[Prop.DELAY]!r} is the delay level's, set by the broker: give "
            "delay_level=N (or delay= / deliver_at=) instead"
        )
    return out


def validate_delay_level(level: Any) -> int:
    """Delay levels are integers ≥ 0 (above the maximum they clamp, docs/behaviour.md §2)."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise InvalidDelayLevel(
            f"delay_level {level!r} is not an integer; allowed: 0 (none) or a level of the "
            "warehouse's schedule_levels"
        )
    if level < 0:
        raise InvalidDelayLevel(
            f"delay_level {level} is negative; allowed: 0 (no delay) or a level of the "
            "warehouse's schedule_levels"
        )
    return level


def validate_optional_text(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidMessage(f"{what} must be a string or None, got {type(value).__name__}: {value!r}")
    return value


def validate_flag(flag: Any) -> int:
    if isinstance(flag, bool) or not isinstance(flag, int) or not (-(2**31) <= flag < 2**31):
        raise InvalidMessage(f"flag {flag!r} must be a 32-bit integer")
    return flag


def validate_born_ts(born: Any, now: int) -> None:
    """A message's own ``born_ts`` (None: the send's now) is epoch milliseconds: check-back
    ages a half message by it (docs/behaviour.md §5), so seconds would discard it unchecked
    and microseconds have it checked at once."""
    if born is None:
        return
    if isinstance(born, bool) or not isinstance(born, int) or born < 0:
        raise InvalidMessage(f"born_ts={born!r} must be epoch milliseconds: an integer >= 0")
    if born > now + 86_400_000:
        raise InvalidMessage(
            f"born_ts={born} is more than a day after now ({now}); born_ts is epoch milliseconds, "
            "not microseconds"
        )
    if born * 100 < now:
        raise InvalidMessage(
            f"born_ts={born} is before {now // 100} (now / 100); born_ts is epoch milliseconds, not seconds"
        )


def delay_ms(delay: Any) -> int:
    """A timer's ``delay`` in milliseconds: a ``timedelta`` of zero or more (the CLI's
    ``--delay-ms`` and a send file's ``delay_ms`` are checked here too, for one message)."""
    if isinstance(delay, timedelta):
        ms = int(delay / timedelta(milliseconds=1))
        negative = delay < timedelta(0)  # -1 µs is negative too, though it rounds to 0 ms
    elif isinstance(delay, int) and not isinstance(delay, bool):
        ms, negative = delay, delay < 0
    else:
        raise InvalidTimer(f"delay must be a datetime.timedelta, got {delay!r}")
    if negative:
        raise InvalidTimer(
            f"a delay of {ms} ms is not allowed: a delay is 0 or more milliseconds "
            "(0 sends a plain message; to deliver at a time, give deliver_at)"
        )
    return ms


def timer_due_ms(message: Message, props: Mapping[str, str], now_ms: int, horizon_ms: int) -> int | None:
    """The absolute due time of a timer message (``deliver_at``, ``delay`` or a
    ``TIMER_DELIVER_MS`` property), checked against the horizon; None for no timer."""
    from deltamq.constants import Prop

    if message.deliver_at is None and message.delay is None and Prop.TIMER_DELIVER_MS not in props:
        return None  # the usual message, without a list or an import
    from deltamq.clock import to_ms

    given = [
        name
        for name, value in (
            ("deliver_at", message.deliver_at),
            ("delay", message.delay),
            (Prop.TIMER_DELIVER_MS, props.get(Prop.TIMER_DELIVER_MS)),
        )
        if value is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidTimer(f"a message takes one of deliver_at, delay, TIMER_DELIVER_MS; got {given}")
    if message.delay is not None:
        if not isinstance(message.delay, timedelta):
            raise InvalidTimer(f"delay must be a datetime.timedelta, got {message.delay!r}")
        ms = delay_ms(message.delay)
        if ms == 0:
            return None  # no delay: a plain message
        due = now_ms + ms
    elif message.deliver_at is not None:
        if isinstance(message.deliver_at, datetime) and message.deliver_at.tzinfo is None:
            # datetime.now() is naive and local: taken as UTC it was hours early or late
            raise InvalidTimer(
                f"deliver_at={message.deliver_at!r} has no time zone; give an aware datetime, "
                "e.g. datetime.now(timezone.utc) + timedelta(minutes=5), or epoch milliseconds"
            )
        try:
            due = to_ms(message.deliver_at)
        except TypeError as e:
            raise InvalidTimer(f"deliver_at {message.deliver_at!r}: {e}") from e
    else:
        raw = props[Prop.TIMER_DELIVER_MS]
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
            raise InvalidTimer(
                f"{Prop.TIMER_DELIVER_MS}={raw!r} is not an absolute time in epoch milliseconds"
            )
        due = int(raw)
    return check_timer_horizon(due, now_ms, horizon_ms)


def check_timer_horizon(due: int, now_ms: int, horizon_ms: int) -> int:
    """Refuse a due time beyond ``now + horizon`` or earlier than ``now - horizon``."""
    from deltamq.clock import ms_to_iso

    if due > now_ms + horizon_ms:
        raise InvalidTimer(
            f"timer due at {ms_to_iso(due)} is {(due - now_ms) / 86_400_000:.1f} days ahead; the "
            f"horizon allows at most {horizon_ms / 86_400_000:g} days (timer_horizon_ms={horizon_ms})"
        )
    if due < now_ms - horizon_ms:
        raise InvalidTimer(
            f"timer due at {ms_to_iso(due)} is {(now_ms - due) / 86_400_000:.1f} days in the past: "
            "a timer already due is delivered at once, but one more than "
            f"{horizon_ms / 86_400_000:g} days late (timer_horizon_ms={horizon_ms}) is taken for a "
            "mistake; check the time, or send without a timer to deliver now"
        )
    return due
