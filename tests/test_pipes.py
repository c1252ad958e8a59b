"""Waiting on a child's pipe (deltamq/pipes.py) works for descriptors select() refuses."""

from __future__ import annotations

import os
import resource
import select

import pytest

from deltamq.pipes import readable

pytestmark = pytest.mark.unit


def test_a_pipe_past_descriptor_1024_is_waited_on():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 1500:
        pytest.skip(f"this process may open {soft} files: no descriptor past 1 024 to try")
    read_end, write_end = os.pipe()
    high = os.dup2(read_end, 1500)
    try:
        with open(high, "rb", buffering=0, closefd=False) as stream:
            with pytest.raises(ValueError, match="filedescriptor out of range"):
                select.select([stream], [], [], 0)  # what deltamq waited with before
            assert not readable(stream, 0.01)
            os.write(write_end, b"x")
            assert readable(stream, 1.0) and stream.read(1) == b"x"
            os.close(write_end)
            write_end = -1
            assert readable(stream, 1.0)  # the other end closed: a read returns at once
    finally:
        for fd in (read_end, high, write_end):
            if fd >= 0:
                os.close(fd)
