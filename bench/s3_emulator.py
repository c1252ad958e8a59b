"""An S3 API server (moto) and, in front of it, the tests' proxy (tests/support/fault_proxy.py:
faults on demand, requests counted), started for a benchmark and stopped after it."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@contextmanager
def s3_behind_proxy(root: Path) -> Iterator[tuple[dict[str, str], Any]]:
    """Yields (the storage options that reach S3 through the proxy, the proxy's
    ``Faults`` handle); the bucket is ``conftest.S3_BUCKET``; the proxy logs to
    ``root/proxy.log``."""
    from conftest import S3_BUCKET, _free_port, create_bucket, running, s3_server_command
    from support.fault_proxy import CONTROL, Faults

    s3, proxy = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    options = {
        "AWS_ACCESS_KEY_ID": "deltamq-bench",
        "AWS_SECRET_ACCESS_KEY": "deltamq-bench-secret",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": proxy,
        "AWS_ALLOW_HTTP": "true",
    }
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    moto = s3_server_command(int(s3.rsplit(":", 1)[1]))
    proxy_cmd = [
        sys.executable,
        "-m",
        "support.fault_proxy",
        "--target",
        s3,
        "--port",
        proxy.rsplit(":", 1)[1],
    ]

    def proxy_up() -> bool:
        import urllib.request

        urllib.request.urlopen(proxy + CONTROL, timeout=2).read()
        return True

    root.mkdir(parents=True, exist_ok=True)
    with (
        running(moto, env=None, ready=lambda: create_bucket(s3, S3_BUCKET), what="moto_server"),
        running(proxy_cmd, env=env, ready=proxy_up, what="the fault proxy", log=root / "proxy.log"),
    ):
        yield options, Faults(proxy, options)
