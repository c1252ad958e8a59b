"""Benchmark: one dispatch pass indexed from the files (deltamq/tables/index_files.py)
against the engine's ``MERGE``, by pass size.

For each size N: a fresh warehouse (topic of 4 queues, 1 KiB bodies, one
``send_dataframe``), then one ``dispatch.run`` timed, once with the files' limit raised
above N (the pass is planned in Arrow and appended) and once with it at zero (the
engine's plan and ``MERGE``), in that order per size, one process each, after a pass
of 100 (the snapshots loaded, as in a running loop). ``index_files.MAX_ROWS`` is chosen
from where the two cross. Writes bench/results/index-<timestamp>.json. A benchmark, not
a test.

    python bench/bench_index.py [--sizes 5000 20000 50000 150000] [--root /tmp/deltamq-bench-index]
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
import json, sys, time
from pathlib import Path
sys.path.insert(0, {here!r})
import run as R
from deltamq.jobs import dispatch
from deltamq.tables import index_files
n, limit, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
index_files.MAX_ROWS = limit
wh, clock, b, staging = R._setup(root, f"index-{{n}}-{{limit}}", n)
b.producer("bench").send_dataframe(b.engine.spark.read.parquet(str(staging)).limit(100))
dispatch.run(b.context, clock.now_ms())  # warm: the tables' snapshots loaded, as in a running loop
b.producer("bench").send_dataframe(b.engine.spark.read.parquet(str(staging)))
t = time.perf_counter()
r = dispatch.run(b.context, clock.now_ms())
print(json.dumps({{"rows": r.rows_out, "seconds": round(time.perf_counter() - t, 3)}}))  # fmt: skip
b.close()
"""


def one(root: Path, n: int, files: bool) -> dict:
    limit = n if files else 0
    out = subprocess.run(
        [sys.executable, "-c", ONE.format(here=str(HERE)), str(n), str(limit), str(root)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[5_000, 20_000, 50_000, 150_000])
    ap.add_argument("--root", default="/tmp/deltamq-bench-index")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in args.sizes:
        files, engine = one(root, n, True), one(root, n, False)
        assert files["rows"] == engine["rows"] == n, (files, engine)
        runs.append({"rows": n, "files_s": files["seconds"], "engine_s": engine["seconds"]})
        print(json.dumps(runs[-1]), flush=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {"bench": "index", "at": datetime.now(UTC).isoformat(), "runs": runs}
    (HERE / "results" / f"index-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
