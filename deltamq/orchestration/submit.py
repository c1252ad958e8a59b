"""spark-submit entry point: run one job or a tick with the session spark-submit made.

    spark-submit --remote sc://HOST:PORT --conf spark.api.mode=connect \\
        "$(python -c 'import deltamq.orchestration.submit as m; print(m.__file__)')" \\
        dispatch --warehouse /data/wh

Under classic spark-submit (``--master ...`` with delta-spark configured) the active
session is used; with ``--remote`` a Spark Connect session. Either way the job code is
the same as the embedded engine's. Exit status 0; ``--skipped-exit`` (3) when another
runner holds the job's lease; 4 when a push group's listener or a sink's transform could
not be loaded where the job ran (the group is named on stderr; its messages wait).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from pyspark.sql import SparkSession

    from deltamq.broker import Broker
    from deltamq.constants import SETUP_FAILED_EXIT
    from deltamq.errors import LeaseHeld
    from deltamq.orchestration.tick import JOB_NAMES, SEQUENCE, TickRunner, job_sequence

    p = argparse.ArgumentParser(prog="deltamq-submit", description="run deltamq jobs under spark-submit")
    p.add_argument("job", choices=[*JOB_NAMES, "tick"])
    p.add_argument("--warehouse", required=True)
    p.add_argument("--now", type=int, help="epoch ms (default: wall clock)")
    p.add_argument(
        "--skipped-exit",
        type=int,
        default=3,
        help="exit status when another runner holds the job's lease (the job is skipped)",
    )
    args = p.parse_args(argv)
    spark = SparkSession.builder.getOrCreate()
    broker = Broker.open(args.warehouse, spark=spark)
    sequence = SEQUENCE if args.job == "tick" else job_sequence(args.job)
    runner = TickRunner(broker.context, sequence=sequence)
    try:
        result = runner.tick(args.now)
    except LeaseHeld as e:
        print(f"skipped: {e}", flush=True)
        return args.skipped_exit
    finally:
        runner.release()
    print(result.summary(), flush=True)
    for group, why in result.setup_errors:
        print(f"deltamq-submit: error: group {group!r} consumed nothing: {why}", file=sys.stderr, flush=True)
    return SETUP_FAILED_EXIT if result.setup_errors else 0


if __name__ == "__main__":
    sys.exit(main())
