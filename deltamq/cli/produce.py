"""``send``: one message from the arguments, or a JSON-lines file in batches."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltamq.message import Message


def send(broker, args: argparse.Namespace) -> int:
    from deltamq.message import Message

    producer = broker.producer(args.producer_group)
    if args.file:
        return _send_file(producer, args)
    if not args.topic or args.body is None:
        raise SystemExit("deltamq: error: send needs TOPIC BODY, or --file FILE")
    msg = Message(
        args.topic,
        args.body,
        tags=args.tags,
        keys=args.keys,
        delay_level=args.delay_level,
        properties=_parse_props(args.property) or None,
    )
    print(producer.send(msg, queue_key=args.queue_key))
    return 0


def _send_file(producer, args: argparse.Namespace) -> int:
    """Send the file's messages, ``--batch-size`` per commit; a bad line stops the sending
    there (the batches before it stay sent)."""
    total = 0
    batch: list[Message] = []
    for msg in _read_messages(args.file):
        batch.append(msg)
        if len(batch) >= args.batch_size:
            total += len(producer.send_batch(batch))
            batch = []
            print(f"sent {total} messages...", file=sys.stderr)
    if batch:
        total += len(producer.send_batch(batch))
    print(f"sent {total} messages from {args.file}")
    return 0


def _read_messages(path: str) -> Iterator[Message]:
    """The messages of a JSON-lines file, one at a time (blank lines skipped)."""
    from deltamq.message import Message

    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                body = obj["body"] if isinstance(obj["body"], str) else json.dumps(obj["body"])
                msg = Message(
                    obj["topic"],
                    body,
                    tags=obj.get("tags"),
                    keys=obj.get("keys"),
                    delay_level=obj.get("delay_level", 0),
                    properties=obj.get("properties"),
                )
            except (KeyError, ValueError, TypeError) as e:
                raise SystemExit(f"deltamq: error: {path}:{lineno}: {e}") from e
            yield msg


def _parse_props(items: list[str]) -> dict[str, str]:
    props = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"deltamq: error: --property {item!r} is not K=V")
        props[k] = v
    return props
