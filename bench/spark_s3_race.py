"""Two Apache Spark drivers append to one Delta table on S3 at once: does every commit
survive? The evidence behind refusing S3 warehouses on Apache Spark (docs/engines.md).

Starts moto's S3 server on 127.0.0.1, then two spark-submit processes (local[1] each,
Delta and hadoop-aws from ``deltamq.spark_setup``), each appending ``--appends`` single-row
commits to ``s3a://race/t``. Afterwards it counts the rows and the commits the Delta log
holds, and reads the log with delta-rs. Writes ``bench/results/spark-s3-race-<time>.json``.

    python bench/spark_s3_race.py --appends 40
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from run import start_s3_emulator

from deltamq.spark_setup import child_env, spark_bin, submit_args
from deltamq.storage import Storage

WRITER = """
import sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.getOrCreate()
name, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for i in range(n):
    spark.createDataFrame([(name, i)], "writer string, i int").write.format("delta").mode("append").save(path)
print("done", name, flush=True)
"""


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--appends", type=int, default=40)
    args = ap.parse_args()
    moto = start_s3_emulator("s3://race/t")  # AWS_* of this process now point at it
    try:
        store = Storage("s3://race/t")
        s3 = store.spark_conf() | {"spark.ui.enabled": "false"}
        submit = spark_bin("spark-submit")
        path = "s3a://race/t"
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "writer.py"
            script.write_text(WRITER)
            # the table exists before the race (one writer creates it)
            seed = [submit, "--master", "local[1]", *submit_args(s3), str(script), "seed", "1", path]
            subprocess.run(seed, env=child_env(), check=True, capture_output=True)
            started = time.time()
            procs = [
                subprocess.Popen(
                    [
                        "spark-submit",
                        "--master",
                        "local[1]",
                        *submit_args(s3),
                        str(script),
                        f"w{i}",
                        str(args.appends),
                        path,
                    ],
                    env=child_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )  # fmt: skip
                for i in range(2)
            ]
            outs = [p.communicate() for p in procs]
            elapsed = time.time() - started
        table = store.delta_table(store.location)
        rows = table.to_pyarrow_table().num_rows
        result = {
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "writers": 2,
            "appends_each": args.appends,
            "rows_expected": 1 + 2 * args.appends,
            "rows_found": rows,
            "log_version": table.version(),
            "commits_expected": 1 + 2 * args.appends,
            "writer_exit_codes": [p.returncode for p in procs],
            "writer_errors": [
                _last_line(err) if p.returncode else "" for p, (_, err) in zip(procs, outs, strict=True)
            ],
            "seconds": round(elapsed, 1),
        }
        result["lost_commits"] = result["rows_expected"] - rows
        out = Path(__file__).parent / "results" / f"spark-s3-race-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        print("written to", out)
    finally:
        moto.terminate()
        moto.wait()


if __name__ == "__main__":
    main()
