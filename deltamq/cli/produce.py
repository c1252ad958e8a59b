"""``send``: one message from the arguments, or a JSON-lines file in batches.

Each message sent is shown as RocketMQ's SendResult shows it, as far as it is known when
the message is stored: status, msg id, topic and queue id (the queue offset is assigned
later, by dispatch). A delay level above the warehouse's highest is clamped to it, as
RocketMQ does, with a notice on stderr. A file is checked whole before anything is sent:
a bad line is named file:line with what is wrong (exit 6), and nothing is sent.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from deltamq.cli.format import duration, emit, ms_to_iso, print_table
from deltamq.cli.parser import InputMalformed, InputMissing, UsageError, now_arg, refuse_unused
from deltamq.errors import DeltaMQError

if TYPE_CHECKING:
    from deltamq.message import Message
    from deltamq.sending import SendResult

FIELDS = ("topic", "body", "tags", "keys", "delay_level", "delay_ms", "deliver_at", "properties")
"""What a line of a ``send --file`` file may hold (topic and body are required)."""
OFFSET_LATER = "assigned at dispatch"
"""What a SendResult's queue offset is when the message is stored."""


def send(broker, args: argparse.Namespace) -> int:
    # the command says a clamped level itself (a notice naming the option or the line):
    # the producer's own warning is held back while it runs, and only then
    sending = logging.getLogger("deltamq.sending")
    level = sending.level
    sending.setLevel(logging.ERROR)
    try:
        return _send(broker, args)
    finally:
        sending.setLevel(level)


def _send(broker, args: argparse.Namespace) -> int:
    producer = broker.producer(args.producer_group)
    top = broker.max_delay_level()
    if args.file:
        if args.body is not None:
            raise UsageError("send takes TOPIC BODY, or [TOPIC] --file FILE (each line has its body)")
        if args.tags or args.keys or args.property or args.queue_key or _held(args):  # per line
            raise UsageError(
                "with --file each line gives its own tags, keys, delay and properties; "
                "--tags/--keys/--delay-*/--deliver-at/--property/--queue-key are for TOPIC BODY"
            )
        return _send_file(broker, producer, args, top)
    if not args.topic or args.body is None:
        raise UsageError("send needs TOPIC BODY, or --file FILE")
    if not args.file:
        refuse_unused(args, "send TOPIC BODY", {"batch_size": ("--batch-size (it is for --file)", 10_000)})
    msg = _message(args, top, broker.clock.now_ms())
    (result,) = producer.send_results([msg], queue_keys=None if args.queue_key is None else [args.queue_key])
    if result.clamped:
        _say_clamped(broker, f"delay level {result.requested_delay_level}", result.delay_level)
    return emit(args, _result_data(result), lambda: _print_results([result]))


def _held(args: argparse.Namespace) -> bool:
    return bool(args.delay_level) or args.delay_ms is not None or args.deliver_at is not None


def _message(args: argparse.Namespace, top: int, now: int) -> Message:
    from deltamq.message import Message, delay_ms

    if args.delay_level < 0:
        raise UsageError(f"--delay-level {args.delay_level} is not allowed: {_levels_allowed(top)}")
    if args.delay_ms is not None:
        delay_ms(args.delay_ms)  # the API's own check and words
    deliver_at = now_arg(args.deliver_at, "--deliver-at")
    _not_past("--deliver-at", deliver_at, now)
    return Message(
        args.topic,
        args.body,
        tags=args.tags,
        keys=args.keys,
        delay_level=args.delay_level,
        properties=_parse_props(args.property) or None,
        delay=None if args.delay_ms is None else timedelta(milliseconds=args.delay_ms),
        deliver_at=deliver_at,
    )


def _levels_allowed(top: int) -> str:
    return f"0 (no delay) or 1..{top} (a level above {top} is clamped to {top})"


def _say_clamped(broker, what: str, level: int) -> None:
    delay = dict(broker.warehouse.levels()).get(level)
    print(
        f"deltamq: notice: {what} is above the warehouse's highest level: clamped to {level} "
        f"({duration(delay)}), as RocketMQ does",
        file=sys.stderr,
        flush=True,
    )


def _result_data(r: SendResult) -> dict[str, Any]:
    return {
        "status": r.status,
        "msg_id": r.msg_id,
        "topic": r.topic,
        "queue_id": r.queue_id,
        "queue_offset": None,  # assigned at dispatch
        "delay_level": r.delay_level,
        "deliver_at": r.deliver_at,
    }


