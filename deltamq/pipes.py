"""Waiting on a child process's pipe (the embedded Sail server's, a listener worker's).

``select.poll`` takes any descriptor; ``select.select`` refuses descriptors from 1 024
up (``filedescriptor out of range in select()``), which a long-lived engine worker
that holds many files and sockets reaches.
"""

from __future__ import annotations

import select
from typing import IO, Any

_EVENTS = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def readable(stream: IO[Any], timeout_s: float | None) -> bool:
    """Whether ``stream`` has something to read, or was closed, within ``timeout_s``
    seconds (None: wait as long as it takes)."""
    poller = select.poll()
    poller.register(stream.fileno(), _EVENTS)
    return bool(poller.poll(None if timeout_s is None else max(0, round(timeout_s * 1000))))
