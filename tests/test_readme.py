"""The README's code runs as written: every ```python and ```bash block, in order, in one
empty folder (so a later block finds what an earlier one made), against the embedded
engine — and the S3 samples against an S3 API server (moto). A block's info string may
say ``file=PATH`` (the block is that file's content: it is written, not run) or
``norun`` (set-up and test commands that .ci/run runs itself, and commands that need a
cluster or run for minutes: each such block says so in its first line), or ``spark``
(Apache Spark samples: run in order by the Spark tier, ``pytest --engine spark -m spark``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ENGINE, SPARK_ENGINES, create_bucket

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```\s*$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    info: str
    code: str

    @property
    def file(self) -> str | None:
        m = re.search(r"\bfile=(\S+)", self.info)
        return m.group(1) if m else None

    @property
    def runs(self) -> bool:
        return not {"norun", "spark"} & set(self.info.split())

    @property
    def spark(self) -> bool:
        return "spark" in self.info.split()


def blocks(text: str) -> list[Block]:
    return [
        Block(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2).strip(), m.group(3))
        for m in FENCE.finditer(text)
        if m.group(1) in ("python", "bash")
    ]


@pytest.mark.unit
def test_the_readme_blocks_are_found_and_every_skipped_one_says_why():
    found = blocks(README.read_text())
    assert sum(b.lang == "python" for b in found) >= 8 and sum(b.lang == "bash" for b in found) >= 5
    for b in found:
        if not b.runs:
            first = b.code.splitlines()[0]
            assert first.startswith("#"), (
                f"README line {b.line}: a norun block starts with a comment saying why"
            )


@pytest.mark.slow
def test_every_readme_sample_runs_as_written(tmp_path, s3_server):
    """Runs each block in README order in one fresh folder; the first failure names the
    README line."""
    create_bucket(s3_server.endpoint, "my-bucket")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTAMQ_", "AWS_"))}
    env.update(s3_server.options)  # the S3 samples' bucket lives on the emulator
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    ran = 0
    for b in blocks(README.read_text()):
        if b.file:
            target = tmp_path / b.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.code)
            continue
        if not b.runs:
            continue
        command = [sys.executable, "-c", b.code] if b.lang == "python" else ["bash", "-e", "-c", b.code]
        out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        said = f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
        assert out.returncode == 0, f"README line {b.line} ({b.lang}) exited {out.returncode}:\n{said}"
        ran += 1
    assert ran >= 10


@pytest.mark.spark
@pytest.mark.skipif(ENGINE not in SPARK_ENGINES, reason="needs Apache Spark: pytest --engine spark")
def test_the_readme_apache_spark_samples_run_as_written(tmp_path):
    """The Spark blocks, in README order, in one fresh folder: Spark's Connect server and
    the CLI against it, a classic spark-submit tick, a standalone cluster with the Connect
    server on it and a listener in an executor."""
    from deltamq.spark_setup import child_env

    env = {k: v for k, v in child_env().items() if not k.startswith(("DELTAMQ_", "AWS_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    ran = 0
    try:
        for b in blocks(README.read_text()):
            if not b.spark:
                continue
            out = subprocess.run(
                ["bash", "-e", "-c", b.code],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            logs = "".join(f"\n--- {p.name}:\n{p.read_text()[-2000:]}" for p in tmp_path.glob("*.log"))
            said = f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}{logs}"
            assert out.returncode == 0, f"README line {b.line} exited {out.returncode}:\n{said}"
            ran += 1
    finally:  # a block that failed half-way leaves its servers: stop them
        import signal

        for pids in [*tmp_path.glob("*.pid"), *tmp_path.glob("*.pids")]:
            for pid in pids.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
    assert ran == 3
