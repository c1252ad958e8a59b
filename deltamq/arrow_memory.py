"""Which allocator a pull client's Arrow buffers come from.

pyarrow allocates from mimalloc by default. A pull client decodes whole Parquet files
of bodies and drops them again as its queues move on. Four such clients on two cores
spent more time in the kernel than in their own code with mimalloc (its arenas are
committed up front and faulted in as transparent huge pages), and drained a queue about
half as fast as with jemalloc or the C library's allocator (the Spark-free client,
``deltamq.lite.PullConsumer``; the broker's, ``Broker.pull_consumer``, drained 1.8-2.4 x
faster with four clients on jemalloc, its system time not measured; bench/README.md,
"Session 4 of 2026-11-29"). The broker's own passes were measured the
other way round (dispatch from the files ~20 % faster with mimalloc), so a process
switches when it creates a pull client, not before, and only when it has not chosen:
under ``auto`` a process whose pool is not mimalloc (``pa.set_memory_pool`` called, or
``ARROW_DEFAULT_MEMORY_POOL`` naming another allocator) keeps it, and so does one whose
``ARROW_DEFAULT_MEMORY_POOL`` names mimalloc.

The pool is a process-wide setting of pyarrow, so a process that runs ticks and pull
clients runs its ticks on the clients' pool too. Buffers allocated before the switch
stay with the allocator that made them. pyarrow's own
allocations below its Python bindings (a Parquet writer's internals, a filter by
expression, delta-rs) keep Arrow's C++ default; the decoded files, the bulk of a
client's memory, come from the chosen pool (``Storage.read_parquet`` opens local files
itself for that).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Literal, get_args

from deltamq.errors import ConfigError

log = logging.getLogger("deltamq.arrow_memory")

MemoryPool = Literal["auto", "jemalloc", "mimalloc", "system", "default"]
MEMORY_POOLS: tuple[str, ...] = get_args(MemoryPool)
"""``auto``: jemalloc (the C library's allocator where pyarrow was built without it)
when the process's pool is pyarrow's mimalloc and nothing asked for mimalloc;
``default``: leave the process's pool alone; the others by name."""

ARROW_ENV = "ARROW_DEFAULT_MEMORY_POOL"


def check_pool(choice: str) -> None:
    """ConfigError unless ``choice`` is one of :data:`MEMORY_POOLS`."""
    if choice not in MEMORY_POOLS:
        raise ConfigError(f"pull_memory_pool={choice!r} is not allowed; use one of {MEMORY_POOLS}")


def use_pool(choice: str, env: Mapping[str, str] | None = None) -> str:
    """Make ``choice`` (one of :data:`MEMORY_POOLS`) the process's default Arrow memory
    pool; the backend name in use afterwards. A named allocator pyarrow was built
    without is a ConfigError naming it. ``env``: the environment (``os.environ``)."""
    import pyarrow as pa

    check_pool(choice)
    current = str(pa.default_memory_pool().backend_name)
    env = os.environ if env is None else env
    if choice == "default" or (
        choice == "auto" and (current != "mimalloc" or env.get(ARROW_ENV, "").strip().lower() == "mimalloc")
    ):
        return current
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
        if current != pool.backend_name:
            pa.set_memory_pool(pool)
            log.info("Arrow buffers of this process now come from %s", pool.backend_name)
        return str(pool.backend_name)
    return current  # pragma: no cover - the system allocator is always built
