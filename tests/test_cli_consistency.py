"""The command line speaks one way: one exit-status scheme (documented in --help and the
README), one-line errors and no tracebacks (a missing or malformed input file, a query
the engine rejects, a bug), help on every option, SendResult tables, --json on every
command, readable times in errors, and `status` showing every group."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deltamq.cli import main, parser
from deltamq.cli.parser import EXIT_STATUSES, build_parser
from deltamq.tables.leases import Leases, LeaseTerms, describe_holder

README = Path(__file__).resolve().parent.parent / "README.md"


def _run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def wh(tmp_path, capsys) -> str:
    """A warehouse with topic ``orders`` (2 queues), made by the CLI."""
    location = str(tmp_path / "wh")
    assert main(["init", "--warehouse", location]) == 0
    assert main(["topic", "create", "orders", "--queues", "2", "--warehouse", location]) == 0
    capsys.readouterr()
    return location


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltamq: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _stored(capsys, wh: str) -> int:
    code, out, _ = _run(capsys, "sql", "SELECT count(*) AS n FROM commit_log", "--json", "--warehouse", wh)
    assert code == 0
    return json.loads(out)["rows"][0][0]


# --- the exit-status scheme -----------------------------------------------------------------------
@pytest.mark.unit
def test_the_exit_statuses_are_one_scheme_shown_by_help_and_the_readme():
    from deltamq.cli import SETUP_FAILED_EXIT, SKIPPED_EXIT

    codes = [code for code, _ in EXIT_STATUSES]
    assert codes[:5] == [0, 1, 2, 3, 4] and (SKIPPED_EXIT, SETUP_FAILED_EXIT) == (3, 4)
    assert len(set(codes)) == len(codes)
    helptext = build_parser().format_help()
    listed = dict(re.findall(r"^  (\d+) +(.+)$", helptext[helptext.index("exit status:") :], re.M))
    assert {int(c): m for c, m in listed.items()} == dict(EXIT_STATUSES)
    section = _readme_section("## Command line")
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.M))
    assert sorted(int(c) for c in rows) == sorted(codes), "the README's exit-status table"


def test_usage_errors_exit_2_like_argparse(wh, capsys):
    code, _, err = _run(capsys, "send", "--warehouse", wh)
    assert code == 2 and "send needs TOPIC BODY" in _one_error_line(err)
    code, _, err = _run(capsys, "msg", "show", "--warehouse", wh)
    assert code == 2 and "msg show needs" in _one_error_line(err)
    code, _, err = _run(capsys, "dlq", "list", "--from", "yesterday", "--warehouse", wh)
    assert code == 2 and "--from 'yesterday' is neither epoch ms nor an ISO time" in _one_error_line(err)
    code, _, err = _run(capsys, "group", "create", "g", "--consume-timestamp", "noon", "--warehouse", wh)
    assert code == 2 and "--consume-timestamp 'noon' is neither" in _one_error_line(err)
    code, _, err = _run(capsys, "send", "orders", "x", "--delay-level", "-1", "--warehouse", wh)
    assert code == 2 and "--delay-level -1 is not allowed: 0 (no delay) or 1..18" in _one_error_line(err)
    with pytest.raises(SystemExit) as e:  # argparse's own
        main(["send", "orders", "x", "--delay-level", "2", "--delay-ms", "5", "--warehouse", wh])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# --- no tracebacks --------------------------------------------------------------------------------
def test_a_missing_input_file_is_one_line_naming_it_and_the_cause(wh, capsys):
    code, out, err = _run(capsys, "send", "orders", "--file", "nosuch.jsonl", "--warehouse", wh)
    line = _one_error_line(err)
    assert code == parser.NO_INPUT == 5 and out == ""
    assert "nosuch.jsonl" in line and "No such file or directory" in line
    code, _, err = _run(capsys, "report", "--html", "/no/such/folder/r.html", "--warehouse", wh)
    assert code == 5 and "/no/such/folder/r.html: No such file or directory" in _one_error_line(err)


def test_a_query_the_engine_rejects_is_one_line_naming_its_problem(wh, capsys):
    code, out, err = _run(capsys, "sql", "DESCRIBE job_runs", "--warehouse", wh)
    line = _one_error_line(err)
    assert code == parser.ENGINE_REJECTED == 7 and out == ""
    assert "the engine rejected the query 'DESCRIBE job_runs': " in line
    assert "DESCRIBE TABLE job_runs" in line  # what describes a table
    code, out, err = _run(capsys, "sql", "SELECT nosuch FROM job_runs", "--json", "--warehouse", wh)
    assert code == 7 and "nosuch" in _one_error_line(err)
    doc = json.loads(out)
    assert doc["exit_status"] == 7 and "nosuch" in doc["error"]
    assert "ObjectName" not in doc["error"]  # Sail's internal wording, said plainly
    code, _, err = _run(capsys, "sql", "SELECT * FROM job_run", "--warehouse", wh)  # a typo
    line = _one_error_line(err)
    assert code == 7 and "job_run" in line and "deltamq's tables: " in line and "job_runs" in line
    code, _, err = _run(capsys, "sql", "SELECT 1/0", "--warehouse", wh)  # fails when it runs
    assert code == 7 and "divide by zero" in _one_error_line(err).lower()
    code, _, err = _run(capsys, "sql", "DELETE FROM commit_log", "--warehouse", wh)  # deltamq's guard
    assert code == 2 and "--write" in _one_error_line(err)


def test_a_bug_is_one_line_unless_debugging(wh, capsys, monkeypatch):
    from deltamq import cli

    def broken(broker, args):
        raise KeyError("oops")

    monkeypatch.setitem(cli.COMMANDS, "status", broken)
    code, _, err = _run(capsys, "status", "--warehouse", wh)
    assert code == parser.INTERNAL == 70
    assert "internal error (a bug in deltamq): KeyError: 'oops'" in _one_error_line(err)
    monkeypatch.setenv("DELTAMQ_DEBUG", "1")
    with pytest.raises(KeyError):
        main(["status", "--warehouse", wh])


@pytest.mark.parametrize(
    ("raised", "status", "said"),
    [(KeyboardInterrupt(), 130, "deltamq: error: interrupted\n"), (BrokenPipeError(), 141, "")],
)
def test_ctrl_c_and_a_closed_stdout_end_without_a_traceback(wh, capsys, monkeypatch, raised, status, said):
    from deltamq import cli

    def stopped(broker, args):
        raise raised

    monkeypatch.setitem(cli.COMMANDS, "status", stopped)
    code, _, err = _run(capsys, "status", "--warehouse", wh)
    assert (code, err) == (status, said)


def test_the_console_script_prints_no_traceback(wh):
    out = subprocess.run(
        [sys.executable, "-m", "deltamq.cli", "send", "orders", "--file", "nosuch.jsonl", "--warehouse", wh],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 5, out.stderr
    assert out.stderr.strip() == "deltamq: error: cannot read nosuch.jsonl: No such file or directory"


# --- send --file: every bad line named ------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"topic": "orders", "body": "a"', "not JSON: Expecting ',' delimiter"),
        ('["orders", "a"]', "a line is a JSON object {topic, body, ...}, got an array"),
        ('{"topic": "orders"}', 'missing "body"'),
        ('{"body": "a"}', 'missing "topic"'),
        ('{"topic": "orders", "body": "a", "tag": "x"}', 'unknown field "tag"'),
        ('{"topic": 5, "body": "a"}', '"topic" must be a string, got a number (5)'),
        ('{"topic": "orders", "body": "a", "tags": ["x"]}', '"tags" must be a string, got an array'),
        (
            '{"topic": "orders", "body": "a", "delay_level": "3"}',
            '"delay_level" must be an integer 0 (no delay) or 1..18 '
            '(a level above 18 is clamped to 18), got "3"',
        ),
        ('{"topic": "orders", "body": "a", "delay_level": -2}', '"delay_level" must be an integer 0'),
        ('{"topic": "orders", "body": "a", "delay_ms": 1.5}', '"delay_ms" must be an integer >= 0'),
        ('{"topic": "orders", "body": "a", "deliver_at": "soon"}', '"deliver_at" must be epoch ms or an ISO'),
        (
            '{"topic": "orders", "body": "a", "delay_level": 2, "delay_ms": 5}',
            'give one of "delay_level", "delay_ms", "deliver_at"; got delay_level and delay_ms',
        ),
        (
            '{"topic": "orders", "body": "a", "properties": {"k": 1}}',
            '"properties" must be an object of string',
        ),
        ('{"topic": "nosuch", "body": "a"}', "topic 'nosuch' does not exist"),
        ('{"topic": "bad/name", "body": "a"}', "topic 'bad/name' is not allowed"),
    ],
)
def test_a_malformed_line_is_named_with_file_line_and_what_is_wrong(wh, tmp_path, capsys, line, says):
    path = tmp_path / "m.jsonl"
    good = json.dumps({"topic": "orders", "body": "ok"})
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    code, out, err = _run(capsys, "send", "--file", str(path), "--warehouse", wh)
    error = _one_error_line(err)
    assert code == parser.BAD_INPUT == 6 and out == ""
    assert error.startswith(f"deltamq: error: {path}:3: {says}"), error
    assert error.endswith("(nothing was sent)")
    assert _stored(capsys, wh) == 0


def test_a_file_that_is_not_utf8_is_malformed(wh, tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"topic": "orders", "body": "a"}\n{"topic": "orders", "body": "\xff"}\n')
    code, _, err = _run(capsys, "send", "--file", str(path), "--warehouse", wh)
    assert code == 6 and f"{path}:2: not UTF-8 text" in _one_error_line(err)


# --- send: SendResult, clamping, timers -----------------------------------------------------------
def test_send_prints_the_send_result_known_at_send_time(wh, capsys):
    code, out, err = _run(capsys, "send", "orders", "hello", "--queue-key", "k", "--warehouse", wh)
    assert code == 0 and err == ""
    header, rule, row = out.splitlines()
    assert header.split() == ["status", "msg", "id", "topic", "queue", "id", "queue", "offset"]
    status, msg_id, topic, queue, *offset = row.split()
    assert (status, topic, " ".join(offset)) == ("SEND_OK", "orders", "assigned at dispatch")
    assert len(msg_id) == 24 and queue in ("0", "1")
    code, out, _ = _run(capsys, "send", "orders", "hello", "--queue-key", "k", "--json", "--warehouse", wh)
    doc = json.loads(out)
    assert doc["status"] == "SEND_OK" and doc["topic"] == "orders" and doc["queue_id"] == int(queue)
    assert doc["queue_offset"] is None and doc["delay_level"] == 0 and doc["deliver_at"] is None


def test_a_delay_level_above_the_highest_is_clamped_with_a_notice(wh, tmp_path, capsys):
    code, out, err = _run(
        capsys, "send", "orders", "later", "--delay-level", "25", "--json", "--warehouse", wh
    )
    assert code == 0 and json.loads(out)["delay_level"] == 18
    assert err.strip() == (
        "deltamq: notice: delay level 25 is above the warehouse's highest level: clamped to 18 (2h), "
        "as RocketMQ does"
    )
    code, out, err = _run(capsys, "send", "orders", "later", "--delay-level", "3", "--warehouse", wh)
    assert code == 0 and err == "" and "delay level 3" in out
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(
            json.dumps({"topic": "orders", "body": str(i), "delay_level": 16 + i}) + "\n" for i in range(5)
        )
    )
    code, out, err = _run(capsys, "send", "--file", str(path), "--warehouse", wh)
    assert code == 0 and "sent 5 messages from" in out
    assert f"deltamq: notice: {path}: the delay level of 2 message(s) (line 4: 19, line 5: 20)" in err
    assert "clamped to 18 (2h)" in err


def test_send_takes_a_delay_in_ms_or_a_delivery_time(wh, tmp_path, capsys):
    code, out, _ = _run(capsys, "send", "orders", "t1", "--delay-ms", "60000", "--json", "--warehouse", wh)
    assert code == 0
    now = datetime.now(UTC).timestamp() * 1000
    assert abs(json.loads(out)["deliver_at"] - (now + 60_000)) < 30_000
    at = (datetime.now(UTC) + timedelta(days=1)).replace(microsecond=0)
    code, out, _ = _run(
        capsys, "send", "orders", "t2", "--deliver-at", at.strftime("%Y-%m-%dT%H:%M:%S"), "--warehouse", wh
    )
    assert code == 0 and f"timer, due {at.strftime('%Y-%m-%d %H:%M:%S')}.000" in out
    code, out, _ = _run(
        capsys, "send", "orders", "t3", "--deliver-at", str(int(at.timestamp() * 1000)), "--json", "-w", wh
    )
    assert json.loads(out)["deliver_at"] == int(at.timestamp() * 1000)
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps({"body": "t4", "delay_ms": 5000})
        + "\n"
        + json.dumps({"body": "t5", "deliver_at": at.isoformat()})
    )
    code, out, _ = _run(capsys, "send", "orders", "--file", str(path), "--json", "--warehouse", wh)
    assert code == 0 and json.loads(out)["sent"] == 2
    code, out, _ = _run(
        capsys,
        "sql",
        "SELECT body, properties['TIMER_DELIVER_MS'] AS due FROM commit_log ORDER BY body",
        "--json",
        "--warehouse",
        wh,
    )
    due = {body: int(d) for body, d in json.loads(out)["rows"]}
    assert set(due) == {"t1", "t2", "t3", "t4", "t5"}
    assert due["t2"] == due["t3"] == due["t5"] == int(at.timestamp() * 1000)
    code, _, err = _run(
        capsys, "send", "orders", "x", "--deliver-at", "2099-01-01T00:00:00", "--warehouse", wh
    )
    assert code == 2 and "timer due at 2099-01-01 00:00:00.000 is" in _one_error_line(err)


# --- help -----------------------------------------------------------------------------------------
def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@pytest.mark.unit
def test_every_option_of_every_command_has_help():
    missing = []
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


@pytest.mark.unit
def test_the_top_level_help_lists_the_list_actions_and_the_json_option():
    helptext = build_parser().format_help()
    for action in ("topic list", "group list", "dlq list"):
        assert action in helptext
    assert "--json" in helptext
    assert "--json" in _subparsers(build_parser())["status"].format_help()


# --- --json on every command ----------------------------------------------------------------------
def test_every_command_prints_one_json_document_with_json(tmp_path, capsys):
    wh = str(tmp_path / "wh")
    commands = [
        ("init",),
        ("topic", "create", "orders", "--queues", "1"),
        ("topic", "list"),
        ("group", "create", "puller"),
        (
            "group",
            "create",
            "replayer",
            "--consume-from",
            "TIMESTAMP",
            "--consume-timestamp",
            "2026-01-01T00:00",
        ),
        ("group", "list"),
        ("subscribe", "puller", "orders"),
        ("send", "orders", "hello", "--keys", "k-1"),
        ("tick",),
        ("job", "dispatch"),
        ("sql", "SELECT topic, queue_offset FROM consume_queue"),
        ("status",),
        ("msg", "show", "--key", "k-1"),
        ("dlq", "list"),
        ("dlq", "resend", "--group", "puller"),
        ("offsets", "reset", "--group", "puller", "--to-time", "0"),
        ("doctor",),
        ("report", "--html", str(tmp_path / "r.html")),
        ("rebuild-index",),
        ("group", "delete", "puller", "--force"),
    ]
    docs = {}
    for command in commands:
        code, out, err = _run(capsys, *command, "--json", "--warehouse", wh)
        assert code == 0, (command, err)
        docs[command[:2]] = json.loads(out)  # exactly one document
    assert docs[("init",)]["created"] and docs[("topic", "list")]["topics"][0]["topic"] == "orders"
    assert [g["consume_from"] for g in docs[("group", "list")]["groups"]] == ["LAST_OFFSET", "TIMESTAMP"]
    assert docs[("send", "orders")]["status"] == "SEND_OK"
    assert [j["job"] for j in docs[("tick",)]["jobs"]][0] == "dispatch"
    assert docs[("sql", "SELECT topic, queue_offset FROM consume_queue")]["rows"] == [["orders", 0]]
    assert docs[("msg", "show")]["messages"][0]["events"][0]["event"] == "sent"
    assert docs[("offsets", "reset")]["offsets"] == [{"topic": "orders", "queue_id": 0, "next_offset": 0}]
    assert docs[("doctor",)] == {"damaged": []}


# --- readable times, and who holds a lease --------------------------------------------------------
def test_a_lease_held_by_this_process_says_so_with_a_readable_time(broker, clock, capsys):
    broker.create_topic("orders", queues=1)
    broker.tick(clock.now_ms())  # this broker holds the job leases
    wh = str(broker.warehouse.location)
    code, out, err = _run(capsys, "tick", "--warehouse", wh)
    assert code == parser.SKIPPED == 3 and out == ""
    assert re.search(
        rf"^skipped: job 'dispatch' is held by {re.escape(socket.gethostname())}:{os.getpid()}:\w+ "
        r"\(this process\) until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC \(epoch 1\)",
        err,
    ), err
    code, out, _ = _run(capsys, "job", "dispatch", "--json", "--warehouse", wh)
    assert code == 3 and json.loads(out)["exit_status"] == 3 and "this process" in json.loads(out)["skipped"]


def test_a_lease_held_by_a_process_that_has_exited_says_so(broker, capsys):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(gone.stdout)
    host = socket.gethostname()
    Leases(broker.warehouse, holder=f"{host}:{pid}:0badf00d").acquire(
        ["dispatch"], LeaseTerms.of(broker.config)
    )
    broker.close()
    code, _, err = _run(capsys, "job", "dispatch", "--warehouse", str(broker.warehouse.location))
    assert code == 3
    assert f"held by {host}:{pid}:0badf00d (process {pid} on this host has exited" in err
    assert describe_holder(f"elsewhere:{pid}:x") == f"elsewhere:{pid}:x"  # nothing to check there
    assert describe_holder("my-runner") == "my-runner"  # DELTAMQ_RUNNER_ID
    assert describe_holder(f"{host}:1:x") == f"{host}:1:x (process 1 on this host is running)"


# --- status -------------------------------------------------------------------------------------
def test_status_shows_every_group_and_folds_empty_delay_levels(broker, clock, capsys, env_listener_log):
    from deltamq import Message

    broker.create_topic("orders", queues=2)
    broker.create_group("puller")  # pull: subscribed before any message, no offset rows
    broker.subscribe("puller", "orders")
    broker.create_group("idle")  # not subscribed
    broker.create_group("pusher", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
    broker.subscribe("pusher", "orders")
    p = broker.producer("shop")
    p.send_batch([Message("orders", str(i)) for i in range(3)], queue_keys=["a", "b", "c"])
    p.send(Message("orders", "later", delay_level=3))
    broker.tick(clock.now_ms())
    broker.close()
    wh = str(broker.warehouse.location)
    code, out, _ = _run(capsys, "status", "--json", "--warehouse", wh)
    st = json.loads(out)
    groups = {g["group"]: g for g in st["groups"]}
    assert set(groups) == {"idle", "puller", "pusher"}
    assert groups["puller"]["lag"] == 3 and groups["puller"]["kind"] == "pull (no client yet)"
    assert groups["pusher"]["lag"] == 0 and groups["pusher"]["kind"] == "push"
    assert groups["idle"] == {**groups["idle"], "topics": [], "lag": 0}
    heads = {(q["topic"], q["queue_id"]): q["max_offset"] for q in st["queues"] if q["topic"] == "orders"}
    lag = {(x["topic"], x["queue_id"]): x for x in st["lag"] if x["group"] == "puller"}
    assert {k: x["lag"] for k, x in lag.items()} == heads and all(
        x["next_offset"] is None for x in lag.values()
    )
    code, out, _ = _run(capsys, "status", "--warehouse", wh)
    assert code == 0
    assert re.search(r"^puller +pull \(no client yet\) +CLUSTERING +orders +3 ", out, re.M)
    assert re.search(r"^idle +pull \(no client yet\) +CLUSTERING +- \(not subscribed\) +0 ", out, re.M)
    levels = out[out.index("delay levels") : out.index("timers pending")]
    assert re.search(r"^3 +10s +0 +1 ", levels, re.M)
    assert "(17 of 18 levels have nothing pending: not shown)" in levels
    assert not re.search(r"^1 +1s ", levels, re.M)


def test_the_readme_shows_send_as_it_prints(wh, capsys):
    """The README's SendResult table and clamping notice are what `send` prints."""
    import io

    from deltamq.cli.format import print_table

    section = _readme_section("## Command line")
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    header, _, row = block.splitlines()
    columns = re.split(r"  +", header)
    cells = re.split(r"  +", row)
    shown = io.StringIO()
    print_table(columns, [cells], out=shown)
    assert shown.getvalue() == block
    code, out, err = _run(capsys, "send", "orders", "x", "--delay-level", "25", "--warehouse", wh)
    printed_header, _, printed_row = out.splitlines()
    assert re.split(r"  +", printed_header) == [*columns, "held"]
    assert re.split(r"  +", printed_row)[4] == cells[4] == "assigned at dispatch"
    notice = re.search(r"`(deltamq: notice: .*?)`", section, re.S).group(1)
    assert err.strip() == " ".join(notice.split())


