"""``deltamq report --html FILE``: the operator's page, one self-contained HTML file.

It shows, over the window asked (``--from``/``--to``) and now: the consumer groups (lag
per queue now, the age of the oldest message each has not consumed, lag over time),
throughput (messages in per topic, deliver's outcomes per tick), retries and dead
letters (per tick, the latest dead letters with their reason and the command that
traces each), the transactions pending, and each job's duration per tick. The data come
from ``deltamq/report_data.py``.

Charts are drawn by Plotly (plotly.js, embedded inline: the page opens offline, no CDN),
with time axes in UTC. The data are embedded as JSON (``<script type="application/json"
id="deltamq-data">``) for anyone who wants to re-plot them; once the charts are drawn,
the page writes what each rendered (traces, points, axes) into ``<pre
id="deltamq-rendered">``, which the browser test reads.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

from deltamq.report_data import STEPS, collect

if TYPE_CHECKING:
    from deltamq.context import Context

__all__ = ["collect", "render", "write_html"]

_TIME_AXIS = "time (UTC)"
_DELIVER_LINES = {
    "consumed": "consumed",
    "filtered": "filtered out",
    "deduplicated": "deduplicated",
    "sunk": "merged into sinks",
}
_FAILURE_LINES = {
    "retried": "sent back for retry",
    "dead_lettered": "dead-lettered",
    "listener_errors": "listener errors",
    "expired": "pull deliveries expired",
}


# --- formatting -------------------------------------------------------------------------------
def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def duration(ms: int | None) -> str:
    """``ms`` for a person: 850 ms, 12.5 s, 4 min 10 s, 3 h 5 min, 2 d 4 h."""
    if ms is None:
        return "–"
    if ms < 1_000:
        return f"{ms} ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f} s" if ms % 1000 else f"{int(s)} s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m} min {s} s" if s else f"{m} min"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"


def _flag(n: int) -> str:
    """A count, in red when not zero."""
    return f'<span class="bad">{n}</span>' if n else str(n)


def _table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    """An HTML table; the cells are HTML already (escaped by the caller)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


# --- charts -----------------------------------------------------------------------------------
def _layout(title: str, ytitle: str, *, xtitle: str = _TIME_AXIS, dates: bool = True, **extra: Any) -> Any:
    from plotly import graph_objects as go

    return go.Layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        template="plotly_white",
        height=330,
        margin={"l": 70, "r": 20, "t": 84, "b": 60},
        font={"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 12},
        xaxis={
            "title": {"text": xtitle},
            "type": "date" if dates else "category",
            "hoverformat": "%Y-%m-%d %H:%M:%S" if dates else None,
            "showline": True,
            "linecolor": "#999",
            "automargin": True,
        },
        yaxis={
            "title": {"text": ytitle},
            "rangemode": "tozero",
            "showline": True,
            "linecolor": "#999",
            "automargin": True,
        },
        legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 1.0, "yanchor": "bottom"},
        hovermode="x unified" if dates else "closest",
        **extra,
    )


def _charts(data: dict[str, Any]) -> dict[str, Any]:
    """The figures with data to draw, by id (a chart without data is left out).

    The time charts are drawn only when ticks were recorded; the charts of counts get
    whole-number y ticks.
    """
    ticks = data["now_ts"]
    charts: dict[str, Any] = {
        "lag-now": _lag_now_chart(data),
        "oldest-age": _oldest_age_chart(data),
        "lag-over-time": _lag_over_time_chart(data) if ticks else None,
        "throughput-in": _throughput_in_chart(data),
        "throughput-out": _throughput_out_chart(data) if ticks else None,
        "retries": _retries_chart(data) if ticks else None,
        "durations": _durations_chart(data) if ticks else None,
    }
    out = {key: fig for key, fig in charts.items() if fig is not None}
    for key in ("lag-now", "lag-over-time", "throughput-in", "throughput-out", "retries"):
        if key in out:
            _whole_numbers(out[key])
    return out


def _line_mode(ticks: list[int]) -> str:
    """Markers on the lines while the points are few enough to tell apart."""
    return "lines+markers" if len(ticks) <= 150 else "lines"


