"""init is idempotent, upgrades an older warehouse in place, refuses a newer one."""

from __future__ import annotations

import pytest
from conftest import table_versions
from deltalake import DeltaTable

from deltamq import Broker
from deltamq.errors import SchemaVersionError
from deltamq.schemas import SCHEMA_VERSION, TABLES
from deltamq.tables.warehouse import Warehouse


def test_init_creates_every_table_once(broker, tmp_path):
    wh = broker.warehouse
    assert {p.name for p in (tmp_path / "wh").iterdir()} == set(TABLES)
    before = table_versions(tmp_path / "wh")
    again = wh.init(config=broker.config)
    assert again["created"] == [] and again["upgraded"] == {}
    assert table_versions(tmp_path / "wh") == before
    assert wh.schema_version() == SCHEMA_VERSION


def test_default_levels_seeded(broker):
    rows = broker.sql("SELECT level, delay_ms, label FROM schedule_levels ORDER BY level").collect()
    assert [r["label"] for r in rows] == "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h".split()
    assert rows[0]["delay_ms"] == 1000 and rows[-1]["delay_ms"] == 7_200_000


def test_levels_configurable_at_init(tmp_path):
    b = Broker.init(tmp_path / "custom", levels="2s 1m 3h")
    assert b.warehouse.levels() == [(1, 2000), (2, 60_000), (3, 10_800_000)]
    assert b.max_delay_level() == 3
    b.close()


def test_init_keeps_every_delay_level_and_says_when_it_changes_them(tmp_path, capsys):
    """``deltamq init --levels`` on a warehouse replaced its levels silently ("nothing to
    create or upgrade"), stranding a message held at a level that was removed. Fewer
    levels are refused with nothing written; a changed delay or a new level is said."""
    from deltamq.cli import main
    from deltamq.errors import ConfigError

    location = str(tmp_path / "wh")
    b = Broker.init(location, levels="1s 5s 1m")
    before = table_versions(tmp_path / "wh")
    with pytest.raises(ConfigError, match="has 2 delay levels; warehouse .* has 3"):
        Broker.init(location, levels="1s 5s")
    assert table_versions(tmp_path / "wh") == before and b.warehouse.levels() == [
        (1, 1000),
        (2, 5000),
        (3, 60_000),
    ]
    assert main(["init", "--levels", "1s 5s 2m 1h", "--warehouse", location]) == 0
    assert "delay levels are now: 1s 5s 2m 1h" in capsys.readouterr().out
    assert b.warehouse.levels() == [(1, 1000), (2, 5000), (3, 120_000), (4, 3_600_000)]
    assert main(["init", "--levels", "1s 5s 2m 1h", "--warehouse", location]) == 0
    assert "up to date: nothing to create or upgrade" in capsys.readouterr().out
    b.close()


@pytest.mark.spark  # also on Apache Spark: the upgrade to 7 rewrites queue_lock partitioned
def test_upgrade_v1_warehouse_in_place(tmp_path, broker):
    wh = Warehouse(broker.engine, tmp_path / "old")
    wh.init(config=broker.config, target_version=1)
    assert wh.schema_version() == 1
    assert not (tmp_path / "old" / "dq_results").exists()
    assert "instances" not in wh.table_columns("group_config")
    wh.engine.execute(
        f"MERGE INTO {wh.ref('topic_config')} t USING (SELECT 'kept' AS topic, 2 AS queues, 'RW' AS perm, "
        "FALSE AS ordered, CAST(1 AS BIGINT) AS created_ts, CAST(1 AS BIGINT) AS updated_ts) s "
        "ON t.topic = s.topic WHEN NOT MATCHED THEN INSERT *"
    )
    wh.engine.execute(
        f"MERGE INTO {wh.ref('queue_lock')} t USING (SELECT * FROM VALUES ('g', '%RETRY%g', 0, 'c1', "
        "CAST(5 AS BIGINT), CAST(7 AS BIGINT), 2) AS v(consumer_group, topic, queue_id, owner, "
        "last_access_ts, last_delivered_offset, no_change_count)) s ON t.topic = s.topic "
        "WHEN NOT MATCHED THEN INSERT *"
    )
    assert DeltaTable(str(tmp_path / "old" / "queue_lock")).metadata().partition_columns == []
    with pytest.raises(SchemaVersionError, match="run `deltamq init` to upgrade"):
        Broker.open(tmp_path / "old")
    done = Warehouse(broker.engine, tmp_path / "old").init(config=broker.config)
    assert done["from_version"] == 1
    assert done["created"] == ["producer_config", "clients", "dq_results"]  # dq_results at v4
    assert done["upgraded"] == {
        "group_config": [
            "instances",
            "invisible_time_ms",
            "dedup_window_ms",
            "sink_table",
            "sink_key_columns",
            "sink_transform",
        ],
        "consume_queue": ["born_ts"],
        "offsets": ["delivered_offset"],
        "queue_lock": ["delivered_offset", "partitioned by consumer_group, topic, queue_id"],
        "job_runs": ["details"],
        "leases": ["ttl_ms"],
    }
    locks = DeltaTable(str(tmp_path / "old" / "queue_lock"))
    assert locks.metadata().partition_columns == ["consumer_group", "topic", "queue_id"]
    assert locks.to_pyarrow_table().to_pylist() == [
        {"consumer_group": "g", "topic": "%RETRY%g", "queue_id": 0, "owner": "c1", "last_access_ts": 5,
         "last_delivered_offset": 7, "no_change_count": 2, "delivered_offset": None}
    ]  # fmt: skip
    upgraded = Broker.open(tmp_path / "old")
    assert upgraded.topics()["kept"]["queues"] == 2
    upgraded.create_group("g", "support.listeners:consume_all", mode="BROADCASTING", instances=["a", "b"])
    assert upgraded.groups()["g"].instances == ("a", "b")
    upgraded.close()


