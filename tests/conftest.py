"""Shared fixtures: one embedded engine for the whole session, a fresh warehouse per test.

Every SQL statement the engine runs during the session is recorded; the Spark guard
test (moved to the end of the run) parses each with Apache Spark's own parser.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("RUST_LOG", "error")
sys.path.insert(0, str(Path(__file__).parent))

from deltamq import Broker, FakeClock  # noqa: E402
from deltamq.engine import SQL_RECORDERS  # noqa: E402

RECORDED_SQL: set[str] = set()

# Tests marked `plan` can run on a classic Apache Spark session instead (the guard
# runs them that way in a subprocess): DELTAMQ_TEST_ENGINE=classic.
TEST_ENGINE = os.environ.get("DELTAMQ_TEST_ENGINE", "embedded")


def pytest_configure(config):
    SQL_RECORDERS.append(RECORDED_SQL.add)


def pytest_collection_modifyitems(config, items):
    # The guard parses what the rest of the suite issued: run it last.
    items.sort(key=lambda item: 1 if item.get_closest_marker("spark_guard") else 0)


@pytest.fixture
def spark(_spark_source):
    """Spark for plan tests: embedded Sail, or classic local Spark (TEST_ENGINE)."""
    return _spark_source.spark


@pytest.fixture(scope="session")
def _spark_source():
    """An object whose ``spark`` is the session to use: an embedded Engine reconnects
    when a test replaced the embedded server."""
    if TEST_ENGINE == "classic":
        from pyspark.sql import SparkSession

        session = (
            SparkSession.builder.master("local[1]")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        yield SimpleNamespace(spark=session)
        session.stop()
        return
    from deltamq.config import BrokerConfig
    from deltamq.engine import Engine

    yield Engine.open(BrokerConfig())


@pytest.fixture(autouse=True)
def _stop_listener_workers():
    """Each test's listeners get their own worker processes; stop them after the test."""
    yield
    from deltamq.jobs import listener_worker

    listener_worker.shutdown()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_767_225_600_000)  # 2026-01-01 00:00:00 UTC


@pytest.fixture
def broker(tmp_path, clock):
    b = Broker.open(tmp_path / "wh", clock=clock)
    yield b
    b.close()


def table_versions(warehouse_dir: Path | str) -> dict[str, int]:
    """Number of commits of every table (to assert that nothing changed)."""
    root = Path(warehouse_dir)
    out = {}
    for table in sorted(p for p in root.iterdir() if (p / "_delta_log").is_dir()):
        out[table.name] = len(list((table / "_delta_log").glob("*.json")))
    return out