def _lag_now_chart(data: dict[str, Any]) -> Any | None:
    """Lag per queue now, one bar per consumer group; only the lagging queues if any lag."""
    from plotly import graph_objects as go

    if not data["lag"]:
        return None
    lagging = [x for x in data["lag"] if x["lag"] > 0]
    rows = lagging or data["lag"]
    fig = go.Figure(layout=_layout("Lag per queue, now", "messages behind", xtitle="queue", dates=False))
    for name in dict.fromkeys(_who(x) for x in rows):
        mine = [x for x in rows if _who(x) == name]
        fig.add_bar(
            name=name,
            x=[f"{x['topic']} · q{x['queue_id']}" for x in mine],
            y=[x["lag"] for x in mine],
            hovertemplate="%{x}: %{y} behind<extra>" + html.escape(name) + "</extra>",
        )
    fig.update_layout(barmode="group", showlegend=True)
    return fig


def _oldest_age_chart(data: dict[str, Any]) -> Any | None:
    """The age of the oldest message each consumer group has not consumed, now."""
    from plotly import graph_objects as go

    aged = [g for g in data["groups"] if g["oldest_age_ms"] is not None]
    if not aged:
        return None
    fig = go.Figure(
        layout=_layout(
            "Age of the oldest message not yet consumed, now",
            "age (seconds)",
            xtitle="consumer group",
            dates=False,
            showlegend=False,
        )
    )
    fig.add_bar(
        x=[g["group"] for g in aged],
        y=[g["oldest_age_ms"] / 1000 for g in aged],
        text=[duration(g["oldest_age_ms"]) for g in aged],
        textposition="auto",
        marker_color="#d62728",
        hovertemplate="%{x}: %{text}<extra>oldest pending</extra>",
    )
    return fig


def _lag_over_time_chart(data: dict[str, Any]) -> Any:
    """Each push group's backlog when a deliver pass began, and all push groups' together."""
    from plotly import graph_objects as go

    ticks, series = data["now_ts"], data["series"]
    marked = _line_mode(ticks)
    fig = go.Figure(
        layout=_layout(
            "Lag over time: each push group's backlog when a deliver pass began", "messages behind"
        )
    )
    groups = data.get("backlog_by_group", {})
    if len(groups) != 1:  # drawn first, so each group's line stays on top of it
        fig.add_scatter(
            x=ticks,
            y=series["backlog"],
            name="all push groups",
            mode="lines",
            line={"dash": "dot", "color": "#bbbbbb", "width": 1.5},
        )
    for group, values in groups.items():
        fig.add_scatter(x=ticks, y=values, name=group, mode=marked, connectgaps=False, line={"width": 2.5})
    return fig


def _throughput_in_chart(data: dict[str, Any]) -> Any | None:
    """Messages in per user topic, stacked bars per arrival bucket (by store time)."""
    from plotly import graph_objects as go

    arrivals = data["arrivals"]
    user_topics = [t["topic"] for t in data["topics"] if t["topic"] in arrivals["topics"]]
    if not user_topics:
        return None
    width = arrivals["bucket_ms"]
    fig = go.Figure(
        layout=_layout(
            f"Messages in per topic (per {duration(width)}, by store time)",
            f"messages per {duration(width)}",
            barmode="stack",
        )
    )
    for t in user_topics:
        fig.add_bar(
            name=t,
            x=arrivals["start_ts"],
            y=arrivals["topics"][t],
            xperiod=width,
            xperiodalignment="start",
        )
    return fig


def _throughput_out_chart(data: dict[str, Any]) -> Any:
    """Messages out per tick: indexed by dispatch, and deliver's outcomes (the empty ones left out)."""
    from plotly import graph_objects as go

    ticks, series = data["now_ts"], data["series"]
    marked = _line_mode(ticks)
    fig = go.Figure(layout=_layout("Messages out per tick (deliver and sinks)", "messages per tick"))
    fig.add_scatter(x=ticks, y=series["indexed"], name="indexed (dispatch)", mode="lines", line_dash="dot")
    for key, label in _DELIVER_LINES.items():
        if key in ("consumed", "filtered") or any(series[key]):
            fig.add_scatter(x=ticks, y=series[key], name=label, mode=marked)
    return fig


