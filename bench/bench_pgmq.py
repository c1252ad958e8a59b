"""Benchmark: PGMQ's read + delete on this machine, the figure the pull target is set against.

Starts a PostgreSQL server from the Debian package's binaries (default settings, a
scratch data folder, a Unix socket only; as the ``postgres`` user when run as root),
installs PGMQ from the SQL that the ``pgmq`` Python package ships, sends N messages
(a JSON document holding a 1 KiB string, as bench_pull.py's 1 KiB bodies) in batches
of 1 000, then drains them with client processes: each loops ``pgmq.read(queue, 30,
batch)`` → ``pgmq.delete(queue, ids)`` (each its own transaction) until a read returns
nothing. The documents come back as text, unparsed, as a pull hands bodies out as
bytes. Throughput = N / (last delete − first read), over every client.

Checks: every message read exactly once, and the queue empty at the end.

``measure(root, n, batch, clients)`` runs one configuration and returns its figures
(``bench_pull.py --vs-pgmq`` runs it beside each of its own). Writes
bench/results/pgmq-<timestamp>.json. A benchmark, not a test.

    apt-get install postgresql        # the server (Debian's package)
    pip install -e ".[bench]"          # psycopg and the pgmq package (its SQL)
    python bench/bench_pgmq.py [--messages 100000] [--batch 1000] [--clients 1 4]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).parent
QUEUE = "orders"

CLIENT = """
import json, sys, time
import psycopg
conninfo, queue, batch, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
conn = psycopg.connect(conninfo, autocommit=True)
time.sleep(max(0.0, go - time.time()))
first = time.time()
last = first
ids = []
while True:
    rows = conn.execute("SELECT msg_id, message::text FROM pgmq.read(%s, 30, %s)", (queue, batch)).fetchall()
    if not rows:
        break
    got = [r[0] for r in rows]
    deleted = conn.execute("SELECT pgmq.delete(%s, %s::bigint[])", (queue, got)).fetchall()
    if len(deleted) != len(got):
        raise SystemExit(f"deleted {len(deleted)} of {len(got)}")
    ids += got
    last = time.time()
conn.close()
print(json.dumps({"first": first, "last": last, "ids": ids}), flush=True)
"""


def _binaries() -> str:
    """The folder of PostgreSQL's server binaries (initdb, pg_ctl)."""
    found = shutil.which("pg_ctl")
    if found:
        return str(Path(found).resolve().parent)
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if versions:
        return str(Path(versions[-1]).parent)
    raise SystemExit("PostgreSQL's server is not installed: apt-get install postgresql")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def postgres(root: Path) -> Iterator[str]:
    """A PostgreSQL server with default settings in ``root``; yields its connection string."""
    bin_dir = _binaries()
    shutil.rmtree(root, ignore_errors=True)
    data, sock = root / "data", root / "socket"
    sock.mkdir(parents=True)
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    quiet = {"stdout": subprocess.DEVNULL, "check": True}
    subprocess.run([*as_user, f"{bin_dir}/initdb", "-D", str(data), "-U", "bench", "--auth=trust"], **quiet)
    port = _free_port()
    options = f"-p {port} -k {sock} -c listen_addresses=''"
    log = root / "server.log"
    start = [*as_user, f"{bin_dir}/pg_ctl", "-D", str(data), "-o", options, "-l", str(log), "-w", "start"]
    subprocess.run(start, **quiet)
    try:
        yield f"host={sock} port={port} user=bench dbname=postgres"
    finally:
        subprocess.run([*as_user, f"{bin_dir}/pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop"], **quiet)


def _pgmq_sql() -> tuple[str, str]:
    """PGMQ's installation SQL and its version, from the ``pgmq`` package."""
    from importlib.resources import files

    sql = files("pgmq").joinpath("sql")
    return sql.joinpath("pgmq.sql").read_text(), sql.joinpath("VERSION").read_text().strip()


def _body(i: int) -> str:
    """1 KiB of text, as bench_pull.py's bodies: a SHA-256 in hex, 16 times."""
    return hashlib.sha256(str(i).encode()).hexdigest() * 16


def measure(root: Path, n: int = 100_000, batch: int = 1000, clients: int = 1) -> dict:
    """Send ``n`` messages and drain them with ``clients`` processes at ``batch``."""
    import psycopg

    sql, version = _pgmq_sql()
    with postgres(Path(root) / f"pgmq-{n}-{clients}") as conninfo:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(sql)
            conn.execute("SELECT pgmq.create(%s)", (QUEUE,))
            for lo in range(0, n, 1000):
                docs = [json.dumps({"body": _body(i)}) for i in range(lo, min(n, lo + 1000))]
                conn.execute("SELECT pgmq.send_batch(%s, %s::jsonb[])", (QUEUE, docs))
            server = conn.execute("SHOW server_version").fetchone()
        go = time.time() + 1.0 + 0.5 * clients
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CLIENT, conninfo, QUEUE, str(batch), str(go)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(clients)
        ]
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"a PGMQ client failed (exit {p.returncode})")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        with psycopg.connect(conninfo, autocommit=True) as conn:
            left = conn.execute(f"SELECT count(*) FROM pgmq.q_{QUEUE}").fetchone()
    ids = [i for r in reports for i in r["ids"]]
    seconds = max(r["last"] for r in reports) - min(r["first"] for r in reports)
    return {
        "messages": n,
        "clients": clients,
        "batch": batch,
        "pgmq": version,
        "postgres": server[0] if server else None,
        "read": len(ids),
        "read_once": len(ids) == len(set(ids)) == n,
        "left_in_queue": left[0] if left else None,
        "seconds": round(seconds, 2),
        "msgs_per_s": round(n / seconds) if seconds > 0 else None,
        "per_client": [len(r["ids"]) for r in reports],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--root", default="/tmp/deltamq-bench-pgmq")
    args = ap.parse_args()
    runs = [measure(Path(args.root), args.messages, args.batch, c) for c in args.clients]
    for r in runs:
        print(
            f"PGMQ {r['pgmq']} (PostgreSQL {r['postgres']}), {r['clients']} client(s), batch {r['batch']}: "
            f"{r['msgs_per_s']} msgs/s, each read once: {r['read_once']}"
        )
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = HERE / "results" / f"pgmq-{stamp}.json"
    out.write_text(json.dumps({"bench": "pgmq", "at": stamp, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
