"""``deltamq report``: the operator page's data, read from the warehouse, and the page itself
in a real headless browser (Chromium from the system's packages): no console errors, every
chart drawn with its axes and data, a screenshot written.

The warehouse is built once for the module: two topics, a group that keeps up, one whose
listener fails (retries, then dead letters), one that falls behind (``pull_batch_size``),
a transaction left pending, and several ticks ten seconds apart on a FakeClock."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.listeners import Recorder, read_log

from deltamq import Broker, FakeClock, Message, TxState
from deltamq.engine import SQL_RECORDERS
from deltamq.report import write_html
from deltamq.report_data import bucket_ms, collect

START = 1_767_225_600_000  # 2026-01-01 00:00:00 UTC
TICKS = 4
CHARTS = {"lag-now", "oldest-age", "lag-over-time", "throughput-in", "throughput-out", "retries", "durations"}


def _traffic(broker: Broker, clock: FakeClock, logs: Path, ticks: int = TICKS) -> dict[str, Any]:
    """Send and tick; returns the orders and payments sent per tick and when each payment
    body was sent (epoch ms)."""
    broker.create_topic("orders", queues=4)
    broker.create_topic("payments", queues=2)
    broker.create_group("billing", Recorder(logs / "billing.jsonl"), consume_from="FIRST_OFFSET")
    broker.subscribe("billing", "orders")
    broker.create_group(
        "shipping",
        Recorder(logs / "shipping.jsonl", "fail"),
        consume_from="FIRST_OFFSET",
        max_reconsume_times=1,
    )
    broker.subscribe("shipping", "orders", "express")
    broker.create_group(
        "ledger", Recorder(logs / "ledger.jsonl"), consume_from="FIRST_OFFSET", pull_batch_size=2
    )
    broker.subscribe("ledger", "payments")
    p = broker.producer("shop")
    p.send_in_transaction(Message("payments", b"unsettled"), lambda m, a: TxState.UNKNOWN)
    sent: dict[str, list[int]] = {"payments": [], "orders": []}
    payments_at: dict[str, int] = {}
    for i in range(ticks):
        orders = [
            Message("orders", f"o{i}-{j}".encode(), tags="express" if j == 0 else "normal", keys=f"o-{i}-{j}")
            for j in range(5 + i % 4)
        ]
        payments = [Message("payments", f"p{i}-{j}".encode()) for j in range(3 + 2 * (i % 3))]
        p.send_batch(orders)
        p.send_batch(payments)
        sent["orders"].append(len(orders))
        sent["payments"].append(len(payments))
        payments_at.update({m.body.decode(): clock.now_ms() for m in payments})
        clock.advance(seconds=10)
        broker.tick(clock.now_ms())
    return {"sent_orders": sent["orders"], "sent_payments": sent["payments"], "payments_at": payments_at}


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    """(broker, clock, what was sent, listener logs) of a warehouse with some traffic."""
    root = tmp_path_factory.mktemp("report")
    clock = FakeClock(START)
    broker = Broker.init(str(root / "wh"), clock=clock)
    sent = _traffic(broker, clock, root)
    yield broker, clock, sent, root
    broker.close()


def test_the_data_of_the_page(busy):
    broker, clock, sent, logs = busy
    data = collect(broker.context)
    now = clock.now_ms()
    assert data["now_ts"] == [START + 10_000 * (i + 1) for i in range(TICKS)]
    assert len(data["ticks"]) == TICKS and data["last_tick"] == now
    # flows are summed, a level (the backlog) is not
    assert "backlog" not in data["totals"] and len(data["series"]["backlog"]) == TICKS
    assert data["totals"]["consumed"] == sum(data["series"]["consumed"]) > 0
    assert data["totals"]["retried"] > 0 and data["totals"]["dead_lettered"] > 0
    # per topic arrivals: every message sent (the window starts one interval before the first tick)
    assert data["arrivals"]["bucket_ms"] == 10_000
    by_topic = {t["topic"]: t for t in data["topics"]}
    assert by_topic["orders"]["in_window"] == by_topic["orders"]["indexed"] == sum(sent["sent_orders"])
    assert sum(data["arrivals"]["topics"]["payments"]) == sum(sent["sent_payments"])
    # lag now: as `deltamq status` computes it
    status = {(x["group"], x["topic"], x["queue_id"]): x["lag"] for x in broker.status()["lag"]}
    assert {(x["group"], x["topic"], x["queue_id"]): x["lag"] for x in data["lag"]} == status
    groups = {g["group"]: g for g in data["groups"]}
    assert groups["billing"]["lag"] == 0 and groups["billing"]["oldest_age_ms"] is None
    ledger = groups["ledger"]
    assert ledger["lag"] == sum(n for (g, _, _), n in status.items() if g == "ledger") > 0
    # the oldest payment the ledger has not consumed, from what its listener saw
    seen = {c["body"] for c in read_log(logs / "ledger.jsonl")}
    oldest = min(t for body, t in sent["payments_at"].items() if body not in seen)
    assert ledger["oldest_age_ms"] == now - oldest
    shipping = groups["shipping"]
    assert shipping["dead_letters"] == shipping["dead_letters_in_window"] == len(data["dead_letters"]) > 0
    assert shipping["retries_in_window"] > 0 and shipping["kind"] == "push"
    # the latest dead letters, with their reason; each id is what `deltamq msg show` traces
    letter = data["dead_letters"][0]
    assert (
        letter["group"] == "shipping" and letter["topic"] == "orders" and letter["reason"] == "max_reconsume"
    )
    assert [d["store_ts"] for d in data["dead_letters"]] == sorted(
        (d["store_ts"] for d in data["dead_letters"]), reverse=True
    )
    assert any(e["event"].startswith("dead-lettered by shipping") for e in broker.trace(letter["msg_id"]))
    assert [(t["producer_group"], t["pending"]) for t in data["transactions"]] == [("shop", 1)]
    assert data["errors"] and all("group shipping" in e["error"] for e in data["errors"])
    assert set(data["durations_ms"]) >= {"dispatch", "deliver", "promote"}
    json.dumps(data)  # embeddable as it is


def test_the_window_bounds_what_is_read(busy):
    broker, clock, _, _ = busy
    since, until = START + 20_000, START + 40_000
    statements: list[str] = []
    SQL_RECORDERS.append(statements.append)
    try:
        data = collect(broker.context, since=since, until=until)
    finally:
        SQL_RECORDERS.remove(statements.append)
    assert data["now_ts"] == [START + 20_000, START + 30_000]
    runs = [s for s in statements if "job_runs" in s]
    assert runs and all(
        "run_date >= DATE'2026-01-01'" in s and "run_date <= DATE'2026-01-01'" in s for s in runs
    )
    (arrivals,) = [s for s in statements if "consume_queue" in s and "GROUP BY topic, k" in s]
    assert f"cl_batch_id >= CAST({since << 20} AS BIGINT)" in arrivals and "topic IN (" in arrivals
    assert sum(data["arrivals"]["totals"].get(t, 0) for t in ("orders", "payments")) == sum(
        t["in_window"] for t in data["topics"]
    )
    assert all(since <= d["store_ts"] < until for d in data["dead_letters"])


@pytest.mark.unit
def test_bucket_width_follows_the_window_and_the_tick_interval():
    assert bucket_ms(110_000, 10_000) == 10_000
    assert bucket_ms(86_400_000, 60_000) == 900_000  # a day of one-minute ticks: 15 min buckets
    assert bucket_ms(3_600_000) == 30_000


def test_an_empty_warehouse_gives_a_page_without_charts(broker, tmp_path):
    page = tmp_path / "r.html"
    data = write_html(broker.context, str(page))
    text = page.read_text(encoding="utf-8")
    assert data["ticks"] == [] and data["groups"] == []
    assert "No consumer groups." in text and "no ticks recorded in this window" in text
    figures = re.search(r'<script type="application/json" id="deltamq-figures">(.*?)</script>', text, re.S)
    assert figures is not None and json.loads(figures.group(1)) == {}
    embedded = re.search(r'<script type="application/json" id="deltamq-data">(.*?)</script>', text, re.S)
    assert embedded is not None and json.loads(embedded.group(1)) == data


# --- in a browser -----------------------------------------------------------------------------
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_page_in_headless_chromium(busy, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium on PATH (Debian: apt-get install chromium); the browser test needs one")
    broker, _, _, _ = busy
    first = broker.dead_letters(group="shipping").orderBy("store_ts").first()
    resent = broker.resend_dead_letters(msg_ids=[first["msg_id"]]).msg_ids[0]  # the last test on busy
    page, shot = tmp_path / "report.html", tmp_path / "report.png"
    data = write_html(broker.context, str(page))
    text = page.read_text(encoding="utf-8")
    figures = json.loads(
        html.unescape(re.search(r'id="deltamq-figures">(.*?)</script>', text, re.S).group(1))  # type: ignore[union-attr]
    )
    # no line hides under another: listener errors are bars behind the retry and dead-letter
    # lines; the all-groups backlog is drawn first, thin, under each group's line
    retries = [(t["type"], t["name"]) for t in figures["retries"]["data"]]
    assert retries[0] == ("bar", "listener errors") and {"sent back for retry", "dead-lettered"} <= {
        name for kind, name in retries[1:] if kind == "scatter"
    }
    dead = next(t for t in figures["retries"]["data"] if t["name"] == "dead-lettered")
    assert dead["line"]["dash"] == "dash"
    lag = [t["name"] for t in figures["lag-over-time"]["data"]]
    assert lag[0] == "all push groups" and set(lag[1:]) == {"billing", "shipping", "ledger"}
    # one self-contained file: plotly.js inline, nothing loaded from elsewhere
    assert "<script src" not in text and "<link" not in text and "Plotly.newPlot" in text
    run = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: any network request would fail
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=20000",
            "--window-size=1400,2400",
            f"--screenshot={shot}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # the page logs nothing to the console: any line there is an error or a warning
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], "\n".join(console)
    assert 'data-rendered="yes"' in run.stdout, "the charts did not finish drawing"
    found = re.search(r'<pre id="deltamq-rendered"[^>]*>(.*?)</pre>', run.stdout, re.S)
    assert found is not None
    rendered = json.loads(html.unescape(found.group(1)))
    assert rendered["errors"] == []
    charts = {c["id"]: c for c in rendered["charts"]}
    assert set(charts) == CHARTS
    for c in charts.values():
        what = f"chart {c['id']}: {c}"
        assert c["title"] and c["xtitle"] and c["ytitle"], what
        assert c["traces"] >= 1 and c["drawn_traces"] == c["traces"] and c["points"] > 0, what
        assert c["xticks"] >= 1 and c["yticks"] >= 2, what
    for key in CHARTS - {"lag-now", "oldest-age"}:  # time axes, with readable times
        assert charts[key]["xtitle"] == "time (UTC)"
        assert re.match(r"\d\d:\d\d(:\d\d)?", charts[key]["first_xtick"]), charts[key]
    assert charts["lag-now"]["first_xtick"].startswith("payments · q")
    assert charts["durations"]["traces"] == len(data["durations_ms"])
    # the dead-letter table marks the resent letter; a job that ran with failing listeners
    # is not shown as a bare OK beside its error
    assert f"resent as <code>{resent}</code>" in run.stdout and "not resent" in run.stdout
    assert "ran; its listeners failed" in run.stdout
    assert _png_size(shot) == (1400, 2400) and shot.stat().st_size > 50_000
    # DELTAMQ_REPORT_SCREENSHOT=PATH keeps a copy (docs/report.png is this test's page)
    if target := os.environ.get("DELTAMQ_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, target)
