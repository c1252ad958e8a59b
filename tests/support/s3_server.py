"""moto's S3 API server, with conditional writes made atomic: ``python s3_server.py -H host -p port``.

deltamq, Sail and delta-rs commit a Delta log entry with a PUT carrying
``If-None-Match: *`` (put-if-absent), which Amazon S3 performs atomically: of two
writers racing for one version, exactly one succeeds. moto 5.2's server checks the
condition (``S3Response`` looks the key up) and then stores the object, two steps on a
thread per request with no lock between them, so two such PUTs arriving together could
in principle both pass the check: both writers told they committed, the second entry
replacing the first. Not reproduced directly (0 rounds with two winners in 300 rounds of
16 racing PUTs), but one loaded slow-tier run lost two producer commits in
tests/test_lite.py's race, which that would explain. This launcher serves moto's own
application (as its ``moto_server`` command does) and runs each conditional request
(``If-None-Match`` / ``If-Match``) under one lock, so the check and the write happen
together, as on S3. Everything else runs concurrently, as before.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

_CONDITIONAL = ("HTTP_IF_NONE_MATCH", "HTTP_IF_MATCH")


def atomic_conditions(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """``app`` (a WSGI application) with its conditional requests run one at a time, the
    response read before the lock is let go."""
    lock = threading.Lock()

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not any(environ.get(h) for h in _CONDITIONAL):
            return app(environ, start_response)
        with lock:
            response = app(environ, start_response)
            try:
                return [b"".join(response)]
            finally:
                close = getattr(response, "close", None)
                if close is not None:
                    close()

    return serve


def main(argv: list[str] | None = None) -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-H", "--host", default="127.0.0.1")
    ap.add_argument("-p", "--port", type=int, required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto_server sets it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(
        args.host,
        args.port,
        atomic_conditions(app),
        threaded=True,
        request_handler=MotoRequestHandler,
    )


if __name__ == "__main__":
    main()