def _print_results(results: list[SendResult]) -> None:
    held = any(r.delay_level or r.deliver_at is not None for r in results)
    columns = ["status", "msg id", "topic", "queue id", "queue offset"] + (["held"] if held else [])
    print_table(
        columns,
        [
            [r.status, r.msg_id, r.topic, r.queue_id, OFFSET_LATER] + ([_held_text(r)] if held else [])
            for r in results
        ],
    )


def _held_text(r: SendResult) -> str:
    if r.deliver_at is not None:
        return f"timer, due {ms_to_iso(r.deliver_at)}"
    if r.delay_level:
        return f"delay level {r.delay_level}"
    return "-"


# --- send --file --------------------------------------------------------------------------------
def _send_file(broker, producer, args: argparse.Namespace, top: int) -> int:
    """Check every line, then send ``--batch-size`` per commit."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} is not allowed: at least 1")
    checked = _check_file(producer, args.file, top, args.topic)  # the whole file, first
    clamped = [(n, level) for n, level in checked if level > top]
    ids: list[str] = []
    queues: Counter[tuple[str, int]] = Counter()
    batch: list[Message] = []

    def flush() -> None:
        for r in producer.send_results(batch):
            ids.append(r.msg_id)
            queues[(r.topic, r.queue_id)] += 1
        batch.clear()

    for _, msg in _read_messages(producer, args.file, top, args.topic):
        batch.append(msg)
        if len(batch) >= args.batch_size:
            flush()
            print(f"sent {len(ids)} messages...", file=sys.stderr, flush=True)
    if batch:
        flush()
    if clamped:
        which = ", ".join(f"line {n}: {level}" for n, level in clamped[:3]) + (
            ", ..." if len(clamped) > 3 else ""
        )
        _say_clamped(broker, f"{args.file}: the delay level of {len(clamped)} message(s) ({which})", top)
    data = {
        "file": args.file,
        "status": "SEND_OK",
        "sent": len(ids),
        "queues": [{"topic": t, "queue_id": q, "messages": n} for (t, q), n in sorted(queues.items())],
        "queue_offset": None,  # assigned at dispatch
        "clamped": len(clamped),
        "msg_ids": ids,
    }

    def render() -> None:
        print_table(
            ["status", "topic", "queue id", "messages", "queue offsets"],
            [["SEND_OK", q["topic"], q["queue_id"], q["messages"], OFFSET_LATER] for q in data["queues"]],
        )
        print(f"sent {len(ids)} message{'' if len(ids) == 1 else 's'} from {args.file}")

    return emit(args, data, render)


MAX_BAD_LINES = 20
"""How many bad lines of a ``send --file`` file are named (the rest are counted)."""


def _open_lines(path: str):
    try:
        return open(path, "rb")  # decoded line by line: a bad byte is named by its line
    except OSError as e:
        raise InputMissing(f"cannot read {path}: {e.strerror or e}") from None


def _one_line(producer, path: str, lineno: int, raw: bytes, top: int, topic: str | None, now: int):
    """The message of one line (None for a blank one), checked by the producer's rules;
    InputMalformed names the file and line."""
    try:
        line = raw.decode("utf-8")
        if not line.strip():
            return None
        msg = _line_message(line, top, topic)
        _check(producer, msg, now)
        return msg
    except UnicodeDecodeError as e:
        raise InputMalformed(f"{path}:{lineno}: not UTF-8 text: {e.reason}") from None
    except (InputMalformed, DeltaMQError) as e:
        raise InputMalformed(f"{path}:{lineno}: {e}") from None


def _check_file(producer, path: str, top: int, topic: str | None) -> list[tuple[int, int]]:
    """Check every line (the messages are not kept: the file is read again to send);
    returns (line, delay level) of each message, or InputMalformed naming each bad line
    (up to :data:`MAX_BAD_LINES`) and how many there are."""
    now = producer.ctx.clock.now_ms()
    good: list[tuple[int, int]] = []
    bad: list[str] = []
    with _open_lines(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                msg = _one_line(producer, path, lineno, raw, top, topic, now)
            except InputMalformed as e:
                bad.append(str(e))
                continue
            if msg is not None:
                good.append((lineno, msg.delay_level))
    if len(bad) == 1:
        raise InputMalformed(f"{bad[0]} (nothing was sent)")
    if bad:
        more = f"; and {len(bad) - MAX_BAD_LINES} more" if len(bad) > MAX_BAD_LINES else ""
        raise InputMalformed(
            f"{len(bad)} bad lines in {path} (nothing was sent): " + "; ".join(bad[:MAX_BAD_LINES]) + more
        )
    return good


def _read_messages(producer, path: str, top: int, topic: str | None) -> Iterator[tuple[int, Message]]:
    """(line number, message) of each line of a JSON-lines file (blank lines skipped),
    each checked by the producer's rules; a bad line raises InputMalformed naming it.
    ``topic``: for lines that name none."""
    now = producer.ctx.clock.now_ms()
    with _open_lines(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            msg = _one_line(producer, path, lineno, raw, top, topic, now)
            if msg is not None:
                yield lineno, msg


def _line_message(line: str, top: int, topic: str | None = None) -> Message:
    """One line's message (``topic`` if it names none); InputMalformed (without the
    file:line) says what is wrong."""
    from deltamq.message import Message
    from deltamq.message import delay_ms as delay_ms_of

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputMalformed(f"not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InputMalformed(f"a line is a JSON object {{topic, body, ...}}, got {_kind(obj)}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise InputMalformed(f'unknown field "{unknown[0]}" (a line may hold {", ".join(FIELDS)})')
    if topic is not None:
        obj.setdefault("topic", topic)
    for name in ("topic", "body"):
        if name not in obj:
            hint = " (or give the topic: deltamq send TOPIC --file FILE)" if name == "topic" else ""
            raise InputMalformed(f'missing "{name}"{hint}')
    if not isinstance(obj["topic"], str):
        raise InputMalformed(f'"topic" must be a string, got {_kind(obj["topic"])}')
    for name in ("tags", "keys"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise InputMalformed(f'"{name}" must be a string, got {_kind(obj[name])}')
    level = obj.get("delay_level", 0)
    if level is None:
        level = 0
    if not _is_int(level) or level < 0:
        raise InputMalformed(
            f'"delay_level" must be an integer {_levels_allowed(top)}, got {json.dumps(level)}'
        )
    delay_ms = obj.get("delay_ms")
    if delay_ms is not None and not _is_int(delay_ms):
        raise InputMalformed(f'"delay_ms" must be an integer >= 0 (milliseconds), got {json.dumps(delay_ms)}')
    if delay_ms is not None:
        delay_ms_of(delay_ms)  # the API's own check and words
    deliver_at = _deliver_at(obj.get("deliver_at"))
    given = [
        k
        for k, held in (
            ("delay_level", level > 0),
            ("delay_ms", delay_ms is not None),
            ("deliver_at", deliver_at is not None),
        )
        if held
    ]
    if len(given) > 1:
        raise InputMalformed(
            f'give one of "delay_level", "delay_ms", "deliver_at"; got {" and ".join(given)}'
        )
    props = obj.get("properties")
    if props is not None and not (
        isinstance(props, dict) and all(isinstance(v, str) for v in props.values())
    ):
        raise InputMalformed(f'"properties" must be an object of string values, got {json.dumps(props)[:60]}')
    body = obj["body"] if isinstance(obj["body"], str) else json.dumps(obj["body"])
    return Message(
        obj["topic"],
        body,
        tags=obj.get("tags"),
        keys=obj.get("keys"),
        delay_level=level,
        properties=props,
        delay=None if delay_ms is None else timedelta(milliseconds=delay_ms),
        deliver_at=deliver_at,
    )


def _deliver_at(value: Any) -> int | None:
    if value is None:
        return None
    if _is_int(value) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            return now_arg(value, '"deliver_at"')
        except UsageError:
            pass
    raise InputMalformed(f'"deliver_at" must be epoch ms or an ISO time, got {json.dumps(value)}')


def _check(producer, msg: Message, now: int) -> None:
    """The producer's rules for one message, before anything is sent (DeltaMQError)."""
    from deltamq.message import body_bytes, timer_due_ms, validate_properties

    producer.ctx.validate_writable_topic(msg.topic)
    body_bytes(msg.body, producer.ctx.config.max_body_bytes)
    props = validate_properties(msg.properties)
    timer_due_ms(msg, props, now, producer.ctx.config.timer_horizon_ms)
    _not_past("deliver_at", msg.deliver_at, now)


def _not_past(option: str, deliver_at: Any, now: int) -> None:
    """The CLI refuses a time to deliver at that has passed (a typo, most likely); the
    Python API delivers such a timer at once."""
    from deltamq.errors import InvalidTimer

    if isinstance(deliver_at, int) and deliver_at < now:
        raise InvalidTimer(
            f"{option} {ms_to_iso(deliver_at)} is {duration(now - deliver_at)} in the past "
            f"(now is {ms_to_iso(now)} UTC): give a time ahead, or leave {option} out to "
            "send the message for delivery now"
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    """A JSON value's kind, for an error: ``a number (5)``, ``an array``."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    if isinstance(v, int | float) and not isinstance(v, bool):
        return f"a number ({v})"
    return names.get(type(v), type(v).__name__)


def _parse_props(items: list[str]) -> dict[str, str]:
    props = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"--property {item!r} is not K=V")
        props[k] = v
    return props
