"""Run by tests/test_spark.py in a process of its own (a classic session and a Spark Connect
one cannot share a process): two Brokers over one in-process classic Spark session with
Delta, built the way pip users build one. Prints one JSON line of what it saw."""

from __future__ import annotations

import json
import sys

from deltamq import Broker, FakeClock, Message, spark_setup


def main(root: str) -> None:
    spark = spark_setup.classic_session("local[2]", {"spark.sql.shuffle.partitions": "2"})
    # a notebook's own setting: deltamq's sessions still work in UTC
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    clock = FakeClock(1_767_225_600_000)
    brokers = [Broker.init(f"{root}/wh{i}", spark=spark, clock=clock) for i in range(2)]
    for i, b in enumerate(brokers):
        b.create_topic("orders", queues=2)
        b.create_group("g", "support.listeners:env_recorder", consume_from="FIRST_OFFSET")
        b.subscribe("g", "orders")
        b.producer("p").send_batch([Message("orders", f"w{i}-m{j}".encode()) for j in range(i + 2)])
        b.tick(clock.now_ms())
    out = {
        "stored": [b.sql("SELECT count(*) AS n FROM commit_log").collect()[0]["n"] for b in brokers],
        "consumed": [
            b.sql(
                "SELECT coalesce(sum(next_offset), 0) AS n FROM offsets WHERE consumer_group = 'g'"
            ).collect()[0]["n"]
            for b in brokers
        ],
        "tz": [b.spark.conf.get("spark.sql.session.timeZone") for b in brokers],
        "caller_tz": spark.conf.get("spark.sql.session.timeZone"),
        "modes": [b.engine.mode + "/" + b.engine.flavor for b in brokers],
        "day": brokers[0].sql("SELECT CAST(from_unixtime(0) AS STRING) AS d").collect()[0]["d"],
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
