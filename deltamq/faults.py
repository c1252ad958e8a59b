"""Crash points for the crash harness (tests/support/crash.py).

Jobs call :func:`point` at the places a kill matters (before and after each commit).
Normally it does nothing. With ``DELTAMQ_CRASH_AT=<name>[:<n>]`` in the environment the
process SIGKILLs itself the ``n``-th time (default first) it reaches point ``name``:
no cleanup, no atexit, exactly like a machine dying there.
"""

from __future__ import annotations

import os
import signal

_ENV = "DELTAMQ_CRASH_AT"
_seen: dict[str, int] = {}


def point(name: str) -> None:
    """A named crash point; kills the process when the environment says so."""
    spec = os.environ.get(_ENV)
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
