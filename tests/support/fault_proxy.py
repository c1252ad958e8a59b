"""A fault-injecting HTTP proxy in front of an S3 API server (moto), in its own process.

Every client of the object store — the engine (Sail, or Spark's S3A), delta-rs, the
storage seam, the Spark-free producer — is pointed at the proxy's endpoint instead of
the server's; the proxy forwards each request and, per request, with a seeded
probability per kind, injects a fault:

- ``slowdown``: answers 503 SlowDown before forwarding (nothing happened);
- ``error500``: answers 500 InternalError before forwarding (nothing happened);
- ``reset``: reads the request and resets the connection (nothing happened);
- ``delay``: holds the request ``delay_ms`` before forwarding it;
- ``lost_ack``: a PUT or POST is forwarded — the write happens — and then answered
  500 InternalError: the client cannot know that it landed.

Random faults can be limited to paths matching ``path_regex``. One-shot rules
(``once``: kind, method, path regex) fault the next request that matches them, which
is how a test puts a fault on one commit point. Rules and counters are read and set
over HTTP at ``/__faults__`` (GET: the counters; PUT: a JSON object of new settings),
a path no S3 request uses.

    python -m support.fault_proxy --target http://127.0.0.1:5000 --port 5001 [--seed 7]

prints ``READY <port>`` once it listens.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

KINDS = ("slowdown", "error500", "reset", "delay", "lost_ack")
CONTROL = "/__faults__"
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}
_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "lost_ack": (500, "InternalError", "We encountered an internal error. Please try again."),
}


def classify(path: str, query: str) -> str:
    """What an S3 request touches, for the counts by kind: a listing, a Delta log entry,
    a checkpoint, the last-checkpoint pointer, a data file, or something else."""
    if "list-type" in query or (path.count("/") <= 1 and not query.startswith("uploads")):
        return "list"
    name = path.rsplit("/", 1)[-1]
    if "/_delta_log/" in path:
        if name == "_last_checkpoint":
            return "_last_checkpoint"
        if ".checkpoint." in name:
            return "checkpoint"
        return "log entry" if name.endswith(".json") else "log other"
    return "parquet" if name.endswith(".parquet") else "other"


def table_of(path: str, query: str) -> str:
    """The Delta table a request touches: the folder above ``_delta_log``, or the
    folder a data file sits in above its partition folders (for a listing, those of
    its prefix)."""
    if "list-type" in query:
        prefixes = [p for p in query.split("&") if p.startswith("prefix=")]
        path = unquote(prefixes[0][len("prefix=") :]) if prefixes else ""
    parts = [p for p in unquote(path).split("/") if p]
    if "_delta_log" in parts:
        i = parts.index("_delta_log")
        return parts[i - 1] if i else "?"
    folders = [p for p in parts[:-1] if "=" not in p]  # partition folders are not tables
    return folders[-1] if folders else "?"


class Rules:
    """The proxy's settings and counters, shared by its request threads."""

    def __init__(self, seed: int) -> None:
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        self.rates: dict[str, float] = {}
        self.delay_ms = 200
        self.path_regex: re.Pattern[str] | None = None
        self.once: list[dict[str, Any]] = []
        self.requests = 0
        self.faulted: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.log: list[dict[str, Any]] = []  # the faulted requests, latest 500
        self.counts: dict[str, int] = {}  # "METHOD what" -> requests (what: classify())
        self.by_table: dict[str, int] = {}  # "METHOD table what" -> requests (table: table_of())

    def update(self, settings: dict[str, Any]) -> None:
        with self.lock:
            if "seed" in settings:
                self.rng = random.Random(settings["seed"])
            if "rates" in settings:
                unknown = set(settings["rates"]) - set(KINDS)
                if unknown:
                    raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {KINDS}")
                self.rates = {k: float(v) for k, v in settings["rates"].items()}
            if "delay_ms" in settings:
                self.delay_ms = int(settings["delay_ms"])
            if "path_regex" in settings:
                self.path_regex = re.compile(settings["path_regex"]) if settings["path_regex"] else None
            if "once" in settings:
                self.once = [dict(r) for r in settings["once"]]
            if settings.get("reset_counters"):
                self.requests = 0
                self.faulted = dict.fromkeys(KINDS, 0)
                self.log = []
                self.counts = {}
                self.by_table = {}

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "faulted": dict(self.faulted),
                "rates": dict(self.rates),
                "once_left": len(self.once),
                "log": list(self.log),
                "counts": dict(self.counts),
                "by_table": dict(self.by_table),
            }

    def count(self, method: str, path: str, query: str) -> None:
        what = f"{method} {classify(path, query)}"
        where = f"{method} {table_of(path, query)} {classify(path, query)}"
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1
            self.by_table[where] = self.by_table.get(where, 0) + 1

    def decide(self, method: str, path: str) -> str | None:
        """The fault for this request, or None (counted either way)."""
        with self.lock:
            self.requests += 1
            kind = self._one_shot(method, path) or self._random(method, path)
            if kind is not None:
                self.faulted[kind] += 1
                self.log = [*self.log[-499:], {"kind": kind, "method": method, "path": path}]
            return kind

    def _one_shot(self, method: str, path: str) -> str | None:
        for i, rule in enumerate(self.once):
            if rule.get("method", method) == method and re.search(rule.get("path_regex", ""), path):
                del self.once[i]
                return str(rule["kind"])
        return None

    def _random(self, method: str, path: str) -> str | None:
        if not self.rates or (self.path_regex is not None and not self.path_regex.search(path)):
            return None
        draw = self.rng.random()
        for kind in KINDS:
            rate = self.rates.get(kind, 0.0)
            if kind == "lost_ack" and method not in ("PUT", "POST"):
                continue
            if draw < rate:
                return kind
            draw -= rate
        return None


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # an answer goes out as headers, then body: with Nagle's algorithm the body waits for
    # the client's delayed ACK of the headers (40 ms a request, 7x moto's own latency)
    disable_nagle_algorithm = True
    target: tuple[str, int] = ("127.0.0.1", 0)
    rules: Rules

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        length = str(len(body))
        for k, v in headers:
            if k.lower() == "content-length" and self.command == "HEAD":
                length = v  # a HEAD answer carries the object's length, with no body
            elif k.lower() not in _HOP and k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, kind: str) -> None:
        status, code, message = _ERRORS[kind]
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self._send(status, [("Content-Type", "application/xml")], body)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.target, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body or None, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()

    def _control(self, body: bytes) -> None:
        try:
            if self.command == "PUT":
                self.rules.update(json.loads(body or b"{}"))
            payload, status = json.dumps(self.rules.state()).encode(), 200
        except (ValueError, KeyError, re.error) as e:
            payload, status = json.dumps({"error": str(e)}).encode(), 400
        self._send(status, [("Content-Type", "application/json")], payload)

    def _handle(self) -> None:
        body = self._body()
        if self.path.startswith(CONTROL):
            self._control(body)
            return
        parts = urlsplit(self.path)
        self.rules.count(self.command, parts.path, parts.query)
        kind = self.rules.decide(self.command, parts.path)
        if kind in ("slowdown", "error500"):
            self._error(kind)
            return
        if kind == "reset":
            self.close_connection = True
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            return
        if kind == "delay":
            time.sleep(self.rules.delay_ms / 1000)
        try:
            status, headers, payload = self._forward(body)
        except OSError:
            self._error("error500")
            return
        if kind == "lost_ack":
            self._error("lost_ack")
            return
        self._send(status, headers, payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle  # noqa: N815 - the base class's names


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the S3 API server, http://host:port")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    target = urlsplit(args.target)
    Proxy.target = (target.hostname or "127.0.0.1", target.port or 80)
    Proxy.rules = Rules(args.seed)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Proxy)
    server.daemon_threads = True
    print(f"READY {server.server_address[1]}", flush=True)
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()


class Faults:
    """A test's handle on a running proxy: its endpoint, the storage options that point a
    warehouse at it, and its settings and counters over ``/__faults__``."""

    def __init__(self, endpoint: str, options: dict[str, str]) -> None:
        self.endpoint = endpoint
        self.options = options

    def _call(self, method: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        import urllib.request

        data = json.dumps(settings).encode() if settings is not None else None
        request = urllib.request.Request(self.endpoint + CONTROL, data=data, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            out: dict[str, Any] = json.loads(response.read())
            return out

    def set(self, **settings: Any) -> dict[str, Any]:
        """New settings (``rates``, ``delay_ms``, ``path_regex``, ``once``, ``seed``,
        ``reset_counters``); returns the state."""
        return self._call("PUT", settings)

    def state(self) -> dict[str, Any]:
        return self._call("GET")

    def off(self) -> dict[str, Any]:
        """No more faults (the counters stay)."""
        return self.set(rates={}, once=[], path_regex=None)

    def reset(self) -> dict[str, Any]:
        """No faults and zeroed counters."""
        return self.set(rates={}, once=[], path_regex=None, reset_counters=True)