def _retries_chart(data: dict[str, Any]) -> Any:
    """Retries, dead letters and listener errors per tick (expiries only when there were some)."""
    from plotly import graph_objects as go

    ticks, series = data["now_ts"], data["series"]
    fig = go.Figure(layout=_layout("Retries and dead letters per tick", "messages per tick"))
    colours = {"retried": "#ff7f0e", "dead_lettered": "#d62728", "listener_errors": "#9467bd"}
    # listener errors are bars behind the lines: a failure usually is a retry too, and
    # equal lines would hide each other
    fig.add_bar(
        x=ticks,
        y=series["listener_errors"],
        name=_FAILURE_LINES["listener_errors"],
        marker={"color": colours["listener_errors"], "opacity": 0.35},
    )
    dashes = {"retried": "solid", "dead_lettered": "dash", "expired": "dot"}
    for key, label in _FAILURE_LINES.items():
        if key != "listener_errors" and (key != "expired" or any(series[key])):
            fig.add_scatter(
                x=ticks,
                y=series[key],
                name=label,
                mode="lines+markers",
                line={"color": colours.get(key, "#8c564b"), "dash": dashes.get(key, "solid"), "width": 2.5},
            )
    return fig


def _durations_chart(data: dict[str, Any]) -> Any:
    """Each job's duration per tick, stacked, in the order of the jobs' steps."""
    from plotly import graph_objects as go

    ticks = data["now_ts"]
    fig = go.Figure(layout=_layout("Job durations per tick", "duration (ms), stacked"))
    for step in STEPS:
        if step in data["durations_ms"]:
            fig.add_scatter(
                x=ticks,
                y=[v or 0 for v in data["durations_ms"][step]],
                name=step,
                mode="lines",
                stackgroup="jobs",
                line={"width": 0.5},
            )
    return fig


def _whole_numbers(fig: Any) -> None:
    """Counts: no tick at 0.5 on a short y axis."""
    columns = [list(t.y or ()) for t in fig.data]
    if fig.layout.barmode == "stack":
        top = max((sum(v or 0 for v in col) for col in zip(*columns, strict=False)), default=0)
    else:
        top = max((v or 0 for col in columns for v in col), default=0)
    if top <= 5:
        fig.update_yaxes(dtick=1)


def _who(x: dict[str, Any]) -> str:
    return x["group"] + (f"/{x['client']}" if x["client"] else "")


# --- the page ---------------------------------------------------------------------------------
def _when(iso: str | None) -> str:
    """A time as the page shows it: without milliseconds when they are zero."""
    return "" if iso is None else iso.removesuffix(".000")


def _ago(ms: int) -> str:
    return "just now" if ms < 1000 else f"{duration(ms)} ago"


def _cards(data: dict[str, Any]) -> str:
    last = data["last_tick"]
    lag = sum(g["lag"] for g in data["groups"])
    ages = [g["oldest_age_ms"] for g in data["groups"] if g["oldest_age_ms"] is not None]
    dead = sum(g["dead_letters_in_window"] for g in data["groups"])
    pending = sum(t["pending"] for t in data["transactions"])
    failed = sum(data["series"]["failed"])
    cards = [
        (
            "last tick",
            data["ticks"][-1][11:19] if last else "none",
            f"{data['ticks'][-1][:10]}, {_ago(data['now'] - last)}" if last else "",
        ),
        ("ticks", str(len(data["ticks"])), "in this window"),
        ("lag now", str(lag), "messages behind, all groups"),
        ("oldest pending", duration(max(ages)) if ages else "–", "age of the oldest unconsumed message"),
        ("dead letters", str(dead), "in this window"),
        ("transactions pending", str(pending), "half messages not settled"),
        ("failed job runs", str(failed), "in this window"),
    ]
    alert = {
        "oldest pending": bool(ages),
        "dead letters": dead > 0,
        "failed job runs": failed > 0,
        "transactions pending": pending > 0,
    }
    return "".join(
        f'<div class="card{" alert" if alert.get(k) else ""}"><div class="k">{_e(k)}</div>'
        f'<div class="v">{_e(v)}</div><div class="s">{_e(s)}</div></div>'
        for k, v, s in cards
    )


