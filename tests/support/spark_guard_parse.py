"""Parse SQL statements with Apache Spark's own parser (classic JVM session).

Usage: python spark_guard_parse.py statements.json → prints JSON {"parsed": n, "failed": [...]}.
Runs in its own process: a classic session and Spark Connect sessions must not share
one (docs/design.md, measured facts).
"""

from __future__ import annotations

import json
import sys

from pyspark.sql import SparkSession


def main(path: str) -> None:
    statements = json.load(open(path, encoding="utf-8"))
    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.extensions", "")
        .getOrCreate()
    )
    parser = spark._jsparkSession.sessionState().sqlParser()
    failed = []
    for stmt in statements:
        try:
            parser.parsePlan(stmt)
        except Exception as e:  # noqa: BLE001 - report every failure
            failed.append({"sql": stmt[:500], "error": str(e).split("\n")[0][:300]})
    print(json.dumps({"parsed": len(statements) - len(failed), "failed": failed}))
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
