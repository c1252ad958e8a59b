"""The allocator of a Spark-free pull client's Arrow buffers (deltamq/arrow_memory.py):
jemalloc by default, the process's own ARROW_DEFAULT_MEMORY_POOL respected, a bad name
refused by name. Each case runs in a fresh interpreter: the pool is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deltamq.arrow_memory import MEMORY_POOLS
from deltamq.config import BrokerConfig
from deltamq.errors import ConfigError

pytestmark = pytest.mark.unit

PROBE = """
import sys
import pyarrow as pa
from deltamq.arrow_memory import use_pool
got = use_pool(sys.argv[1])
print(got, pa.default_memory_pool().backend_name, pa.array([b"x" * 100]).buffers()[2] is not None)
"""


def _probe(choice: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, choice],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def _built(name: str) -> bool:
    import pyarrow as pa

    try:
        getattr(pa, f"{name}_memory_pool")()
    except NotImplementedError:
        return False
    return True


def test_auto_switches_to_jemalloc_unless_the_process_chose_its_pool():
    want = "jemalloc" if _built("jemalloc") else "system"
    assert _probe("auto") == [want, want, "True"]
    # Arrow's own setting wins over auto, and "default" leaves pyarrow's choice alone
    assert _probe("auto", ARROW_DEFAULT_MEMORY_POOL="system") == ["system", "system", "True"]
    assert _probe("default", ARROW_DEFAULT_MEMORY_POOL="system") == ["system", "system", "True"]


@pytest.mark.parametrize("name", ["system", "mimalloc", "jemalloc"])
def test_a_named_pool_is_used_whatever_the_environment_says(name):
    if not _built(name):
        pytest.skip(f"this pyarrow has no {name}")
    other = "mimalloc" if name != "mimalloc" else "system"
    assert _probe(name, ARROW_DEFAULT_MEMORY_POOL=other) == [name, name, "True"]


def test_a_bad_pool_name_is_refused_by_name_from_the_config_and_the_environment():
    with pytest.raises(ConfigError, match=r"pull_memory_pool='tcmalloc' is not allowed; use one of"):
        BrokerConfig(pull_memory_pool="tcmalloc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tcmalloc"):
        BrokerConfig.from_env({"DELTAMQ_PULL_MEMORY_POOL": "tcmalloc"})
    assert BrokerConfig.from_env({"DELTAMQ_PULL_MEMORY_POOL": "system"}).pull_memory_pool == "system"
    assert "auto" in MEMORY_POOLS and BrokerConfig().pull_memory_pool == "auto"
