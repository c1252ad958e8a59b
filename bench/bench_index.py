"""Benchmark: one dispatch pass indexed from the files (deltamq/tables/index_files.py)
against the engine's ``MERGE``, by pass size.

For each size N: a fresh warehouse (topic of 4 queues, 1 KiB bodies, one
``send_dataframe``, or with ``--send arrow`` one ``send_arrow``, whose file is ordered
by queue), then one ``dispatch.run`` timed, with how much its process's resident memory
grew, once with the files' limit raised above N (the pass is planned in Arrow and
appended) and once with it at zero (the engine's plan and ``MERGE``), in that order per
size, one process each, after a pass of 100 (the snapshots loaded, as in a running
loop). ``index_files.MAX_ROWS`` (``MAX_ORDERED_ROWS`` for files ordered by queue) is
chosen from where the two cross. Writes bench/results/index-<timestamp>.json. A
benchmark, not a test.

    python bench/bench_index.py [--sizes 5000 20000 50000 150000] [--send dataframe|arrow]
                                [--root /tmp/deltamq-bench-index]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).parent

ONE = """
import json, os, sys, threading, time
from pathlib import Path
import pyarrow.parquet as pq
sys.path.insert(0, {here!r})
import run as R
from deltamq.jobs import dispatch
from deltamq.tables import index_files
n, limit, root, send = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
index_files.MAX_ROWS = index_files.MAX_ORDERED_ROWS = limit
wh, clock, b, staging = R._setup(root, f"index-{{n}}-{{limit}}", n)
b.producer("bench").send_dataframe(b.engine.spark.read.parquet(str(staging)).limit(100))
dispatch.run(b.context, clock.now_ms())  # warm: the tables' snapshots loaded, as in a running loop
if send == "arrow":
    b.producer("bench").send_arrow(pq.read_table(str(staging)))
else:
    b.producer("bench").send_dataframe(b.engine.spark.read.parquet(str(staging)))
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before, peak, done = rss(), [0], threading.Event()
def watch():  # the pass's peak resident memory, sampled every 5 ms
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
t = time.perf_counter()
r = dispatch.run(b.context, clock.now_ms())
took = round(time.perf_counter() - t, 3)
done.set()
grew = (max(peak[0], rss()) - before) >> 20
print(json.dumps({{"rows": r.rows_out, "seconds": took, "rss_growth_mib": grew}}))
b.close()
"""


def one(root: Path, n: int, files: bool, send: str) -> dict:
    limit = n if files else 0
    out = subprocess.run(
        [sys.executable, "-c", ONE.format(here=str(HERE)), str(n), str(limit), str(root), send],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[5_000, 20_000, 50_000, 150_000])
    ap.add_argument("--send", choices=("dataframe", "arrow"), default="dataframe")
    ap.add_argument("--root", default="/tmp/deltamq-bench-index")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in args.sizes:
        files, engine = one(root, n, True, args.send), one(root, n, False, args.send)
        assert files["rows"] == engine["rows"] == n, (files, engine)
        runs.append(
            {
                "rows": n,
                "files_s": files["seconds"],
                "engine_s": engine["seconds"],
                "files_rss_growth_mib": files["rss_growth_mib"],
                "engine_rss_growth_mib": engine["rss_growth_mib"],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {"bench": "index", "send": args.send, "at": datetime.now(UTC).isoformat(), "runs": runs}
    (HERE / "results" / f"index-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