def _groups_table(data: dict[str, Any]) -> str:
    if not data["groups"]:
        return '<p class="empty">No consumer groups.</p>'
    rows = [
        [
            f"<b>{_e(g['group'])}</b>",
            _e(g["kind"]),
            _e(g["mode"]),
            _e(", ".join(g["topics"])),
            _flag(g["lag"]),
            _e(duration(g["oldest_age_ms"])),
            str(g["queues_behind"]),
            str(g["suspended"]),
            str(g["retries_in_window"]),
            _flag(g["dead_letters_in_window"]),
            str(g["dead_letters"]),
        ]
        for g in data["groups"]
    ]
    return _table(
        [
            "group",
            "kind",
            "model",
            "subscribed to",
            "lag now",
            "oldest pending",
            "queues behind",
            "queues suspended",
            "retries due (window)",
            "dead letters (window)",
            "dead letters (all)",
        ],
        rows,
        "num",
    )


def _lag_table(data: dict[str, Any]) -> str:
    behind = [x for x in data["lag"] if x["lag"] > 0]
    if not behind:
        return '<p class="empty">Every group is at the head of every queue.</p>'
    rows = [
        [
            _e(_who(x)),
            _e(x["topic"]),
            str(x["queue_id"]),
            str(x["next_offset"]),
            str(x["head"]),
            f'<span class="bad">{x["lag"]}</span>',
            _e(duration(x["oldest_age_ms"])),
            "suspended" if x["suspended"] else "",
        ]
        for x in sorted(behind, key=lambda x: -x["lag"])[:50]
    ]
    more = f'<p class="note">and {len(behind) - 50} more queues behind</p>' if len(behind) > 50 else ""
    headers = ["group", "topic", "queue", "offset", "head", "lag", "oldest pending", ""]
    return "<details><summary>Queues behind</summary>" + _table(headers, rows, "num") + more + "</details>"


def _topics_table(data: dict[str, Any]) -> str:
    if not data["topics"]:
        return '<p class="empty">No topics.</p>'
    rows = [
        [
            f"<b>{_e(t['topic'])}</b>",
            str(t["queues"]),
            _e(t["perm"]),
            "yes" if t["ordered"] else "",
            str(t["indexed"]),
            str(t["in_window"]),
        ]
        for t in data["topics"]
    ]
    return _table(
        ["topic", "queues", "perm", "ordered", "messages indexed (all)", "in this window"], rows, "num"
    )


def _dead_letters_table(data: dict[str, Any]) -> str:
    letters = data["dead_letters"]
    if not letters:
        return '<p class="empty">No dead letters in this window.</p>'
    rows = [
        [
            f'<span class="nw">{_e(_when(d["time"]))}</span>',
            f"<b>{_e(d['group'])}</b>",
            _e(d["topic"]),
            f'<span class="bad">{_e(d["reason"])}</span>',
            str(d["reconsume_times"]),
            f'<span class="nw">{_e(d["keys"])}</span>',
            f'<span class="err" title="{_e(d["last_error"])}">{_e((d["last_error"] or "")[:120])}</span>',
            f"<code>deltamq msg show {_e(d['msg_id'])}</code>",
            f'<span class="ok">resent as <code>{_e(d["resent_as"])}</code></span>'
            if d.get("resent_as")
            else '<span class="empty">not resent</span>',
        ]
        for d in letters
    ]
    return _table(
        ["stored", "group", "original topic", "reason", "retries", "keys", "last error", "trace", "resent"],
        rows,
    )


def _transactions_table(data: dict[str, Any]) -> str:
    pending = data["transactions"]
    if not pending:
        return '<p class="empty">No transaction pending.</p>'
    rows = [
        [
            f"<b>{_e(t['producer_group'])}</b>",
            _flag(t["pending"]),
            _e(duration(t["oldest_age_ms"])),
            _e(t["max_checks"] if t["max_checks"] is not None else "–"),
            str(t["discarded"]),
        ]
        for t in pending
    ]
    return _table(
        ["producer group", "pending", "oldest", "most checks", "discarded (check limit)"], rows, "num"
    )