@pytest.mark.parametrize("bad", ["/tmp/a`b", "/tmp/a'b", "x;DROP", "", "/tmp/t[1]/wh", "s3://b/*"])
def test_hostile_warehouse_locations_refused(broker, bad):
    from deltamq.errors import ConfigError

    with pytest.raises(ConfigError):
        Warehouse(broker.engine, bad)


def test_sql_is_read_only_unless_asked(broker):
    from deltamq.errors import ReadOnlyQuery

    with pytest.raises(ReadOnlyQuery, match="write=True"):
        broker.sql("DELETE FROM topic_config")
    assert broker.sql("SELECT count(*) AS n FROM topic_config").collect()[0]["n"] == 0


@pytest.mark.spark  # also on Apache Spark with a local disk, where every other append is Spark's
def test_a_ticks_job_runs_are_appended_without_the_engine(broker, clock, tmp_path, monkeypatch):
    """A tick's ``job_runs`` rows are one append by deltamq's own writer on every engine
    (the engine never commits to that table after creating it): an idle tick that runs
    every job appends nothing through the engine, and its rows read back by SQL; past
    their reserved time, retention deletes them without the engine too."""
    broker.reconfigure(skip_idle_ticks=False)
    broker.tick(clock.now_ms())
    through_engine = []
    real = broker.engine.append
    monkeypatch.setattr(
        broker.engine,
        "append",
        lambda df, location, *a, **k: (through_engine.append(str(location)), real(df, location, *a, **k))[1],
    )
    before = table_versions(tmp_path / "wh")
    clock.advance(seconds=1)
    result = broker.tick(clock.now_ms())
    after = table_versions(tmp_path / "wh")
    assert through_engine == []
    assert {t for t in after if after[t] != before[t]} == {"job_runs"}
    assert after["job_runs"] == before["job_runs"] + 1
    rows = broker.sql(f"SELECT job FROM job_runs WHERE tick_id = '{result.tick_id}'").collect()
    assert sorted(r["job"] for r in rows) == sorted(j.job for j in result.jobs)
    # eight days on, retention prunes those rows, by delta-rs too
    statements = []
    execute = broker.engine.execute
    monkeypatch.setattr(broker.engine, "execute", lambda s: (statements.append(s), execute(s))[1])
    clock.advance(seconds=8 * 86_400)
    retain = broker.tick(clock.now_ms()).job("retain")
    assert retain.status == "OK" and retain.result.pruned["job_runs"] >= 2
    table = broker.warehouse.ref("job_runs")  # (the test's own folder is named after job_runs)
    assert through_engine == [] and not [s for s in statements if table in s]
    assert (
        broker.sql(f"SELECT count(*) AS n FROM job_runs WHERE tick_id = '{result.tick_id}'").collect()[0][0]
        == 0
    )
