"""spark-submit runs a job against a Spark Connect endpoint with the same code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deltamq import Message


@pytest.mark.slow  # subprocesses
def test_spark_submit_dispatch_over_spark_connect(broker, tmp_path):
    import deltamq.orchestration.submit as entry
    from deltamq.sail import EmbeddedServer as _EmbeddedServer

    bindir = Path(sys.executable).parent
    submit = shutil.which("spark-submit", path=str(bindir)) or shutil.which("spark-submit")
    if submit is None:
        pytest.fail("spark-submit is not on PATH; pyspark installs it next to python")
    broker.create_topic("t")
    broker.producer("p").send_batch([Message("t", b"x")] * 3)
    env = {k: v for k, v in os.environ.items() if k != "SPARK_CONNECT_MODE_ENABLED"}
    env.update(PATH=f"{bindir}:{env['PATH']}", PYSPARK_PYTHON=sys.executable)
    out = subprocess.run(
        [
            submit,
            "--remote",
            _EmbeddedServer.url(),
            "--conf",
            "spark.api.mode=connect",
            entry.__file__,
            "dispatch",
            "--warehouse",
            str(tmp_path / "wh"),
            "--now",
            str(broker.clock.now_ms()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dispatch: OK in=3 out=3" in out.stdout
    assert broker.sql("SELECT count(*) AS n FROM consume_queue").collect()[0]["n"] == 3