def _errors_table(data: dict[str, Any]) -> str:
    if not data["errors"]:
        return ""
    rows = [
        [
            f'<span class="nw">{_e(_when(x["time"]))}</span>',
            _e(x["job"]),
            # a job that ran but whose listeners failed is OK as a job: say both
            _e(x["status"] if x["status"] != "OK" else "ran; its listeners failed"),
            f'<span class="err">{_e(x["error"][:300])}</span>',
        ]
        for x in data["errors"]
    ]
    return "<h3>Latest job runs with errors</h3>" + _table(["tick", "job", "outcome", "error"], rows)


def _chart_div(charts: dict[str, Any], key: str, empty: str) -> str:
    if key not in charts:
        return f'<div class="chart empty-chart"><p class="empty">{_e(empty)}</p></div>'
    return f'<div class="chart"><div id="chart-{key}" class="plot"></div></div>'


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f4f5f7;
 color:#1d2330}
header{background:#1d2330;color:#fff;padding:16px 28px}
header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c5cad3;font-size:13px}
main{padding:8px 28px 32px}
section{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.08);margin:16px 0;
 padding:12px 18px}
h2{font-size:17px;margin:4px 0 10px}
h3{font-size:14px;margin:14px 0 6px}
.cards{display:grid;grid-template-columns:repeat(7,1fr);gap:10px;margin-top:16px}
.card{background:#fff;border-radius:8px;padding:10px 14px;box-shadow:0 1px 3px rgba(0,0,0,.08);
 border-top:3px solid #2ca02c}
.card.alert{border-top-color:#d62728}
.card .k{font-size:12px;color:#5b6475;text-transform:uppercase;letter-spacing:.03em}
.card .v{font-size:24px;font-weight:600;margin:2px 0}
.card .s{font-size:11px;color:#7a8294}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.chart{min-width:0}
.empty-chart{display:flex;align-items:center;justify-content:center;min-height:120px;background:#fafbfc;
 border-radius:6px}
table{border-collapse:collapse;width:100%;font-size:13px;margin:6px 0}
th{text-align:left;font-weight:600;color:#5b6475;border-bottom:2px solid #e3e6eb;padding:5px 8px;
 vertical-align:bottom}
.nw{white-space:nowrap}
td{border-bottom:1px solid #eef0f3;padding:5px 8px;vertical-align:top}
table.num td{white-space:nowrap}
.bad{color:#c62828;font-weight:600}
.ok{color:#2e7d32}
.err{color:#6b3a3a;font-family:ui-monospace,Menlo,monospace;font-size:12px}
code{background:#f0f2f5;padding:1px 5px;border-radius:4px;font-size:12px;white-space:nowrap}
.empty{color:#7a8294;font-style:italic;margin:6px 0}
.note{color:#7a8294;font-size:12px}
details summary{cursor:pointer;color:#34508a;font-size:13px;margin:6px 0}
footer{color:#7a8294;font-size:12px;padding:0 28px 24px}
"""

# runs before plotly.js: errors anywhere on the page are counted into the summary
_CATCH = """
window.deltamqErrors = [];
window.addEventListener('error', function (e) { window.deltamqErrors.push(String(e.message || e)); });
window.addEventListener('unhandledrejection', function (e) { window.deltamqErrors.push(String(e.reason)); });
(function () {
  var orig = console.error;
  console.error = function () {
    window.deltamqErrors.push(Array.prototype.join.call(arguments, ' '));
    return orig.apply(console, arguments);
  };
})();
"""

_DRAW = """
(function () {
  var figures = JSON.parse(document.getElementById('deltamq-figures').textContent);
  var config = {displaylogo: false, responsive: true,
                modeBarButtonsToRemove: ['select2d', 'lasso2d', 'autoScale2d']};
  var drawn = Object.keys(figures).map(function (key) {
    var f = figures[key];
    return Plotly.newPlot('chart-' + key, f.data, f.layout, config).then(function (gd) {
      var text = function (sel) { var el = gd.querySelector(sel); return el ? el.textContent : null; };
      return {id: key, title: text('.gtitle'), traces: gd.data.length,
              points: gd.data.reduce(function (n, t) { return n + (t.y ? t.y.length : 0); }, 0),
              drawn_traces: gd.querySelectorAll('.trace').length,
              xticks: gd.querySelectorAll('.xtick').length, yticks: gd.querySelectorAll('.ytick').length,
              xtitle: text('.xtitle'), ytitle: text('.ytitle'),
              legend: gd.querySelectorAll('.legend .traces').length,
              first_xtick: text('.xtick')};
    });
  });
  Promise.all(drawn).then(function (charts) {
    var out = document.getElementById('deltamq-rendered');
    out.textContent = JSON.stringify({charts: charts, errors: window.deltamqErrors});
    document.body.setAttribute('data-rendered', 'yes');
  }, function (err) {
    window.deltamqErrors.push(String(err));
    var out = document.getElementById('deltamq-rendered');
    out.textContent = JSON.stringify({charts: [], errors: window.deltamqErrors});
    document.body.setAttribute('data-rendered', 'failed');
  });
})();
"""


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element."""
    return value.replace("</", "<\\/").replace("<!--", "<\\!--")


def render(data: dict[str, Any]) -> str:
    """The page for ``data`` (from :func:`deltamq.report_data.collect`)."""
    from plotly import io as pio
    from plotly.offline import get_plotlyjs

    charts = _charts(data)
    figures = (
        "{" + ",".join(f"{json.dumps(k)}:{pio.to_json(f, validate=False)}" for k, f in charts.items()) + "}"
    )
    window = data["window"]
    span = (
        f"{_when(window['from'])} → {_when(window['to'])} UTC"
        if window["from"]
        else "no ticks recorded in this window"
    )
    w = _e(data["warehouse"])
    trace_hint = (
        f"Run the trace commands with <code>-w {w}</code> (or <code>--warehouse</code>); "
        f"resend a group's dead letters: <code>deltamq dlq resend --group G -w {w}</code>."
    )
    body = f"""
<header><h1>deltamq — operator report</h1>
<p>warehouse <b>{_e(data["warehouse"])}</b> · window {_e(span)} · {len(data["ticks"])} ticks ·
generated at {_e(_when(data["now_iso"]))} UTC</p></header>
<main>
<div class="cards">{_cards(data)}</div>
<section id="groups"><h2>Consumer groups</h2>
{_groups_table(data)}
<div class="grid">{_chart_div(charts, "lag-now", "No group offsets yet.")}
{_chart_div(charts, "oldest-age", "Nothing pending: every group is at the head.")}</div>
{_lag_table(data)}
{_chart_div(charts, "lag-over-time", "No ticks in this window.")}
</section>
<section id="throughput"><h2>Throughput</h2>
<div class="grid">{_chart_div(charts, "throughput-in", "No messages in this window.")}
{_chart_div(charts, "throughput-out", "No ticks in this window.")}</div>
{_topics_table(data)}
</section>
<section id="failures"><h2>Retries and dead letters</h2>
{_chart_div(charts, "retries", "No ticks in this window.")}
<h3>Latest dead letters</h3>
{_dead_letters_table(data)}
<p class="note">{trace_hint}</p>
</section>
<section id="transactions"><h2>Transactions pending</h2>
{_transactions_table(data)}
</section>
<section id="jobs"><h2>Jobs</h2>
{_chart_div(charts, "durations", "No ticks in this window.")}
{_errors_table(data)}
</section>
</main>
<footer>Lag per group is exact now (offsets against the queue heads); over time, job_runs records
the push groups' backlog as one total per tick. Times are UTC. The data are embedded as JSON
(script#deltamq-data).</footer>
<pre id="deltamq-rendered" hidden></pre>
"""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>deltamq report — {_e(data["warehouse"])}</title>
<style>{_CSS}</style>
<script>{_CATCH}</script>
<script>{get_plotlyjs()}</script>
</head>
<body>
{body}
<script type="application/json" id="deltamq-data">{_script_json(json.dumps(data))}</script>
<script type="application/json" id="deltamq-figures">{_script_json(figures)}</script>
<script>{_DRAW}</script>
</body></html>
"""


def write_html(
    ctx: Context, path: str, *, since: int | None = None, until: int | None = None
) -> dict[str, Any]:
    """Collect the report's data for [since, until) and write the page to ``path``;
    returns the data (``ticks``, ``totals`` … see :func:`deltamq.report_data.collect`)."""
    data = collect(ctx, since=since, until=until)
    page = render(data)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return data
