"""``deltamq spark conf | fetch``: what an Apache Spark deployment needs for deltamq.

``conf`` prints the ``--packages``/``--conf`` arguments (one per line, or ``--json``) that
spark-submit, pyspark and Spark's Connect server take; ``fetch`` resolves the jars once
through Spark's own resolver (Ivy: ``~/.m2/repository``, then its cache, then Maven
Central), so that later starts find them cached (docs/engines.md)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from deltamq import spark_setup
from deltamq.cli.parser import ENGINE_REJECTED, OK


def spark(args: argparse.Namespace) -> int:
    if args.action == "conf":
        if args.json:
            print(json.dumps({"packages": list(spark_setup.PACKAGES), "conf": spark_setup.SESSION_CONF}))
        else:
            parts = spark_setup.submit_args()
            print(" \\\n".join(f"{a} {b}" for a, b in zip(parts[::2], parts[1::2], strict=True)))
        return OK
    return _fetch()


def _fetch() -> int:
    """spark-submit of an empty script with the packages: Ivy resolves and caches them."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "resolve.py"
        script.write_text("pass\n")
        cmd = [
            spark_setup.spark_bin("spark-submit"),
            "--packages",
            ",".join(spark_setup.PACKAGES),
            str(script),
        ]
        proc = subprocess.run(cmd, env=spark_setup.child_env(), capture_output=True, text=True, check=False)
    jars = [line.split(" ", 1)[0] for line in proc.stderr.splitlines() if "found " in line and " in " in line]
    if proc.returncode != 0:
        failed = [line.strip() for line in proc.stderr.splitlines() if "FAILED" in line or "::" in line]
        print(
            f"could not resolve {', '.join(spark_setup.PACKAGES)} (spark-submit exit {proc.returncode}):\n"
            + "\n".join(failed[-12:] or proc.stderr.splitlines()[-12:]),
            file=sys.stderr,
        )
        return ENGINE_REJECTED
    print(
        f"resolved {len(jars) or 'all'} artifacts of {', '.join(spark_setup.PACKAGES)} into Spark's Ivy cache"
    )
    return OK
