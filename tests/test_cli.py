"""The deltamq command line, in-process (same embedded engine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import table_versions

from deltamq.cli import main


def _run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_admin_send_tick_sql_status(tmp_path, capsys):
    wh = str(tmp_path / "wh")
    assert _run(capsys, "init", "--warehouse", wh)[0] == 0
    code, out, _ = _run(capsys, "init", "--json", "--warehouse", wh)
    assert json.loads(out)["created"] == []
    assert _run(capsys, "topic", "create", "orders", "--queues", "2", "--warehouse", wh)[0] == 0
    assert _run(capsys, "topic", "update", "orders", "--queues", "3", "--warehouse", wh)[0] == 0
    assert _run(capsys, "group", "create", "billing", "--warehouse", wh)[0] == 0
    assert _run(capsys, "subscribe", "billing", "orders", "A || B", "--warehouse", wh)[0] == 0
    code, out, _ = _run(
        capsys, "send", "orders", "hello", "--tags", "A", "-p", "k=v", "--json", "--warehouse", wh
    )
    assert code == 0 and len(json.loads(out)["msg_id"]) == 24
    lines = tmp_path / "m.jsonl"
    lines.write_text(
        "\n".join(json.dumps({"topic": "orders", "body": {"n": i}, "delay_level": i % 2}) for i in range(25))
    )
    code, out, _ = _run(capsys, "send", "--file", str(lines), "--batch-size", "10", "--warehouse", wh)
    assert code == 0 and "sent 25 messages" in out
    code, out, _ = _run(capsys, "tick", "--now", "2026-01-01T00:00:00", "--warehouse", wh)
    assert code == 0 and "dispatch: OK in=26 out=26" in out
    # the sends were stamped by the wall clock, after this tick's now: the 12 delayed ones
    # are due "too far in the future" and promoted at once (docs/behaviour.md §2 clock correction)
    # promote indexes its copies in the same pass (no second dispatch)
    assert "promote: OK in=12 out=12" in out and "redispatch" not in out
    code, out, _ = _run(capsys, "sql", "SELECT count(*) AS n FROM consume_queue", "--warehouse", wh)
    assert "38" in out
    code, _, err = _run(capsys, "sql", "DELETE FROM commit_log", "--warehouse", wh)
    assert code == 2 and "--write" in err
    code, out, _ = _run(capsys, "status", "--warehouse", wh)
    assert "orders" in out and "%RETRY%billing" in out
    assert "transactions (half messages not yet settled" in out
    code, out, _ = _run(capsys, "topic", "list", "--warehouse", wh)
    assert "orders" in out and "3" in out


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    wh = str(tmp_path / "wh")
    assert _run(capsys, "init", "--warehouse", wh)[0] == 0
    code, _, err = _run(capsys, "send", "missing", "x", "--warehouse", wh)
    assert code == 2 and "topic 'missing' does not exist" in err
    code, _, err = _run(capsys, "topic", "create", "bad/name", "--warehouse", wh)
    assert code == 2 and "not allowed" in err
    code, _, err = _run(capsys, "tick", "--now", "1000", "--warehouse", wh)
    code, _, err = _run(capsys, "tick", "--now", "999", "--warehouse", wh)
    assert code == 2 and "earlier than the warehouse's last tick" in err


@pytest.mark.parametrize(
    "command",
    [
        ("status",),
        ("sql", "SELECT 1"),
        ("msg", "show", "0A0000000000000000000000"),
        ("dlq", "list"),
        ("doctor",),
        ("report", "--html", "r.html"),
        ("tick", "--now", "1000"),
        ("topic", "create", "orders"),
    ],
)
def test_commands_other_than_init_refuse_a_missing_warehouse_and_create_nothing(tmp_path, capsys, command):
    wh = tmp_path / "no" / "such" / "wh"
    code, _, err = _run(capsys, *command, "--warehouse", str(wh))
    assert code == 2
    assert f"no deltamq warehouse at {wh}" in err and "deltamq init" in err
    assert not (tmp_path / "no").exists()


@pytest.mark.unit
def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "deltamq.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("init", "topic", "group", "subscribe", "send", "sql", "status", "tick", "demo"):
        assert cmd in out.stdout


@pytest.mark.slow  # .ci/run runs `deltamq demo` itself as its set-up step
def test_demo_runs(tmp_path, capsys, monkeypatch):
    """The demo on a relative warehouse path (its check table is a path under it); run
    again on that warehouse it refuses before writing anything and leaves no lease held."""
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--warehouse", "demo"]) == 0
    out = capsys.readouterr().out
    assert "schedule=5" in out and "promote re-stored 5" in out and "promote re-stored 1" in out
    assert "report  09:45:00  09:50:00" in out  # due, and stored by the tick that promoted it
    assert "order-3 — inventory service unavailable: RECONSUME_LATER" in out
    assert "order-3 — unpaid after 30 min: cancelled (retry 1)" in out
    assert "order-2 — paid in time" in out
    assert "1 COMMIT, 1 ROLLBACK, 0 UNKNOWN" in out
    assert "order-1 — booked 'refunded'" in out and "order-4 — booked 'refunded'" not in out
    before = table_versions(tmp_path / "demo")
    assert main(["demo", "--warehouse", "demo"]) == 2
    assert "needs a new or empty warehouse" in capsys.readouterr().err
    assert table_versions(tmp_path / "demo") == before
    assert main(["tick", "--warehouse", "demo"]) == 0  # not held by the refused run


def test_operating_commands(tmp_path, capsys):
    """dlq list/resend, msg show (by id and key), status with recent runs, report,
    rebuild-index — from the command line on the wall clock."""
    wh = str(tmp_path / "wh")
    for args in (
        ("init",),
        ("topic", "create", "orders", "--queues", "1"),
        ("group", "create", "w", "--listener", "support.listeners:always_fail", "--max-reconsume-times", "0"),
        ("subscribe", "w", "orders"),
    ):
        assert _run(capsys, *args, "--warehouse", wh)[0] == 0
    code, out, _ = _run(capsys, "send", "orders", "boom", "--keys", "o-9", "--json", "--warehouse", wh)
    mid = json.loads(out)["msg_id"]
    for _ in range(2):  # deliver sends it to %DLQ%w; the next tick indexes the dead letter
        assert _run(capsys, "tick", "--warehouse", wh)[0] == 0
    code, out, _ = _run(capsys, "dlq", "list", "--group", "w", "--warehouse", wh)
    assert code == 0 and mid in out and "max_reconsume" in out
    code, out, _ = _run(capsys, "dlq", "resend", "--group", "w", "--rate", "50", "--warehouse", wh)
    assert code == 0 and "selected 1, resent 1, already resent before 0" in out
    assert _run(capsys, "tick", "--warehouse", wh)[0] == 0
    code, out, _ = _run(capsys, "msg", "show", "--key", "o-9", "--warehouse", wh)
    assert code == 0 and f"message {mid}:" in out and "dead-lettered by w" in out and "resent from" in out
    code, out, _ = _run(capsys, "status", "--warehouse", wh)
    assert code == 0 and "recent job runs" in out and "deliver" in out
    page = tmp_path / "r.html"
    code, out, _ = _run(capsys, "report", "--html", str(page), "--warehouse", wh)
    assert code == 0 and page.read_text().startswith("<!DOCTYPE html>") and "3 ticks" in out
    code, out, _ = _run(capsys, "rebuild-index", "--json", "--warehouse", wh)
    # the last tick's deliver dead-lettered the resent copy too; rebuilding indexes that as well
    assert code == 0 and json.loads(out)["rows_after"] == json.loads(out)["rows_before"] + 1 == 4


def test_a_command_without_the_broker_extra_says_which_install_it_needs(tmp_path):
    """Installed as ``deltamq[producer]`` (no PySpark), the command line names the extra to
    install instead of reporting an internal error."""
    code = (
        "import sys; sys.modules['pyspark'] = None\n"  # `import pyspark` fails as if not installed
        "from deltamq.cli import main\n"
        f"sys.exit(main(['status', '--warehouse', {str(tmp_path / 'wh')!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert "`deltamq status` needs the broker's engine (pyspark is not installed)" in out.stderr
    assert "pip install 'deltamq[broker]'" in out.stderr and "internal error" not in out.stderr


def test_durations_read_without_an_exponent():
    from deltamq.cli.format import duration

    assert [duration(ms) for ms in (1500, 90_000, 7_200_000, 500)] == ["1.5s", "90s", "2h", "500ms"]
    assert duration(217_976_000_000) == "2522.9d"  # was 2.17976e+08s
    assert duration(90_000_000) == "25h"
