"""The embedded engine's Sail server, in a process of its own (started by engine.py).

Run as ``python -I _sail_child.py <parent pid>``. The parent writes one JSON line on
stdin (``{"sys_path": [...]}``: listener code that Sail runs inside this process, and
the listener workers it spawns, import what the parent can import), then this process
starts a Sail Spark Connect server on a free port of 127.0.0.1, answers
``LISTENING <host> <port>`` on stdout and serves until its stdin closes or its parent
dies. Only the standard library and pysail are imported here.

Why a separate process: Sail keeps ~0.1 MB per executed operation that it never frees,
not even when the server is stopped and another started in the same process
(docs/engines.md); a child process can be replaced and its memory returned.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies (a SIGKILLed tick must not
    leave a server behind). Elsewhere the closed stdin ends it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def main() -> None:
    _die_with_parent(int(sys.argv[1]))
    setup = json.loads(sys.stdin.readline())
    sys.path[:] = setup["sys_path"]
    os.environ.setdefault("RUST_LOG", "error")
    from pysail.spark import SparkConnectServer

    server = SparkConnectServer(ip="127.0.0.1", port=0)
    server.start(background=True)
    host, port = server.listening_address
    sys.stdout.write(f"LISTENING {host} {port}\n")
    sys.stdout.flush()
    while sys.stdin.buffer.read(4096):
        pass
    os._exit(0)  # no orderly stop: open client streams would make it wait


if __name__ == "__main__":
    main()