def _readme_section(title: str) -> str:
    text = README.read_text()
    section = text[text.index(title) :]
    return section[: section.index("\n## ", 1)]


def test_a_broadcasting_push_group_can_be_created_from_the_command_line(tmp_path, capsys):
    wh = str(tmp_path / "wh")
    assert main(["init", "--warehouse", wh]) == 0
    code = main(
        [
            "group",
            "create",
            "fanout",
            "--mode",
            "BROADCASTING",
            "--listener",
            "support.listeners:env_recorder",
            "--instances",
            "web-1, web-2",
            "--warehouse",
            wh,
            "--json",
        ]
    )
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["group", "list", "--warehouse", wh, "--json"]) == 0
    from deltamq import Broker

    with Broker.open(wh) as b:
        assert b.groups()["fanout"].instances == ("web-1", "web-2")


def test_a_time_no_datetime_holds_is_refused_and_nothing_is_recorded(wh, capsys):
    """A ``--now`` (or any time option) past 9999-12-31 was recorded as the warehouse's last
    tick, and every later tick then crashed formatting it (exit 70 for good)."""
    from deltamq.clock import MAX_MS, ms_to_iso

    huge = str(MAX_MS + 1)
    for args in (
        ("tick", "--now", huge),
        ("send", "orders", "x", "--deliver-at", huge),
        ("dlq", "list", "--from", huge),
    ):
        code, out, err = _run(capsys, *args, "--warehouse", wh)
        line = _one_error_line(err)
        assert code == parser.USAGE and huge in line and "9999-12-31" in line, args
    code, out, _ = _run(capsys, "tick", "--warehouse", wh)  # the wall clock: nothing was recorded
    assert code == 0 and out.startswith("tick ")
    assert ms_to_iso(MAX_MS) == "9999-12-31 23:59:59.999" and ms_to_iso(10**17) == f"{10**17} ms"


