"""``deltamq report --html FILE``: lag and throughput over time, from ``job_runs``.

One self-contained HTML page: inline SVG line charts (no scripts, no network, opens
anywhere) and the series they draw embedded as JSON (``<script type="application/json"
id="deltamq-data">``) for anyone who wants to re-plot them. Per tick: messages indexed
(dispatch + redispatch), consumed, sent back and dead-lettered (deliver), the push
groups' backlog when deliver began, and each job's duration.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from deltamq import ids
from deltamq.clock import ms_to_iso
from deltamq.tables.sqltext import sql_long

if TYPE_CHECKING:
    from deltamq.context import Context

SERIES = {
    "throughput": ("messages per tick", ["indexed", "consumed", "retried", "dead_lettered"]),
    "lag": ("backlog of push groups (messages)", ["backlog"]),
    "cost": ("job duration (ms)", ["dispatch_ms", "promote_ms", "deliver_ms", "check_transactions_ms"]),
}
_COLOURS = ["#1f77b4", "#2ca02c", "#ff7f0e", "#d62728"]


def collect(ctx: Context, *, since: int | None = None, until: int | None = None) -> dict[str, Any]:
    """Per tick (its ``now``), the values of every series; ``job_runs`` read by date
    partition when a range is given."""
    wh = ctx.warehouse
    where = ["1 = 1"]
    if since is not None:
        where.append(
            f"run_date >= date_from_unix_date({int(since) // ids.DAY_MS}) AND now_ts >= {sql_long(since)}"
        )
    if until is not None:
        where.append(f"now_ts < {sql_long(until)}")
    rows = ctx.engine.rows(
        f"SELECT now_ts, job, rows_out, start_ts, end_ts, details FROM {wh.ref('job_runs')} "
        f"WHERE {' AND '.join(where)} AND status <> 'SKIPPED' ORDER BY now_ts"
    )
    ticks: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        t, d = ticks[r["now_ts"]], dict(r["details"] or {})
        if r["job"] in ("dispatch", "redispatch"):
            t["indexed"] += r["rows_out"] or 0
        if r["job"] == "deliver":
            for k in ("consumed", "retried", "dead_lettered", "backlog"):
                t[k] += d.get(k, 0)
        job = "dispatch" if r["job"] == "redispatch" else r["job"]
        t[f"{job}_ms"] += max(0, (r["end_ts"] or 0) - (r["start_ts"] or 0))
    times = sorted(ticks)
    names = [n for _, (_, series) in SERIES.items() for n in series]
    return {
        "ticks": [ms_to_iso(t) for t in times],
        "now_ts": times,
        "series": {n: [ticks[t].get(n, 0) for t in times] for n in names},
        "totals": {n: sum(ticks[t].get(n, 0) for t in times) for n in names},
    }


def _chart(title: str, names: list[str], data: dict[str, Any], width: int = 860, height: int = 220) -> str:
    xs = data["now_ts"]
    left, right, top, bottom = 60, 10, 24, 28
    plot_w, plot_h = width - left - right, height - top - bottom
    top_value = max([1] + [v for n in names for v in data["series"][n]])
    x0, x1 = (xs[0], xs[-1]) if xs else (0, 1)
    span = max(1, x1 - x0)

    def point(x: int, y: int) -> str:
        return f"{left + (x - x0) / span * plot_w:.1f},{top + plot_h - y / top_value * plot_h:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(title)}">',
        f'<text x="{left}" y="16" font-size="13" font-family="sans-serif">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#888"/>',
        f'<text x="4" y="{top + 10}" font-size="11" font-family="sans-serif">{top_value}</text>',
        f'<text x="4" y="{top + plot_h}" font-size="11" font-family="sans-serif">0</text>',
    ]
    for i, name in enumerate(names):
        colour = _COLOURS[i % len(_COLOURS)]
        pts = " ".join(point(x, y) for x, y in zip(xs, data["series"][name], strict=True))
        parts.append(
            f'<polyline data-series="{name}" fill="none" stroke="{colour}" stroke-width="1.5" '
            f'points="{pts}"/>'
        )
        parts.append(
            f'<text x="{left + 10 + i * 170}" y="{height - 8}" font-size="11" font-family="sans-serif" '
            f'fill="{colour}">{html.escape(name)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def render(data: dict[str, Any], warehouse: str) -> str:
    """The report page for ``data`` (from :func:`collect`)."""
    span = f"{data['ticks'][0]} → {data['ticks'][-1]}" if data["ticks"] else "no ticks recorded"
    totals = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>"
        for k, v in data["totals"].items()
        if not k.endswith("_ms")
    )
    charts = "\n".join(
        f"<h2>{key}</h2>\n{_chart(title, names, data)}" for key, (title, names) in SERIES.items()
    )
    payload = json.dumps(data).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>deltamq report</title>
<style>body{{font-family:sans-serif;margin:24px}} td{{padding:2px 12px}}</style></head>
<body>
<h1>deltamq report</h1>
<p>warehouse {html.escape(warehouse)} — {len(data["ticks"])} ticks, {html.escape(span)}</p>
<table>{totals}</table>
{charts}
<script type="application/json" id="deltamq-data">{payload}</script>
</body></html>
"""


def write_html(ctx: Context, path: str, *, since: int | None = None, until: int | None = None) -> dict:
    data = collect(ctx, since=since, until=until)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render(data, ctx.warehouse.location))
    return data
