"""What goes wrong in a new user's first hour, each fixed: a listener that cannot be
imported is refused when named and, should it vanish later, reported loudly while its
messages wait; listener workers are not shadowed by the current directory; the Python
API has what the README shows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from support.listeners import Recorder, read_log

from deltamq import Message
from deltamq.cli import main
from deltamq.errors import ListenerUnavailable


def test_a_listener_path_that_cannot_be_imported_is_refused_when_named(broker, tmp_path, capsys):
    broker.create_topic("orders", queues=1)
    with pytest.raises(
        ListenerUnavailable, match=r"'nosuch_mod:fn' cannot be imported: No module named 'nosuch_mod'"
    ):
        broker.create_group("g", "nosuch_mod:fn")
    with pytest.raises(ListenerUnavailable, match=r"'support.listeners:no_such_function' cannot be imported"):
        broker.create_group("g", "support.listeners:no_such_function")
    where = rf"ran in process {os.getpid()} on host .*Spark Connect server"
    with pytest.raises(ListenerUnavailable, match=where):
        broker.create_group("g", "nosuch_mod:fn")  # where to fix it: the process that imported
    with pytest.raises(ListenerUnavailable, match=r"check listener 'nosuch_mod:check'"):
        broker.producer("shop", check_listener="nosuch_mod:check")
    assert "g" not in broker.groups() and "shop" not in broker.check_configs()
    broker.create_group("lake")
    with pytest.raises(ListenerUnavailable, match=r"transform of sink 'lake'"):
        broker.sink_to_table("lake", str(tmp_path / "sink"), ["msg_id"], "nosuch_mod:rows")
    wh = str(broker.warehouse.location)
    code = main(["group", "create", "cli", "--listener", "nosuch_mod:fn", "--warehouse", wh])
    err = capsys.readouterr().err
    assert code == 2 and "nosuch_mod:fn" in err and "No module named 'nosuch_mod'" in err


def test_a_listener_that_vanishes_is_reported_and_its_messages_wait(
    broker, clock, tmp_path, monkeypatch, capsys
):
    """The module is importable when the group is made, then deleted: the tick says which
    group consumed nothing and why (result, tick line, job_runs, `deltamq tick` exit 4),
    nothing is retried or dead-lettered, and once the module is back every message arrives."""
    module = tmp_path / "vanishing_listener.py"
    log = tmp_path / "calls.jsonl"
    module.write_text(
        textwrap.dedent(
            f"""
            import json

            def ok(messages, context):
                with open({str(log)!r}, "a") as fh:
                    for m in messages:
                        fh.write(json.dumps(m.body.decode()) + "\\n")
                return "CONSUME_SUCCESS"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    broker.create_topic("orders", queues=1)
    broker.create_group("g", "vanishing_listener:ok", consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    broker.create_group("fine", Recorder(tmp_path / "fine.jsonl"), consume_from="FIRST_OFFSET")
    broker.subscribe("fine", "orders")
    p = broker.producer("shop")
    for i in range(3):
        p.send(Message("orders", f"m{i}".encode()))
    source = module.read_text()
    module.unlink()

    result = broker.tick(clock.now_ms())
    d = result.delivered
    assert (d.consumed, d.setup_failed, d.retried, d.dead_lettered) == (3, 3, 0, 0)  # "fine" consumed 3
    ((group, why),) = result.setup_errors
    assert group == "g" and "vanishing_listener" in why and "cannot be imported" in why
    assert "g: not handed over 3" in result.summary() and "fine: consumed 3" in result.summary()
    assert "group g consumed nothing" in str(result)
    row = broker.sql("SELECT error FROM job_runs WHERE job = 'deliver'").collect()[0]
    assert "group g: 3 failed" in row["error"] and "cannot be imported" in row["error"]
    assert broker.sql("SELECT count(*) FROM commit_log WHERE topic LIKE '%\\%g'").collect()[0][0] == 0
    broker.close()  # the CLI's tick takes the leases

    clock.advance(seconds=1)
    code = main(["tick", "--now", str(clock.now_ms()), "--warehouse", str(broker.warehouse.location)])
    captured = capsys.readouterr()
    assert code == 4 and "group 'g' consumed nothing" in captured.err

    module.write_text(source)
    clock.advance(seconds=1)
    assert main(["tick", "--now", str(clock.now_ms()), "--warehouse", str(broker.warehouse.location)]) == 0
    assert sorted(open(log).read().split()) == ['"m0"', '"m1"', '"m2"']


def test_a_callable_listener_whose_module_vanishes_holds_its_group_alone(
    broker, clock, tmp_path, monkeypatch
):
    """A listener given as a function, not an import path, is pickled by reference: a
    worker started after its module is gone cannot load it. That failed the whole deliver
    pass, and three such passes dead-lettered the queue heads of every group as poison; it
    is now the group's own "cannot be loaded", as for an import path."""
    import importlib

    module = tmp_path / "vanishing_callable.py"
    module.write_text("def ok(messages, context):\n    return 'CONSUME_SUCCESS'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broker.create_topic("orders", queues=1)
    broker.create_group("g", importlib.import_module("vanishing_callable").ok, consume_from="FIRST_OFFSET")
    broker.subscribe("g", "orders")
    broker.create_group("fine", Recorder(tmp_path / "fine.jsonl"), consume_from="FIRST_OFFSET")
    broker.subscribe("fine", "orders")
    broker.producer("shop").send_batch([Message("orders", f"m{i}") for i in range(3)])
    module.unlink()
    t = clock.now_ms()
    for k in range(4):
        result = broker.tick(t + k * 1_000)
        assert result.delivered.setup_failed == 3
        ((group, why),) = result.setup_errors
        assert group == "g" and "vanishing_callable" in why, why
    assert len(read_log(tmp_path / "fine.jsonl")) == 3  # each once
    assert broker.sql("SELECT count(*) FROM commit_log WHERE topic LIKE '%\\%g'").collect()[0][0] == 0


@pytest.mark.slow
def test_listener_workers_are_not_shadowed_by_a_deltamq_folder_in_the_current_directory(tmp_path):
    """Run from a folder holding ``deltamq/`` (a clone's parent): the worker must import the
    installed package, and the listener (which imports ``deltamq``) its own module."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "shadow_listener.py").write_text(
        "from deltamq import ConsumeStatus\n\n\ndef ok(messages, context):\n"
        "    return ConsumeStatus.CONSUME_SUCCESS\n"
    )
    (lib / "run.py").write_text(
        textwrap.dedent(
            f"""
            from deltamq import Broker, FakeClock, Message

            with Broker.init({str(tmp_path / "wh")!r}, clock=FakeClock()) as b:
                b.create_topic("t", queues=1)
                b.create_group("g", "shadow_listener:ok", consume_from="FIRST_OFFSET")
                b.subscribe("g", "t")
                b.producer().send(Message("t", b"x"))
                d = b.tick().delivered
                print(d.consumed, d.setup_failed, d.errors)
            """
        )
    )
    cwd = tmp_path / "parent"
    (cwd / "deltamq").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(lib)}
    out = subprocess.run(
        [sys.executable, str(lib / "run.py")], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["1", "0"], out.stdout


def test_the_python_api_has_what_the_readme_shows(broker, clock):
    import deltamq
    from deltamq.constants import TxState

    assert deltamq.TxState is TxState and deltamq.TickResult.__name__ == "TickResult"
    assert broker.spark is broker.engine.spark
    with broker as b:
        b.create_topic("orders", queues=1)
        result = b.tick(clock.now_ms())
    text = str(result)
    assert text.startswith("tick ") and "dispatch" in text and "JobRun(" not in text
    assert len(text.splitlines()) == len(result.jobs) + 1


def _groups_of(trace, topic):
    return [g for e in trace if e["topic"] == topic for g in e["groups"]]


def test_a_trace_tells_each_groups_truth_from_any_copys_id(broker, clock, tmp_path):
    """Per group: pending, consumed, sent back (retry n, due), filtered, dead-lettered —
    before the sent-back copy is dispatched, from the retried copy's id too; and a message
    not yet dispatched says so."""
    broker.create_topic("orders", queues=1)
    broker.create_group("ok", Recorder(tmp_path / "ok.jsonl"), consume_from="FIRST_OFFSET")
    broker.subscribe("ok", "orders")
    broker.create_group("picky", Recorder(tmp_path / "picky.jsonl"), consume_from="FIRST_OFFSET")
    broker.subscribe("picky", "orders", "other-tag")
    broker.create_group("flaky", Recorder(tmp_path / "flaky.jsonl", "fail"), consume_from="FIRST_OFFSET")
    broker.subscribe("flaky", "orders")
    broker.create_group(
        "strict",
        Recorder(tmp_path / "strict.jsonl", "fail"),
        consume_from="FIRST_OFFSET",
        max_reconsume_times=0,
    )
    broker.subscribe("strict", "orders")
    mid = broker.producer("shop").send(Message("orders", b"paid", tags="paid"))

    (stored,) = broker.trace(mid)
    assert stored["event"] == "stored, not yet dispatched" and stored["topic"] == "orders"

    t = clock.now_ms()
    broker.tick(t)  # dispatched and delivered; the sent-back copies are stored, not yet indexed
    states = _groups_of(broker.trace(mid), "orders")
    assert "ok: consumed" in states and "picky: filtered" in states
    assert "strict: dead-lettered (max_reconsume)" in states
    (flaky,) = [s for s in states if s.startswith("flaky: ")]
    assert flaky.startswith("flaky: sent back (retry 1, due ")  # level 3: 10 s after the attempt

    clock.advance(seconds=11)
    result = broker.tick(clock.now_ms())  # the retry is promoted and delivered (and fails again)
    retried = [m for g, m, _ in result.delivered.errors if g == "flaky"]
    assert retried and retried[0] != mid
    from_copy = broker.trace(retried[0])  # the promoted copy's id traces the whole message
    assert [e["msg_id"] for e in from_copy if e["topic"] == "orders"] == [mid]
    assert any(g.startswith("flaky: sent back (retry 2, due ") for g in _groups_of(from_copy, "%RETRY%flaky"))


def test_a_group_whose_offset_has_not_passed_a_message_has_it_pending(broker, clock, tmp_path):
    broker.create_topic("orders", queues=1)
    broker.create_group("puller", consume_from="FIRST_OFFSET")  # a pull group, nobody pulls yet
    broker.subscribe("puller", "orders")
    mid = broker.producer("shop").send(Message("orders", b"x"))
    broker.tick(clock.now_ms())
    assert _groups_of(broker.trace(mid), "orders") == ["puller: pending"]


@pytest.mark.slow
def test_a_data_quality_task_log_carries_deltamq_lines_not_great_expectations_noise(broker, tmp_path):
    """What a scheduler's task log shows (logging at INFO, as Airflow's): deltamq's own
    summary, and not the ~200 lines Great Expectations logs as it is imported."""
    broker.create_topic("orders", queues=1)
    broker.close()
    script = textwrap.dedent(
        f"""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
        from deltamq.orchestration.runs import run_quality, settings
        print(run_quality(settings({{"warehouse": {str(broker.warehouse.location)!r}}}))["status"])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert not [line for line in lines if line.startswith("great_expectations")], lines[:5]
    assert any(line.startswith("deltamq.orchestration.runs data quality: ") for line in lines), lines
    assert out.stdout.split()[-1] == "ok"


@pytest.mark.slow
def test_the_demo_takes_the_time_the_readme_and_help_say(tmp_path):
    """README, `deltamq --help` and the demo's own closing line agree: about 10 seconds."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    helptext = subprocess.run(
        [sys.executable, "-m", "deltamq.cli", "--help"], capture_output=True, text=True
    ).stdout
    assert "The demo (about 10 seconds" in readme and "(about 10 seconds)" in helptext
    out = subprocess.run(
        [sys.executable, "-m", "deltamq.cli", "demo", "--warehouse", str(tmp_path / "wh")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    import re

    took = float(re.search(r"done in ([0-9.]+)s", out.stdout).group(1))
    assert took < 20, f"the demo took {took} s; README and --help say about 10"