def test_numbers_out_of_range_are_refused_and_a_cut_listing_says_so(wh, capsys):
    """A negative --interval busy-looped, --limit 0 or -1 reached the engine, dlq resend
    ignored --limit, and sql cut its rows at --limit silently."""
    for args, text in (
        (
            ("tick", "--loop", "--interval", "-1", "--for", "1"),
            "argument --interval: -1 is not a number above 0",
        ),
        (("tick", "--loop", "--for", "-2"), "argument --for: -2 is not a number above 0"),
        (("tick", "--loop", "--interval", "inf"), "argument --interval: inf is not a number above 0"),
        (("sql", "SELECT 1", "--limit", "0"), "argument --limit: 0 is below 1"),
        (("dlq", "list", "--rate", "0"), "argument --rate: 0 is not a number above 0"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*args, "--warehouse", wh])
        assert e.value.code == 2 and text in capsys.readouterr().err, args
    code, _, err = _run(capsys, "dlq", "resend", "--limit", "1", "--warehouse", wh)
    assert code == 2 and "--limit is for dlq list" in _one_error_line(err)
    code, out, err = _run(
        capsys, "sql", "SELECT id FROM range(5)", "--limit", "3", "--json", "--warehouse", wh
    )
    doc = json.loads(out)
    assert code == 0 and len(doc["rows"]) == 3 and doc["more_rows"] is True
    assert "the first 3 rows; --limit N shows more" in err
    code, out, err = _run(
        capsys, "sql", "SELECT id FROM range(3)", "--limit", "3", "--json", "--warehouse", wh
    )
    assert json.loads(out)["more_rows"] is False and err == ""


