"""spark-submit runs a job against a Spark Connect endpoint with the same code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deltamq import Broker, Message


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


def test_the_entry_exits_4_naming_a_group_it_cannot_load(broker, tmp_path, monkeypatch, capsys):
    """Under spark-submit a group whose listener cannot be imported where the job runs is an
    exit status the scheduler sees (4, as ``deltamq tick``), named on stderr; the job still
    ran for the other groups. It exited 0 before."""
    import deltamq.orchestration.submit as entry
    from deltamq.sail import EmbeddedServer as _EmbeddedServer

    (tmp_path / "only_here_too.py").write_text("def ok(messages, context):\n    return 'CONSUME_SUCCESS'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broker.create_topic("t", queues=1)
    broker.create_group("broken", "only_here_too:ok", consume_from="FIRST_OFFSET")
    broker.create_group("fine", "support.listeners:consume_all", consume_from="FIRST_OFFSET")
    broker.subscribe("broken", "t")
    broker.subscribe("fine", "t")
    broker.producer("p").send(Message("t", b"x"))
    broker.tick(broker.clock.now_ms())  # dispatched; "broken" could still load here
    (tmp_path / "only_here_too.py").unlink()
    sys.modules.pop("only_here_too", None)
    broker.producer("p").send(Message("t", b"y"))
    broker.close()  # the entry takes the leases, on a session of its own as under spark-submit
    monkeypatch.setenv("SPARK_REMOTE", _EmbeddedServer.url())
    warehouse = str(tmp_path / "wh")
    code = entry.main(["tick", "--warehouse", warehouse, "--now", str(broker.clock.now_ms() + 1000)])
    err = capsys.readouterr().err
    assert code == 4 and "group 'broken' consumed nothing" in err and "only_here_too" in err
    assert "'fine'" not in err
    reopened = Broker.open(warehouse)
    offsets = reopened.sql(
        "SELECT consumer_group, next_offset FROM offsets WHERE topic = 't' "
        "AND consumer_group IN ('broken', 'fine') ORDER BY consumer_group"
    ).collect()
    assert [(r["consumer_group"], r["next_offset"]) for r in offsets] == [("broken", 1), ("fine", 2)]
    reopened.close()
