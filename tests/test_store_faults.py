"""The fault proxy (tests/support/fault_proxy.py) does what each fault kind says, on real
HTTP between a client and the S3 API server: the object store's faults are then tested
against deltamq's own clients (tests/test_faults_s3.py and the slow tier)."""

from __future__ import annotations

import functools
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest


@functools.cache
def _client(endpoint: str) -> Any:
    """A signed S3 client of ``endpoint`` that never retries (boto3)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="deltamq-test",
        aws_secret_access_key="deltamq-test-secret",
        region_name="us-east-1",
        config=Config(retries={"total_max_attempts": 1}, s3={"addressing_style": "path"}),
    )


def _request(endpoint: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """One signed S3 request, no retries: (HTTP status, body or error code)."""
    from botocore.exceptions import ClientError

    client = _client(endpoint)
    bucket, _, name = path.lstrip("/").partition("/")
    try:
        if method == "PUT":
            r = client.put_object(Bucket=bucket, Key=name, Body=body or b"")
            return r["ResponseMetadata"]["HTTPStatusCode"], b""
        r = client.get_object(Bucket=bucket, Key=name)
        return 200, r["Body"].read()
    except ClientError as e:
        meta = e.response.get("ResponseMetadata", {})
        return meta.get("HTTPStatusCode", 0), e.response.get("Error", {}).get("Code", "").encode()


@pytest.fixture
def key(s3_server):
    return f"/{s3_server.bucket}/proxy-{uuid.uuid4().hex[:8]}/object"


def test_without_faults_requests_pass_through(faults, s3_server, key):
    assert _request(faults.endpoint, "PUT", key, b"one")[0] == 200
    assert _request(faults.endpoint, "GET", key) == (200, b"one")
    assert _request(s3_server.endpoint, "GET", key) == (200, b"one")
    assert faults.state()["requests"] == 2 and not any(faults.state()["faulted"].values())


@pytest.mark.parametrize(
    "kind, status, code", [("slowdown", 503, b"SlowDown"), ("error500", 500, b"InternalError")]
)
def test_an_error_before_forwarding_writes_nothing(faults, s3_server, key, kind, status, code):
    faults.set(once=[{"kind": kind, "method": "PUT", "path_regex": key}])
    got_status, body = _request(faults.endpoint, "PUT", key, b"x")
    assert got_status == status and code in body
    assert _request(s3_server.endpoint, "GET", key)[0] == 404  # nothing happened
    assert faults.state()["faulted"][kind] == 1


def test_a_reset_drops_the_connection_and_writes_nothing(faults, s3_server, key):
    faults.set(once=[{"kind": "reset", "method": "PUT", "path_regex": key}])
    with pytest.raises(Exception, match="(?i)connection|reset|closed|endpoint"):
        _request(faults.endpoint, "PUT", key, b"x")
    assert _request(s3_server.endpoint, "GET", key)[0] == 404


def test_a_delay_holds_the_request(faults, key):
    faults.set(once=[{"kind": "delay", "method": "PUT", "path_regex": key}], delay_ms=400)
    start = time.monotonic()
    assert _request(faults.endpoint, "PUT", key, b"x")[0] == 200
    assert time.monotonic() - start >= 0.4


def test_a_lost_ack_writes_and_then_answers_500(faults, s3_server, key):
    """The ambiguous write: the PUT lands, the client sees an error."""
    faults.set(once=[{"kind": "lost_ack", "method": "PUT", "path_regex": key}])
    status, body = _request(faults.endpoint, "PUT", key, b"landed")
    assert status == 500 and b"InternalError" in body
    assert _request(s3_server.endpoint, "GET", key) == (200, b"landed")


def test_random_faults_follow_the_seed_and_the_rates(faults, key):
    def run() -> dict[str, int]:
        faults.set(seed=3, rates={"slowdown": 0.2, "error500": 0.1}, reset_counters=True)
        for _ in range(100):
            _request(faults.endpoint, "GET", key)
        return faults.state()["faulted"]

    first, second = run(), run()
    assert first == second  # same seed, same faults
    assert 8 <= first["slowdown"] <= 35 and 2 <= first["error500"] <= 20
    assert first["lost_ack"] == 0  # never on a GET


def test_bad_settings_are_refused_with_the_kinds_allowed(faults):
    with pytest.raises(urllib.error.HTTPError) as e:
        faults.set(rates={"meteor": 1.0})
    assert b"meteor" in e.value.read()


@pytest.mark.slow  # the store client's own back-off under a 100 % fault rate (~15 s)
def test_the_storage_seam_tries_a_faulted_request_again_and_names_what_fails(faults, s3_server, key):
    """deltamq's storage seam through the proxy: a reset and a 503 on the next two reads of
    a file are tried again; a store that keeps failing is a StorageError naming the file
    and the cause."""
    from deltamq.errors import StorageError
    from deltamq.storage import Storage

    assert _request(s3_server.endpoint, "PUT", key, b"hello")[0] == 200
    root = f"s3://{s3_server.bucket}"
    storage = Storage(root, faults.options, env={})
    path = root + key.removeprefix(f"/{s3_server.bucket}")
    for kind in ("reset", "slowdown"):
        faults.set(once=[{"kind": kind, "method": "GET", "path_regex": key + "$"}], reset_counters=True)
        assert storage.read_text(path) == "hello"
        assert faults.state()["faulted"][kind] == 1
    faults.set(rates={"slowdown": 1.0}, once=[])
    with pytest.raises(StorageError, match=rf"cannot read {path}: .*transient fault"):
        storage.read_text(path)