def test_group_options_that_would_be_ignored_are_refused(wh, capsys):
    """--consume-timestamp without --consume-from TIMESTAMP made a LAST_OFFSET group, and
    --instances on a CLUSTERING group were dropped, both silently."""
    for args, text in (
        (("--consume-timestamp", "2026-01-01T00:00:00"), "consume_from='TIMESTAMP' only"),
        (("--instances", "a,b"), "are for BROADCASTING groups"),
    ):
        code, _, err = _run(capsys, "group", "create", "g", *args, "--warehouse", wh)
        assert code == parser.USAGE and text in _one_error_line(err), args
    code, out, _ = _run(capsys, "group", "list", "--json", "--warehouse", wh)
    assert code == 0 and '"g"' not in out


def test_commands_that_would_do_nothing_say_so(wh, capsys):
    """``topic update`` with nothing to change printed "topic updated", ``topic list X``
    ignored X, and ``report`` over an empty window wrote an empty report."""
    for args, text in (
        (("topic", "update", "orders"), "topic update needs what to change"),
        (("topic", "list", "orders"), "topic list takes no topic name"),
        (("tick", "--interval", "5", "--for", "2"), "--interval, --for only shape a tick loop: add --loop"),
        (("tick", "--no-wake"), "--no-wake only shape a tick loop"),
        (
            ("report", "--html", "r.html", "--from", "2030-01-01T00:00:00", "--to", "2020-01-01T00:00:00"),
            "is not before --to",
        ),
    ):
        code, out, err = _run(capsys, *args, "--warehouse", wh)
        assert code == parser.USAGE and out == "" and text in _one_error_line(err), args


