"""The Spark-free producer (deltamq.lite): same validation and ids, written by delta-rs,
indexed by dispatch like any other send, concurrently with the Spark producer."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from deltamq import Message
from deltamq.errors import BodyTooLarge, TopicNotWritable, UnknownTopic
from deltamq.jobs import dispatch
from deltamq.lite import Producer

# runs with PySpark, Sail and delta-spark made unimportable
_NO_SPARK = """
import json, sys, time
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "pysail", "delta", "great_expectations"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
from deltamq.lite import Producer
from deltamq.message import Message
wh, rounds, go = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
p = Producer(wh, "lite-service")
time.sleep(max(0.0, go - time.time()))
ids = []
for r in range(rounds):
    ids += p.send_batch([Message("orders", f"lite-{r}-{i}".encode(), keys=f"k{i}") for i in range(10)])
spark = sorted(m for m in sys.modules if m.startswith(("pyspark", "pysail")))
print(json.dumps({"ids": ids, "modules": spark}))
"""


def test_lite_producer_validates_like_the_broker(broker, tmp_path):
    broker.create_topic("orders", queues=2)
    broker.create_topic("readonly", perm="R")
    p = Producer(tmp_path / "wh", "lite-service")
    with pytest.raises(UnknownTopic, match="'nope' does not exist"):
        p.send(Message("nope", b"x"))
    with pytest.raises(TopicNotWritable, match="perm R"):
        p.send(Message("readonly", b"x"))
    with pytest.raises(BodyTooLarge):
        p.send(Message("orders", b"x" * (broker.config.max_body_bytes + 1)))
    with pytest.raises(ValueError, match="delay_level"):
        p.send(Message("orders", b"x", delay_level=-1))
    mid = p.send(Message("orders", b"hello", tags="A", keys="k1", delay_level=2))
    broker.tick()
    row = broker.sql(
        "SELECT topic, tags, keys, properties['UNIQ_KEY'] AS uk, properties['DELAY'] AS d FROM consume_queue "
        f"WHERE msg_id = '{mid}'"
    ).collect()
    assert [(r["topic"], r["tags"], r["keys"], r["uk"], r["d"]) for r in row] == [
        ("SCHEDULE_TOPIC_XXXX", "A", "k1", mid, "2")
    ]


@pytest.mark.story(s3="slow")
def test_lite_producer_runs_without_spark_alongside_the_spark_producer(broker, location, store_env, clock):
    broker.create_topic("orders", queues=4)
    go = time.time() + 3.0
    proc = subprocess.Popen(
        [sys.executable, "-c", _NO_SPARK, location, "20", str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=store_env,
    )
    spark_ids = []
    producer = broker.producer("spark-service")
    time.sleep(max(0.0, go - time.time()))
    for r in range(20):  # interleaved with the subprocess's appends
        spark_ids += producer.send_batch([Message("orders", f"spark-{r}-{i}".encode()) for i in range(10)])
        if r == 10:
            broker.tick(clock.now_ms())  # a whole tick meanwhile, dispatch included
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["modules"] == []  # no PySpark, no Sail in that process
    lite_ids = report["ids"]
    dispatch.run(broker.context, clock.now_ms())
    rows = broker.sql(
        "SELECT msg_id, queue_id, queue_offset FROM consume_queue WHERE topic = 'orders'"
    ).collect()
    assert sorted(r["msg_id"] for r in rows) == sorted(spark_ids + lite_ids)  # each once
    assert len(set(lite_ids) | set(spark_ids)) == 400
    for q in range(4):
        offsets = sorted(r["queue_offset"] for r in rows if r["queue_id"] == q)
        assert offsets == list(range(len(offsets)))  # dense per queue
    producers = broker.sql(
        "SELECT producer_group, count(*) AS n FROM commit_log GROUP BY 1 ORDER BY 1"
    ).collect()
    assert [(r["producer_group"], r["n"]) for r in producers] == [
        ("lite-service", 200),
        ("spark-service", 200),
    ]
