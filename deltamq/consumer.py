"""The listener contract of a push consumer group (docs/behaviour.md §3).

A listener is ``fn(messages: list[StoredMessage], context: ConsumeContext) ->
ConsumeStatus``. ``None`` or an exception counts as ``RECONSUME_LATER``. On
``CONSUME_SUCCESS`` the messages after ``context.ack_index`` count as failed; a failed
message is sent back to ``%RETRY%<group>`` at ``context.delay_level_when_next_consume``
if > 0, else at level ``3 + reconsume_times``; a level < 0 sends it to the DLQ.

Example:
    >>> def on_orders(messages, context):
    ...     for m in messages:
    ...         handle(m.body)
    ...     return ConsumeStatus.CONSUME_SUCCESS
    >>> broker.create_group("billing", listener="shop.listeners:on_orders")

A listener marked :func:`columnar` gets the chunk as one ``pyarrow.RecordBatch`` instead
of a list of messages (no Python object per message), with the same context and the same
answers.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from deltamq.errors import ConfigError, ListenerUnavailable


class ConsumeStatus(StrEnum):
    """What a concurrent listener returns (RocketMQ's ConsumeConcurrentlyStatus)."""

    CONSUME_SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


class ConsumeOrderlyStatus(StrEnum):
    """What an orderly listener returns (RocketMQ's ConsumeOrderlyStatus)."""

    SUCCESS = "SUCCESS"
    SUSPEND_CURRENT_QUEUE_A_MOMENT = "SUSPEND_CURRENT_QUEUE_A_MOMENT"


_FAILED_IN_WORDS = {
    "RECONSUME_LATER": "the listener asked for the messages again later (RECONSUME_LATER)",
    "SUSPEND_CURRENT_QUEUE_A_MOMENT": "the listener asked to pause the queue a moment "
    "(SUSPEND_CURRENT_QUEUE_A_MOMENT)",
}


def failed_status_text(status: Any) -> str:
    """Why a listener call that raised nothing did not succeed, in words (``LAST_ERROR``)."""
    if isinstance(status, str) and status in _FAILED_IN_WORDS:
        return _FAILED_IN_WORDS[status]
    return (
        f"the listener returned {status!r}, which is not a status: return ConsumeStatus."
        "CONSUME_SUCCESS (ConsumeOrderlyStatus.SUCCESS) or RECONSUME_LATER"
    )


SUCCESS_STATUSES = ("CONSUME_SUCCESS", "SUCCESS")


@dataclass
class ConsumeContext:
    """Mutable context of one listener call (RocketMQ's ConsumeConcurrentlyContext).

    ``ack_index``: on success, messages after this index count as failed (default: all
    acknowledged). ``delay_level_when_next_consume``: 0 = RocketMQ's ``3 +
    reconsume_times``; > 0 that level; < 0 straight to the dead-letter queue.
    """

    group: str
    ack_index: int
    delay_level_when_next_consume: int = 0
    instance: str | None = None  # BROADCASTING: the instance this call is for


Listener = Callable[[list[Any], ConsumeContext], Any]

COLUMNAR_COLUMNS = (
    "topic",
    "queue_id",
    "queue_offset",
    "msg_id",
    "tags",
    "keys",
    "body",
    "properties",
    "born_ts",
    "store_ts",
    "reconsume_times",
    "suspends",
    "flag",
    "sys_flag",
)
"""The columns of the record batch a columnar listener gets, in this order (``body`` is
binary, ``properties`` a map of strings; the rest as in ``StoredMessage``)."""
_COLUMNAR = "__deltamq_columnar__"


def columnar(listener: Callable[[Any, ConsumeContext], Any]) -> Callable[[Any, ConsumeContext], Any]:
    """Mark a push listener as columnar: it is called as ``listener(batch, context)`` with
    the chunk (up to ``consume_message_batch_max_size`` messages) as a
    ``pyarrow.RecordBatch`` of :data:`COLUMNAR_COLUMNS`, and answers like any listener
    (``context.ack_index`` counts rows). Use it as a decorator::

        @columnar
        def on_orders(batch, context):
            totals.extend(batch.column("body").to_pylist())
            return ConsumeStatus.CONSUME_SUCCESS
    """
    if not callable(listener):
        raise ConfigError(f"columnar() takes a listener function, not {type(listener).__name__}")
    setattr(listener, _COLUMNAR, True)
    return listener


def is_columnar(listener: Any) -> bool:
    return bool(getattr(listener, _COLUMNAR, False))


IN_PROCESS = "in-process:"
"""Prefix of the ``listener`` stored for a callable that only exists in the process that
registered it (a lambda, a nested function, a function of ``__main__``): the group is a
push group everywhere, and a process that does not have the callable says so."""


def _where() -> str:
    """Which process an import ran in: on a Spark Connect server or a cluster's executors
    it is theirs, not the driver's, whose ``PYTHONPATH`` must reach the module."""
    return (
        f"This import ran in process {os.getpid()} on host {socket.gethostname()!r} "
        f"({sys.executable}); when the tick runs on a Spark Connect server or a cluster, that is "
        "the server's or an executor's Python, whose environment must have the module."
    )


def resolve_listener(path: str, what: str = "listener") -> Listener:
    """Import ``package.module:function`` (the form stored in ``group_config``)."""
    if path.startswith(IN_PROCESS):
        raise ListenerUnavailable(
            f"{what} {path[len(IN_PROCESS) :]!r} is a callable registered in the process that "
            "created it, and this process does not have it; to run it from `deltamq tick`, "
            "Airflow or spark-submit, give an import path 'package.module:function' of a "
            "module those processes can import (or run the tick in that process)"
        )
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ConfigError(f"{what} {path!r} is not an import path 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ListenerUnavailable(
            f"{what} {path!r} cannot be imported: {e}; the module must be importable where the "
            f"jobs run (install it, or add its folder to PYTHONPATH). {_where()}"
        ) from e
    if not callable(obj):
        raise ListenerUnavailable(f"{what} {path!r} is {type(obj).__name__}, not a callable")
    return obj


class ImportPathListener:
    """A picklable listener that imports ``package.module:function`` where it runs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fn: Listener | None = None

    def target(self) -> Listener:
        """The function the path names (imported on first use)."""
        if self._fn is None:
            self._fn = resolve_listener(self.path)
        return self._fn

    def __call__(self, messages: list[Any], context: ConsumeContext) -> Any:
        return self.target()(messages, context)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self._fn = state["path"], None


def retry_delay_ms(policy: Mapping[str, Any], reconsume_times: int) -> int:
    """Delay before retry ``reconsume_times + 1`` under a retry policy.

    ``{"delays_ms": [1000, 5000, ...]}`` (the last repeats) or
    ``{"base_ms": 1000, "cap_ms": 600000}`` (exponential: base × 2^n, capped).
    """
    if "delays_ms" in policy:
        delays = policy["delays_ms"]
        return int(delays[min(reconsume_times, len(delays) - 1)])
    return int(min(policy["cap_ms"], policy["base_ms"] * (2**reconsume_times)))


def validate_retry_policy(policy: Any) -> dict[str, Any] | None:
    """Check a retry policy; the error names the allowed forms."""
    if policy is None:
        return None
    allowed = "{'delays_ms': [ms, ...]} or {'base_ms': ms, 'cap_ms': ms}"
    if not isinstance(policy, dict):
        raise ConfigError(f"retry_policy {policy!r} is not allowed; use {allowed}")
    if set(policy) == {"delays_ms"}:
        d = policy["delays_ms"]
        if (
            isinstance(d, list)
            and d
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in d)
        ):
            return {"delays_ms": list(d)}
    if set(policy) == {"base_ms", "cap_ms"}:
        b, c = policy["base_ms"], policy["cap_ms"]
        if all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (b, c)) and b <= c:
            return {"base_ms": b, "cap_ms": c}
    raise ConfigError(f"retry_policy {policy!r} is not allowed; use {allowed} with positive integers")
