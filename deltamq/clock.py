"""Clocks. Every time the broker stamps comes from one injectable clock.

Producers stamp ``born_ts``/``store_ts`` from the broker's clock and ``tick()`` uses it
when no ``now`` is given; jobs never read the wall clock themselves. Leases are the
exception: they use the wall clock (a fake clock must not let two runners in).

Example:
    >>> clock = FakeClock(1_700_000_000_000)
    >>> clock.advance(seconds=30)
    1700000030000
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    """Anything with ``now_ms()`` returning epoch milliseconds."""

    def now_ms(self) -> int: ...


class SystemClock:
    """The wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def __repr__(self) -> str:
        return "SystemClock()"


class FakeClock:
    """A clock that moves only when told to: hours of delays run in milliseconds."""

    def __init__(self, start_ms: int | datetime = 1_767_225_600_000) -> None:
        self._lock = threading.Lock()
        self._now = to_ms(start_ms)

    def now_ms(self) -> int:
        with self._lock:
            return self._now

    def set(self, when: int | datetime) -> int:
        with self._lock:
            self._now = to_ms(when)
            return self._now

    def advance(
        self, delta: timedelta | None = None, *, ms: int = 0, seconds: float = 0, minutes: float = 0
    ) -> int:
        """Move forward by ``delta`` and/or the keyword amounts; returns the new now."""
        step = ms + int(seconds * 1000) + int(minutes * 60_000)
        if delta is not None:
            step += int(delta / timedelta(milliseconds=1))
        if step < 0:
            raise ValueError(f"a fake clock only moves forward; got a step of {step} ms")
        with self._lock:
            self._now += step
            return self._now

    def sleep(self, seconds: float) -> None:
        """What sleeping does to a fake clock: it moves forward, at once."""
        self.advance(ms=max(0, round(seconds * 1000)))

    def __repr__(self) -> str:
        return f"FakeClock({self._now})"


def to_ms(when: int | float | datetime) -> int:
    """Epoch milliseconds of an int/float (already ms) or a datetime (naive = UTC)."""
    if isinstance(when, datetime):
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return int(when.timestamp() * 1000)
    if isinstance(when, bool) or not isinstance(when, int | float):
        raise TypeError(f"expected epoch milliseconds or a datetime, got {when!r}")
    return int(when)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

MAX_MS = 253_402_300_799_999
"""The latest time a job's ``now`` or a message's time may be: 9999-12-31T23:59:59.999Z
(the last time a datetime, and Spark's timestamps, can hold)."""


def check_ms(ms: int, what: str = "now") -> int:
    """``ms`` if it is a time deltamq can store (0 to :data:`MAX_MS`), else ValueError
    naming ``what``, the value and the range: a tick at a time no datetime holds would be
    recorded as the warehouse's last tick, and every later tick refused."""
    if not 0 <= ms <= MAX_MS:
        raise ValueError(
            f"{what}={ms} is outside the times deltamq stores: epoch ms from 0 (1970-01-01) "
            f"to {MAX_MS} (9999-12-31T23:59:59.999Z)"
        )
    return ms


def ms_to_iso(ms: int | None) -> str:
    """Readable UTC time of epoch ms, for the CLI and the demo (the number itself for a
    time no datetime holds)."""
    if ms is None:
        return "-"
    try:
        return (_EPOCH + timedelta(milliseconds=ms)).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    except (OverflowError, ValueError):
        return f"{ms} ms"
