"""The allocator of a pull client's Arrow buffers (deltamq/arrow_memory.py):
jemalloc by default, a process's own choice kept, a bad name refused by name. The
environment cases run in a fresh interpreter: pyarrow reads ARROW_DEFAULT_MEMORY_POOL
once, when it starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pytest

from deltamq.arrow_memory import MEMORY_POOLS, use_pool
from deltamq.config import BrokerConfig
from deltamq.errors import ConfigError

pytestmark = pytest.mark.unit

PROBE = """
import sys
import pyarrow as pa
from deltamq.arrow_memory import use_pool
if sys.argv[2] != "-":
    pa.set_memory_pool(getattr(pa, sys.argv[2] + "_memory_pool")())  # the application's own choice
got = use_pool(sys.argv[1])
pool = getattr(pa, got + "_memory_pool")()
before = pool.total_bytes_allocated()
data = pa.array([b"x" * 1024] * 1024)  # 1 MiB of bodies: from the pool in use?
print(got, pa.default_memory_pool().backend_name, pool.total_bytes_allocated() - before >= 1 << 20)
"""


def _probe(choice: str, chosen: str = "-", **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, choice, chosen], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _built(name: str) -> bool:
    try:
        getattr(pa, f"{name}_memory_pool")()
    except NotImplementedError:
        return False
    return True


AUTO = "jemalloc" if _built("jemalloc") else "system"


def test_auto_switches_from_mimalloc_unless_the_process_chose_its_pool():
    assert _probe("auto") == [AUTO, AUTO, "True"]
    # the process's own choice stands: Arrow's variable, or pa.set_memory_pool
    assert _probe("auto", ARROW_DEFAULT_MEMORY_POOL="system") == ["system", "system", "True"]
    assert _probe("auto", ARROW_DEFAULT_MEMORY_POOL="mimalloc") == ["mimalloc", "mimalloc", "True"]
    assert _probe("auto", "system") == ["system", "system", "True"]
    # a variable Arrow could not use (it warns and keeps mimalloc) is no choice
    assert _probe("auto", ARROW_DEFAULT_MEMORY_POOL="tcmalloc") == [AUTO, AUTO, "True"]
    assert _probe("default", ARROW_DEFAULT_MEMORY_POOL="system") == ["system", "system", "True"]


@pytest.mark.parametrize("name", ["system", "mimalloc", "jemalloc"])
def test_a_named_pool_is_used_whatever_the_process_chose(name):
    if not _built(name):
        pytest.skip(f"this pyarrow has no {name}")
    other = "mimalloc" if name != "mimalloc" else "system"
    assert _probe(name, ARROW_DEFAULT_MEMORY_POOL=other) == [name, name, "True"]
    assert _probe(name, other) == [name, name, "True"]


def test_without_jemalloc_auto_falls_back_and_a_named_jemalloc_is_refused(monkeypatch):
    def missing():
        raise NotImplementedError("built without jemalloc")

    monkeypatch.setattr(pa, "jemalloc_memory_pool", missing)
    pa.set_memory_pool(pa.mimalloc_memory_pool())  # the conftest puts the test's pool back
    assert use_pool("auto", env={}) == "system" and pa.default_memory_pool().backend_name == "system"
    with pytest.raises(
        ConfigError, match=r"pull_memory_pool='jemalloc': this pyarrow was built without jemalloc"
    ):
        use_pool("jemalloc")


def test_a_bad_pool_name_is_refused_by_name_from_the_config_and_the_environment():
    with pytest.raises(ConfigError, match=r"pull_memory_pool='tcmalloc' is not allowed; use one of"):
        BrokerConfig(pull_memory_pool="tcmalloc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tcmalloc"):
        BrokerConfig.from_env({"DELTAMQ_PULL_MEMORY_POOL": "tcmalloc"})
    assert BrokerConfig.from_env({"DELTAMQ_PULL_MEMORY_POOL": "system"}).pull_memory_pool == "system"
    assert "auto" in MEMORY_POOLS and BrokerConfig().pull_memory_pool == "auto"
