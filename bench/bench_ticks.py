"""Benchmark: file counts and tick cost after many ticks (compaction and log hygiene).

Each tick: 10 messages sent (1 KiB), then a tick at a fake clock 30 s later that
dispatches and delivers them to a push group (with ``--pull``: a pull client pulls and
acks them instead); retention and compaction run hourly (every 120 ticks), log cleanup
from every tick. After every block of ticks: the median cost of those busy ticks and of
10 idle ticks, the files the newest version of each busy table references, the Parquet
files on disk and the Delta log entries. Vacuum and log cleanup go by the wall clock;
the bench runs a 30 s tick in well under a second, so their retentions are scaled down
alike (vacuum 60 s, log 1 s: a few ticks, as the defaults of 24 h and 60 s are at 30 s
ticks). A tick over 5 s or one that fails is recorded with each job's time and the
engine's counters (a failed tick is counted and the run goes on, as ``deltamq run``
does); deltamq's log goes to <root>/bench.log. ``--compare`` runs the same without
compaction and log cleanup. With ``--pull`` the client lives in the ticking process,
which then allocates from the pull client's pool (jemalloc since 2026-11-29,
deltamq/arrow_memory.py): earlier ``--pull`` results ran their ticks on mimalloc.
Writes bench/results/ticks-<timestamp>.json. A benchmark, not a test.

    python bench/bench_ticks.py [--ticks 10000] [--block 1000] [--pull] [--compare]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from deltalake import DeltaTable

from deltamq import Broker, FakeClock, Message
from deltamq.engine import Engine
from deltamq.sail import resident_mb

HERE = Path(__file__).parent
TABLES = (
    "commit_log",
    "consume_queue",
    "offsets",
    "deliveries",
    "queue_lock",
    "clients",
    "job_runs",
    "leases",
)


SLOW_S = 5.0


def _slow(i: int, took: float, r, error: str | None, before: dict, after: dict) -> dict:
    """What a slow or failed tick did: each job's wall time and the engine's counters."""
    return {
        "tick": i,
        "seconds": round(took, 2),
        "error": error,
        "jobs_ms": {j.job: j.end_ts - j.start_ts for j in r.jobs} if r is not None else None,
        "engine": {k: after[k] - before[k] for k in after if k != "by_job"},
    }


def _memory() -> dict:
    """Resident memory (MiB) of this process and of the embedded Sail server, and how
    often the server was replaced for passing embedded_max_rss_mb."""
    server = Engine.embedded_rss_mb()
    return {
        "broker": round(resident_mb()),
        "server": None if server is None else round(server),
        "server_recycles": Engine.embedded_recycles(),
    }


def _files(wh) -> dict[str, dict[str, int]]:
    out = {}
    for t in TABLES:
        path = wh.path(t)
        disk = sum(
            1
            for root, _, fs in os.walk(path)
            if "_delta_log" not in root
            for f in fs
            if f.endswith(".parquet")
        )
        log = len(os.listdir(os.path.join(path, "_delta_log")))
        out[t] = {"live": len(DeltaTable(path).file_uris()), "disk": disk, "log_entries": log}
    return out


def run(root: Path, ticks: int, block: int, compact: bool, pull: bool, save=lambda blocks: None) -> dict:
    wh_dir = root / f"ticks-{compact}"
    shutil.rmtree(wh_dir, ignore_errors=True)
    clock = FakeClock()
    b = Broker.init(wh_dir, clock=clock)
    b.reconfigure(compact=compact, vacuum_retention_ms=60_000, log_retention_ms=1_000)
    b.create_topic("orders", queues=4)
    b.create_group("workers", None if pull else "bench_listeners:ok", consume_from="FIRST_OFFSET")
    b.subscribe("workers", "orders")
    consumer = b.pull_consumer("workers", "c1") if pull else None
    p = b.producer("p")
    body = os.urandom(1024)
    blocks = []
    busy: list[float] = []
    slow: list[dict] = []  # ticks over SLOW_S: per-job times, engine counters, failure
    failed = consumed = 0
    t_start = time.perf_counter()
    for i in range(1, ticks + 1):
        p.send_batch([Message("orders", body)] * 10)
        clock.advance(seconds=30)
        before = asdict(b.engine.stats)
        s0 = time.perf_counter()
        error, r = None, None
        try:
            r = b.tick(clock.now_ms())
        except Exception as e:  # noqa: BLE001 - recorded; the next tick carries on, as the loop does
            failed += 1
            error = f"{type(e).__name__}: {e}"[:500]
        took = time.perf_counter() - s0
        busy.append(took)
        if took > SLOW_S or error:
            slow.append(_slow(i, took, r, error, before, asdict(b.engine.stats)))
            print(json.dumps({"slow": slow[-1]}), flush=True)
        if consumer is not None:
            got = consumer.pull(100, now=clock.now_ms())
            consumer.ack([m.receipt_handle for m in got], now=clock.now_ms())
            consumed += len(got)
        elif r is not None:
            consumed += r.job("deliver").details["consumed"]
        if i % block == 0:
            assert consumed == 10 * i or failed, (consumed, i)
            idle = []
            for _ in range(10):
                clock.advance(seconds=1)
                s0 = time.perf_counter()
                b.tick(clock.now_ms())
                idle.append(time.perf_counter() - s0)
            blocks.append(
                {
                    "ticks": i,
                    "wall_s": round(time.perf_counter() - t_start),
                    "busy_tick_median_s": round(statistics.median(busy), 3),
                    "idle_tick_median_s": round(statistics.median(idle), 3),
                    "files": _files(b.warehouse),
                    "failed_ticks": failed,
                    "consumed": consumed,
                    "engine": {k: v for k, v in asdict(b.engine.stats).items() if k != "by_job"},
                    "memory_mb": _memory(),
                    "slow_ticks": slow,
                }
            )
            busy, slow = [], []
            print(json.dumps({"compact": compact, **blocks[-1]}), flush=True)
            save(blocks)  # a run cut short still leaves its blocks
    total = time.perf_counter() - t_start
    shutil.rmtree(wh_dir, ignore_errors=True)
    return {"compact": compact, "pull": pull, "ticks": ticks, "seconds": round(total, 1), "blocks": blocks}


BEGIN, END = "<!-- ticks:begin -->", "<!-- ticks:end -->"


def table(result: dict, name: str) -> str:
    """The markdown table of a result (the last run: compaction on unless only off ran)."""
    run = result["runs"][0]
    cut = " — stopped before its last block (see below)" if run.get("partial") else ""
    lines = [
        f"`python bench/bench_ticks.py --ticks {result.get('args', {}).get('ticks', '?')}` — "
        f"{result['at'][:10]}, `results/{name}`{cut}",
        "",
        "| ticks | wall | busy tick (block median) | idle tick (median of 10) | files referenced: "
        "commit_log / consume_queue / offsets / job_runs | Parquet files on disk: consume_queue / offsets "
        "| log entries: commit_log / consume_queue / offsets / job_runs "
        "| memory MiB: broker / Sail server (replacements) |",
        "|---:|---:|---:|---:|---|---|---|---|",
    ]
    for b in run["blocks"]:
        f = b["files"]
        t = ("commit_log", "consume_queue", "offsets", "job_runs")
        lines.append(
            f"| {b['ticks']:,} | {b['wall_s']} s | {b['busy_tick_median_s']} s "
            f"| {b['idle_tick_median_s']} s | "
            + " / ".join(str(f[x]["live"]) for x in t)
            + f" | {f['consume_queue']['disk']} / {f['offsets']['disk']} | "
            + " / ".join(str(f[x]["log_entries"]) for x in t)
            + f" | {_memory_cell(b.get('memory_mb'))} |"
        )
    return "\n".join(lines)


def _memory_cell(m: dict | None) -> str:
    if not m:
        return "—"  # runs before the Sail server had a process of its own
    return f"{m['broker']} / {m['server']} ({m['server_recycles']})"


def write_table(path: Path) -> None:
    """Regenerate the table between the markers in bench/README.md from a result file."""
    readme = HERE / "README.md"
    text = readme.read_text()
    block = f"{BEGIN}\n{table(json.loads(path.read_text()), path.name)}\n{END}"
    readme.write_text(text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=10_000)
    ap.add_argument("--block", type=int, default=1000)
    ap.add_argument("--pull", action="store_true", help="a pull client consumes instead of a push group")
    ap.add_argument("--compare", action="store_true", help="also run without compaction and log cleanup")
    ap.add_argument("--root", default="/tmp/deltamq-bench-ticks")
    ap.add_argument("--table", type=Path, help="only regenerate the README table from this result file")
    args = ap.parse_args()
    if args.table:
        write_table(args.table)
        return
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    # deltamq's own log (commit conflicts retried, lease waits) next to the warehouses
    logging.basicConfig(
        filename=root / "bench.log", level=logging.WARNING, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("deltamq").setLevel(logging.INFO)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = HERE / "results" / f"ticks-{stamp}.json"
    result: dict = {
        "bench": "ticks",
        "at": datetime.now(UTC).isoformat(),
        "args": {k: v for k, v in vars(args).items() if k != "table"},
        "runs": [],
    }

    def save(blocks: list | None = None, done: dict | None = None) -> None:
        partial = [*result["runs"], done or {"partial": True, "blocks": blocks}]
        out.write_text(json.dumps({**result, "runs": partial}, indent=2) + "\n")
        write_table(out)

    for c in (True, False) if args.compare else (True,):
        done = run(root, args.ticks, args.block, c, args.pull, save=lambda blocks, c=c: save(blocks))
        result["runs"].append(done)
        out.write_text(json.dumps(result, indent=2) + "\n")
        write_table(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
