"""Apache Spark with Delta Lake: the jars, settings and command lines deltamq runs with.

One place holds what an Apache Spark deployment needs for deltamq (docs/engines.md,
"Apache Spark with Delta Lake"):

* the Maven coordinates of Delta for the pinned pyspark line (pyspark 4.0.x with Delta
  4.0.x; the pip ``delta-spark`` package is pinned to the same line) and of
  ``hadoop-aws`` matching the Hadoop inside the pyspark wheel, resolved by Spark's own
  ``--packages`` (Ivy: ``~/.m2/repository`` first, then its cache, then Maven Central);
* the session settings (Delta's SQL extension and catalog, UTC);
* the command lines of the three deployments: ``spark-submit`` of a job, Apache Spark's
  Spark Connect server, and a standalone cluster's master and workers (the pip pyspark
  has no ``sbin`` start scripts: ``spark-class`` starts them).

``deltamq spark-conf`` prints the ``--packages``/``--conf`` lines for a shell.
Nothing here imports PySpark at module level.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DELTA_VERSION = "4.0.1"
HADOOP_VERSION = "3.4.1"  # the Hadoop inside pyspark 4.0.x's wheel (hadoop-client-api-3.4.1.jar)
DELTA_PACKAGE = f"io.delta:delta-spark_2.13:{DELTA_VERSION}"
S3A_PACKAGE = f"org.apache.hadoop:hadoop-aws:{HADOOP_VERSION}"  # brings the AWS SDK v2 bundle
PACKAGES: tuple[str, ...] = (DELTA_PACKAGE, S3A_PACKAGE)

DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"

# Settings every deltamq Spark session runs with.
SESSION_CONF: dict[str, str] = {
    "spark.sql.extensions": DELTA_EXTENSION,
    "spark.sql.catalog.spark_catalog": DELTA_CATALOG,
    # epoch-ms columns are rendered and truncated to days in UTC on every engine
    "spark.sql.session.timeZone": "UTC",
}


# Settings deltamq's own sessions get on Apache Spark (Engine.open), measured on 2 cores:
# Delta rebuilds a table's snapshot state in 50 partitions by default, a stage of 50 tasks
# for every read of a small control table (an idle tick took 15-25 s; with 2, 3-4 s).
SESSION_TUNING: dict[str, str] = {"spark.databricks.delta.snapshotPartitions": "2"}


def spark_home() -> Path:
    """The Spark distribution inside the pip pyspark package (its ``bin/`` holds
    spark-submit and spark-class)."""
    import pyspark

    return Path(pyspark.__file__).parent


def spark_bin(name: str) -> str:
    """``spark-submit`` or ``spark-class``: next to this Python (a venv's bin), else the
    pip package's own ``bin/``."""
    here = shutil.which(name, path=str(Path(sys.executable).parent))
    return here or str(spark_home() / "bin" / name)


def conf_args(conf: Mapping[str, str]) -> list[str]:
    out: list[str] = []
    for key, value in conf.items():
        out += ["--conf", f"{key}={value}"]
    return out


def submit_args(extra_conf: Mapping[str, str] | None = None) -> list[str]:
    """``--packages … --conf …`` for spark-submit: Delta, s3a and the session settings."""
    return ["--packages", ",".join(PACKAGES), *conf_args({**SESSION_CONF, **(extra_conf or {})})]


def python_conf(python: str | None = None, pythonpath: str | None = None) -> dict[str, str]:
    """Settings that make executors start the same Python as the driver, with ``pythonpath``
    (deltamq and the listeners' modules) importable: listener code runs there."""
    exe = python or sys.executable
    conf = {"spark.pyspark.python": exe, "spark.pyspark.driver.python": exe}
    if pythonpath:
        conf["spark.executorEnv.PYTHONPATH"] = pythonpath
    return conf


def connect_server_command(
    port: int, *, master: str | None = None, extra_conf: Mapping[str, str] | None = None
) -> list[str]:
    """Apache Spark's Spark Connect server with Delta loaded, listening on ``port``."""
    cmd = [spark_bin("spark-submit"), "--class", CONNECT_SERVER_CLASS]
    if master:
        cmd += ["--master", master]
    conf = {"spark.connect.grpc.binding.port": str(port), **(extra_conf or {})}
    return cmd + submit_args(conf)


def master_command(host: str, port: int, web_port: int = 0) -> list[str]:
    """A standalone cluster's master (``spark://host:port``)."""
    return [
        spark_bin("spark-class"), "org.apache.spark.deploy.master.Master",
        "--host", host, "--port", str(port), "--webui-port", str(web_port),
    ]  # fmt: skip


def worker_command(master_url: str, host: str, *, cores: int = 1, memory: str = "2g") -> list[str]:
    """A standalone cluster's worker, registering with ``master_url``."""
    return [
        spark_bin("spark-class"), "org.apache.spark.deploy.worker.Worker", master_url,
        "--host", host, "--cores", str(cores), "--memory", memory, "--webui-port", "0",
    ]  # fmt: skip


def classic_session(master: str = "local[2]", extra_conf: Mapping[str, str] | None = None) -> SparkSession:
    """An in-process classic session with Delta, the way pip users build one
    (``configure_spark_with_delta_pip``) plus hadoop-aws and deltamq's settings."""
    from delta import configure_spark_with_delta_pip
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).config("spark.ui.enabled", "false")
    for key, value in {**SESSION_CONF, **python_conf(), **(extra_conf or {})}.items():
        builder = builder.config(key, value)
    return configure_spark_with_delta_pip(builder, extra_packages=[S3A_PACKAGE]).getOrCreate()


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a Spark process started from this one: pyspark marks a process
    that opened a Connect session (``SPARK_CONNECT_MODE_ENABLED``) and a child inheriting
    that could not start a classic session; the workers use this Python."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()}
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    return env