def test_a_usage_error_is_one_line_and_with_json_also_the_document(wh, capsys):
    """argparse's own errors printed the usage over several lines, and no JSON document
    with --json, unlike every other error (README, "Command line")."""
    with pytest.raises(SystemExit) as e:
        main(["topic", "create", "t2", "--queues", "abc", "--json", "--warehouse", wh])
    out, err = capsys.readouterr()
    line = _one_error_line(err)
    assert e.value.code == parser.USAGE and "argument --queues: invalid int value: 'abc'" in line
    assert "(see deltamq topic --help)" in line
    assert json.loads(out) == {"error": line.removeprefix("deltamq: error: "), "exit_status": 2}
    with pytest.raises(SystemExit):  # argparse takes --jso for --json
        main(["topic", "create", "t2", "--queues", "abc", "--jso", "--warehouse", wh])
    assert json.loads(capsys.readouterr().out)["exit_status"] == 2


def test_a_job_that_is_not_due_says_why_on_its_line(broker, clock, capsys):
    broker.create_topic("orders", queues=1)
    wh = str(broker.warehouse.location)
    broker.close()
    code, out, _ = _run(capsys, "job", "retain", "--warehouse", wh, "--now", str(clock.now_ms()))
    assert code == 0 and "retain: skipped (not due: a retention pass runs every retain_interval_ms)" in out
    code, out, _ = _run(capsys, "job", "retain", "--warehouse", wh, "--now", str(clock.now_ms()))
    assert code == 0 and "retain: skipped (not due" in out, out
    code, out, _ = _run(capsys, "job", "dispatch", "--warehouse", wh, "--now", str(clock.now_ms()))
    assert code == 0 and "dispatch: nothing to do; redispatch: skipped (" in out, out
    assert out.startswith("job "), out  # one job's run, not a tick's line
    code, out, _ = _run(capsys, "tick", "--warehouse", wh, "--now", str(clock.now_ms() + 1))
    assert code == 0 and "skipped (" not in out, out  # a tick's line stays one short line


