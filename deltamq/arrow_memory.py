"""Which allocator a Spark-free pull client's Arrow buffers come from.

pyarrow allocates from mimalloc by default. A pull client decodes whole Parquet files
of bodies and drops them again as its queues move on. Four such clients on two cores
spent more time in the kernel than in their own code with mimalloc (its arenas are
committed up front and faulted in as transparent huge pages), and drained a queue about
half as fast as with jemalloc or the C library's allocator (bench/README.md, "Session 4
of 2026-11-29"). The broker's own passes were measured the other way round (dispatch
from the files ~20 % faster with mimalloc), so only the pull client switches, and only
when its process has not chosen: ``ARROW_DEFAULT_MEMORY_POOL`` set in the environment
is Arrow's own setting and wins over ``auto``.

The pool is a process-wide setting of pyarrow: buffers allocated before the switch stay
with the allocator that made them.
"""

from __future__ import annotations

import logging
import os
from typing import Literal, get_args

from deltamq.errors import ConfigError

log = logging.getLogger("deltamq.arrow_memory")

MemoryPool = Literal["auto", "jemalloc", "mimalloc", "system", "default"]
MEMORY_POOLS: tuple[str, ...] = get_args(MemoryPool)
"""``auto``: jemalloc (the C library's allocator where pyarrow was built without it),
unless ``ARROW_DEFAULT_MEMORY_POOL`` is set; ``default``: leave pyarrow's choice alone;
the others by name."""

ARROW_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def check_pool(choice: str) -> None:
    """ConfigError unless ``choice`` is one of :data:`MEMORY_POOLS`."""
    if choice not in MEMORY_POOLS:
        raise ConfigError(f"pull_memory_pool={choice!r} is not allowed; use one of {MEMORY_POOLS}")


def use_pool(choice: str, env: dict[str, str] | None = None) -> str:
    """Make ``choice`` (one of :data:`MEMORY_POOLS`) the process's default Arrow memory
    pool; the backend name in use afterwards. A named allocator pyarrow was built
    without is a ConfigError naming it."""
    import pyarrow as pa

    check_pool(choice)
    env = dict(os.environ) if env is None else env
    if choice == "default" or (choice == "auto" and env.get(ARROW_ENV)):
        return str(pa.default_memory_pool().backend_name)
    names = ("jemalloc", "system") if choice == "auto" else (choice,)
    for name in names:
        try:
            pool = getattr(pa, f"{name}_memory_pool")()
        except NotImplementedError as e:  # pyarrow built without it
            if choice != "auto":
                raise ConfigError(
                    f"pull_memory_pool={choice!r}: this pyarrow was built without {name} ({e}); "
                    f"use one of {MEMORY_POOLS}"
                ) from e
            continue
        if pa.default_memory_pool().backend_name != pool.backend_name:
            pa.set_memory_pool(pool)
            log.info("Arrow buffers of this process now come from %s", pool.backend_name)
        return str(pool.backend_name)
    return str(pa.default_memory_pool().backend_name)  # pragma: no cover - system is always built