def test_a_write_by_a_view_name_says_to_name_the_table_by_path(wh, capsys):
    """The plain names are views re-registered per query: ``sql --write`` of ``UPDATE
    offsets`` failed with the engine's own words only; it now says how to name the table."""
    code, _, err = _run(
        capsys, "sql", "--write", "DELETE FROM offsets WHERE queue_id = 99", "--warehouse", wh
    )
    assert code != 0 and "name a table to change as delta.`<path>`" in _one_error_line(err), err
    table = f"{wh}/offsets"
    code, _, err = _run(
        capsys, "sql", "--write", f"DELETE FROM delta.`{table}` WHERE queue_id = 99", "--warehouse", wh
    )
    assert code == 0, err


def test_json_output_is_json_whatever_the_numbers(broker, capsys):
    """NaN and infinities were printed as the bare words NaN and Infinity: no JSON value,
    refused by strict parsers. They come out as their names, strings."""
    wh = str(broker.warehouse.location)
    assert main(["sql", "SELECT double('NaN') AS x, double('inf') AS y", "--json", "--warehouse", wh]) == 0
    doc = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert doc["rows"] == [["NaN", "Infinity"]]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["group", "list", "billing"], "group list takes no group name"),
        (["group", "delete", "billing", "--orderly"], "group delete takes no --orderly"),
        (["topic", "delete", "orders", "--queues", "9"], "topic delete takes no --queues"),
        (["dlq", "list", "--rate", "5"], "dlq list takes no --rate"),
        (["msg", "show", "0A", "--key", "k"], "msg show ID takes no --key"),
        (["msg", "show", "0A", "--from", "2026-01-01"], "msg show ID takes no --from"),
        (["send", "orders", "x", "--batch-size", "0"], "send TOPIC BODY takes no --batch-size"),
    ],
)
def test_an_option_the_command_does_not_use_is_refused(broker, capsys, argv, named):
    """These were accepted and ignored (exit 0): the user believed they took effect."""
    broker.create_topic("orders", queues=1)
    broker.create_group("billing")
    assert main([*argv, "--warehouse", str(broker.warehouse.location)]) == 2
    assert named in capsys.readouterr().err
    assert "orders" in broker.topics() and "billing" in broker.groups()
