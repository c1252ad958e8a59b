"""The storage seam: one place that turns a warehouse location and its credentials into
what every component needs, and the only way deltamq touches files itself.

A warehouse is a local path, a ``file://`` URI, or an object-store URI: ``s3://`` (or
``s3a://``, classic Spark's spelling, the same bucket), ``abfss://`` / ``abfs://`` /
``az://`` (Azure Data Lake Storage / Blob), or ``gs://`` (Google Cloud Storage).
:class:`Storage` gives

* the engine its paths (classic Spark reads S3 through Hadoop's ``s3a://``; Sail and
  Spark Connect servers take ``s3://``) and, for the embedded Sail server, the
  environment it must start with (Sail reads the standard ``AWS_*`` / ``AZURE_*`` /
  ``GOOGLE_*`` variables); for classic Spark the ``spark.hadoop.fs.s3a.*`` lines;
* delta-rs (the ``deltalake`` package: retention deletes, compaction, vacuum,
  checkpoints, the Spark-free producer) its ``storage_options``;
* deltamq itself a small filesystem — list a directory, read a file, a file's size,
  delete a file — used for the Delta commit entries dispatch reads, the integrity
  check, log cleanup and existence checks. Local paths use ``os`` directly (today's
  speed); object stores use delta-rs' object-store client through pyarrow's
  filesystem interface, so the same options and credentials reach every component.

Credentials and endpoints come from the standard environment variables or from
``BrokerConfig.storage_options`` (which win); they are never printed (the repr of a
:class:`Storage` shows only option names) and never written to a table.

Commit safety (docs/storage.md): two writers racing for the same Delta log version must
not both win. Sail and delta-rs write each commit entry as a put-if-absent (on S3 a PUT
with ``If-None-Match: *``; checked against an S3 API server: the loser gets 412 and
retries or reports a conflict). The seam sets ``AWS_CONDITIONAL_PUT=etag`` for every
component and refuses any other value (``disabled`` would make every commit fail, or
with an older client, race unprotected).

Every failure to list, read or write names the URI and the cause (a missing bucket,
no or rejected credentials, access denied, an unreachable endpoint): :class:`StorageError`.
"""

from __future__ import annotations

import io
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar
from urllib.parse import unquote

from deltamq.config import CommitPolicy
from deltamq.errors import ConfigError, DeltaMQError, StorageError, UnsafeStorage, VersionTaken
from deltamq.store_faults import describe_cause, error_detail, is_transient

T = TypeVar("T")

STORE_ATTEMPTS = 4
"""Tries of one idempotent request of the storage seam after transient faults (the engine
and delta-rs retry their own requests; commits re-run their attempt: Engine.commit)."""

Kind = Literal["local", "s3", "azure", "gcs"]

_URI = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
_SCHEMES: dict[str, Kind] = {
    "file": "local",
    "s3": "s3",
    "s3a": "s3",
    "abfss": "azure",
    "abfs": "azure",
    "az": "azure",
    "gs": "gcs",
}
# environment variables (and option names) each store reads
_PREFIXES: dict[Kind, tuple[str, ...]] = {
    "local": (),
    "s3": ("AWS_",),
    "azure": ("AZURE_",),
    "gcs": ("GOOGLE_",),
}
# quotes, backticks and semicolons could break SQL quoting; Sail reads * ? [ ] { } in a
# path as a glob (a warehouse at /tmp/t[1]/wh read another table's files): docs/engines.md
_FORBIDDEN_IN_PATH = ("`", "'", '"', "\n", "\r", "\x00", ";", "*", "?", "[", "]", "{", "}")

# Commit safety on S3 (docs/storage.md)
CONDITIONAL_PUT = "AWS_CONDITIONAL_PUT"


def split_uri(location: str) -> tuple[str | None, str]:
    """``("s3", "bucket/wh")`` for a URI, ``(None, path)`` for a plain path."""
    m = _URI.match(location)
    return (m.group(1).lower(), m.group(2)) if m else (None, location)


def normalize_location(location: str | os.PathLike[str]) -> str:
    """An absolute local path, or a URI without a trailing slash (``s3a://`` becomes
    ``s3://``, ``file://`` a plain path). Refuses characters that could break SQL
    quoting and schemes no component can reach."""
    text = os.fspath(location)
    if not text:
        raise ConfigError("the warehouse location is empty; give a directory or a URI")
    bad = [c for c in _FORBIDDEN_IN_PATH if c in text]
    if bad:
        raise ConfigError(
            f"warehouse location {text!r} contains {bad!r}; quotes, backticks, semicolons, "
            "control characters and the glob characters * ? [ ] { } are not allowed"
        )
    if text.startswith("file:") and not text.startswith("file://"):
        text = "file://" + text[len("file:") :]  # Hadoop's file:/path
    scheme, rest = split_uri(text)
    if scheme is None:
        return os.path.abspath(text)
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"warehouse location {text!r} has scheme {scheme}://, which deltamq cannot reach; use "
            "a local path, file://, s3:// (s3a://), abfss://, abfs://, az:// or gs://"
        )
    if scheme == "file":
        host, _, path = rest.partition("/")
        if host not in ("", "localhost"):
            raise ConfigError(f"warehouse location {text!r} names host {host!r}; a file:// URI must be local")
        return os.path.abspath("/" + unquote(path))
    rest = rest.rstrip("/")
    if not rest.split("/", 1)[0]:
        raise ConfigError(f"warehouse location {text!r} names no bucket or container")
    return f"{'s3' if scheme == 's3a' else scheme}://{rest}"


def kind_of(location: str) -> Kind:
    scheme, _ = split_uri(location)
    return "local" if scheme is None else _SCHEMES.get(scheme, "local")


def canonical_options(options: Mapping[str, Any] | None) -> dict[str, str]:
    """Option names upper-cased (``aws_region`` → ``AWS_REGION``, the spelling of the
    environment variables); values as strings."""
    out: dict[str, str] = {}
    for key, value in (options or {}).items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_]+", key):
            raise ConfigError(f"storage option name {key!r} is not allowed; use names like AWS_REGION")
        out[key.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


@dataclass(frozen=True)
class Entry:
    """A file found by :meth:`Storage.list`."""

    name: str
    size: int
    mtime_s: float | None  # seconds since the epoch, when the store says


class Storage:
    """One warehouse location and its credentials; see the module docstring.

    Example:
        >>> s = Storage("s3://bucket/wh", {"aws_region": "us-east-1"}, env={})
        >>> s.join("commit_log", "_delta_log")
        's3://bucket/wh/commit_log/_delta_log'
        >>> s.delta_rs_options()["AWS_CONDITIONAL_PUT"]
        'etag'
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        options: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.location = normalize_location(location)
        self.kind: Kind = kind_of(self.location)
        # Hadoop-based engines read S3 as s3a://: kept when the user spelled it so
        self._s3a = os.fspath(location).lower().startswith("s3a://")
        self._explicit = canonical_options(options)
        environ = os.environ if env is None else env
        prefixes = _PREFIXES[self.kind]
        from_env = {k: v for k, v in environ.items() if k.startswith(prefixes)} if prefixes else {}
        self._env = environ
        self._options = from_env | self._explicit
        self._fs: Any = None
        self._obstore: Any = None
        self._check_commit_safety()

    def at(self, location: str | os.PathLike[str]) -> Storage:
        """The same options and credentials for another location (a sink table)."""
        return Storage(location, self._explicit, env=self._env)

    def __repr__(self) -> str:  # never the values: they hold credentials
        return f"Storage({self.location!r}, options={sorted(self._options)})"

    @property
    def is_local(self) -> bool:
        return self.kind == "local"

    # --- paths ---------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        """``location/part/...`` (a path or a URI, like the location)."""
        return "/".join([self.location.rstrip("/"), *(p.strip("/") for p in parts if p)])

    def engine_path(self, path: str, hadoop: bool) -> str:
        """The spelling the engine reads: Apache Spark (Hadoop, classic or behind a Spark
        Connect server) reads S3 as ``s3a://``; Sail reads both."""
        if path.startswith("s3://") and (hadoop or self._s3a):
            return "s3a://" + path[len("s3://") :]
        return path

    def absolute(self, table_path: str, path: str) -> str:
        """A Delta log's file path (relative and URL-encoded, or absolute) as a path or URI
        under ``table_path``."""
        if path.startswith("file:"):
            return normalize_location(path)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path):
            return path
        if self.is_local:
            return os.path.join(table_path, unquote(path))
        return f"{table_path}/{unquote(path)}"

    def delta_table(self, path: str, **kwargs: Any) -> Any:
        """delta-rs' ``DeltaTable`` at ``path`` (a table under this location, or a sink's),
        with this location's options; a store error becomes a StorageError naming it."""
        try:
            from deltalake import DeltaTable
        except ImportError as e:  # pragma: no cover - the broker and producer extras depend on it
            raise ImportError(
                f'reaching {path} needs the deltalake package: pip install "deltamq[broker]"'
            ) from e
        return self._retrying(
            "open the Delta table",
            path,
            lambda: DeltaTable(path, storage_options=self.delta_rs_options() or None, **kwargs),
        )

    # --- what each component needs -------------------------------------------------------
    def delta_rs_options(self) -> dict[str, str]:
        """``storage_options`` for the ``deltalake`` package (delta-rs)."""
        out = dict(self._options)
        if self.kind == "s3":
            out.update(self._s3_commit_settings())
        return out

    def engine_env(self) -> dict[str, str]:
        """Environment an embedded Sail server needs for this location beyond the process's
        own: the explicit options, and the S3 commit-safety settings."""
        out = dict(self._explicit)
        if self.kind == "s3":
            out.update(self._s3_commit_settings())
        return out

    def spark_conf(self) -> dict[str, str]:
        """``spark.hadoop.fs.s3a.*`` settings for classic Spark (spark-submit ``--conf``)."""
        if self.kind != "s3":
            return {}
        o = self._options
        conf: dict[str, str] = {}
        pairs = {
            "AWS_ACCESS_KEY_ID": "access.key",
            "AWS_SECRET_ACCESS_KEY": "secret.key",
            "AWS_SESSION_TOKEN": "session.token",
            "AWS_REGION": "endpoint.region",
        }
        for key, name in pairs.items():
            if o.get(key):
                conf[f"spark.hadoop.fs.s3a.{name}"] = o[key]
        endpoint = o.get("AWS_ENDPOINT_URL") or o.get("AWS_ENDPOINT")
        if endpoint:
            conf["spark.hadoop.fs.s3a.endpoint"] = endpoint
            conf["spark.hadoop.fs.s3a.path.style.access"] = "true"
            if endpoint.startswith("http://"):
                conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] = "false"
        if "AWS_SESSION_TOKEN" in o:
            conf["spark.hadoop.fs.s3a.aws.credentials.provider"] = (
                "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
            )
        return conf

    def _s3_commit_settings(self) -> dict[str, str]:
        return {CONDITIONAL_PUT: "etag"}

    def _check_commit_safety(self) -> None:
        if self.kind != "s3":
            return
        put = self._options.get(CONDITIONAL_PUT)
        if put is not None and put.lower() != "etag":
            raise UnsafeStorage(
                f"{CONDITIONAL_PUT}={put!r} is set for {self.location}: Delta commits on S3 are safe "
                "with concurrent writers only through conditional writes (If-None-Match); unset it or "
                f"set {CONDITIONAL_PUT}=etag. A store that cannot do conditional writes cannot hold a "
                "deltamq warehouse (docs/storage.md)"
            )

    # --- files ---------------------------------------------------------------------------
    def _remote(self) -> Any:
        if self._fs is None:
            try:
                from deltalake.fs import DeltaStorageHandler
                from pyarrow.fs import PyFileSystem
            except ImportError as e:  # pragma: no cover - the broker extra depends on it
                raise ImportError(
                    f'reaching {self.location} needs the deltalake package: pip install "deltamq[broker]"'
                ) from e
            self._fs = PyFileSystem(DeltaStorageHandler(self.location, self.delta_rs_options()))
        return self._fs

    def _retrying(self, action: str, path: str, request: Callable[[], T]) -> T:
        """``request()`` to the object store. Every request made here is idempotent (list,
        read, look up, delete), so a transient fault (``is_transient``) is tried again,
        with back-off, up to ``STORE_ATTEMPTS`` times; what fails is a StorageError
        naming ``path`` and the cause."""
        for attempt in range(STORE_ATTEMPTS):
            try:
                return request()
            except Exception as e:  # noqa: BLE001 - every store error becomes a StorageError
                if attempt + 1 < STORE_ATTEMPTS and is_transient(e):
                    time.sleep(0.05 * 2**attempt * (1 + random.random()))
                    continue
                raise self.error(action, path, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _key(self, path: str) -> str:
        """A path under the location as the remote filesystem names it (relative)."""
        root = self.location.rstrip("/") + "/"
        if path == self.location:
            return ""
        if not path.startswith(root):
            raise ValueError(f"{path} is not under the warehouse {self.location}")
        return path[len(root) :]

    def list(self, directory: str, *, recursive: bool = False) -> list[Entry]:
        """The files directly in ``directory`` ([] when it does not exist); with
        ``recursive``, every file below it, named by its path relative to ``directory``."""
        if self.is_local and recursive:
            out = []
            for root, _, files in os.walk(directory):
                for f in files:
                    st = os.stat(os.path.join(root, f))
                    rel = os.path.relpath(os.path.join(root, f), directory)
                    out.append(Entry(rel, st.st_size, st.st_mtime))
            return out
        if self.is_local:
            try:
                with os.scandir(directory) as it:
                    out = []
                    for e in it:
                        if e.is_file():
                            st = e.stat()
                            out.append(Entry(e.name, st.st_size, st.st_mtime))
                    return out
            except FileNotFoundError:
                return []
            except OSError as e:
                raise self.error("list", directory, e) from e
        from pyarrow.fs import FileSelector, FileType

        key = self._key(directory)
        selector = FileSelector(key, allow_not_found=True, recursive=recursive)
        infos = self._retrying("list", directory, lambda: self._remote().get_file_info(selector))
        return [
            Entry(
                i.path[len(key) :].lstrip("/") if recursive else i.base_name,
                i.size or 0,
                i.mtime.timestamp() if i.mtime else None,
            )
            for i in infos
            if i.type == FileType.File
        ]

    def read_text(self, path: str) -> str:
        if self.is_local:
            try:
                with open(path, encoding="utf-8") as fh:
                    return fh.read()
            except OSError as e:
                raise self.error("read", path, e) from e

        def read() -> str:
            with self._remote().open_input_stream(self._key(path)) as fh:
                text: str = fh.read().decode("utf-8")
                return text

        return self._retrying("read", path, read)

    def sizes(self, paths: Iterable[str]) -> dict[str, int | None]:
        """Each path's size in bytes, None for a missing file."""
        paths = list(paths)
        if self.is_local:
            out: dict[str, int | None] = {}
            for p in paths:
                try:
                    out[p] = os.path.getsize(p)
                except FileNotFoundError:
                    out[p] = None
                except OSError as e:
                    raise self.error("read", p, e) from e
            return out
        from pyarrow.fs import FileType

        out = {}
        for p in paths:
            info = self._retrying("read", p, partial(self._remote().get_file_info, self._key(p)))
            out[p] = info.size if info.type == FileType.File else None
        return out

    def delete(self, path: str) -> bool:
        """Delete a file; False when it was already gone (a local file; an object store's
        delete does not say, and answers True)."""
        if self.is_local:
            try:
                os.remove(path)
                return True
            except FileNotFoundError:
                return False
            except OSError as e:
                raise self.error("delete", path, e) from e
        try:
            self._retrying("delete", path, partial(self._remote().delete_file, self._key(path)))
            return True
        except StorageError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return False
            raise

    # --- writing files (blind appends without an engine: deltamq.delta_append) ----------
    def put(self, path: str, data: bytes | Callable[[Any], None]) -> int:
        """Write a new file at ``path`` whole: ``data``, or what ``data(sink)`` writes to a
        local path (a temporary file then renamed: large files are not held in memory) or a
        buffer (object stores). Returns its size; a failed write leaves nothing there."""
        if self.is_local:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                size = os.path.getsize(tmp := _beside(path, data))
                os.replace(tmp, path)
                return size
            except OSError as e:
                raise self.error("write", path, e) from e
        if callable(data):
            buf = io.BytesIO()
            data(buf)
            data = buf.getvalue()
        import obstore

        store, body = self._object_store(), data
        self._retrying("write", path, lambda: obstore.put(store, self._key(path), body))
        return len(body)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists: True when this call created
        it, False when it was there (a Delta commit entry: the race for a log version). On
        S3 a PUT with ``If-None-Match: *``; locally a hard link, which fails on an existing
        name. A False after a fault may be this writer's own earlier attempt (the write
        landed, its answer was lost): the caller tells by the content."""
        if self.is_local:
            tmp = ""
            try:
                tmp = _beside(path, data)
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                raise self.error("write", path, e) from e
            finally:
                if tmp:
                    try:
                        os.remove(tmp)
                    except OSError:
                        pass
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        store = self._object_store()

        def create() -> bool:
            try:
                obstore.put(store, self._key(path), data, mode="create")
                return True
            except (AlreadyExistsError, PreconditionError):
                return False

        return self._retrying("write", path, create)

    def exists(self, path: str) -> bool:
        """Whether the file ``path`` exists: one HEAD request on an object store (a
        filesystem's look-up of a missing name also lists it, to tell a directory)."""
        if self.is_local:
            return os.path.exists(path)
        import obstore
        from obstore.exceptions import NotFoundError

        store = self._object_store()

        def head() -> bool:
            try:
                obstore.head(store, self._key(path))
                return True
            except (NotFoundError, FileNotFoundError):  # obstore raises the built-in one
                return False

        return self._retrying("read", path, head)

    def read_bytes(self, path: str) -> bytes | None:
        """A file's bytes; None when it does not exist."""
        if self.is_local:
            try:
                with open(path, "rb") as fh:
                    return fh.read()
            except FileNotFoundError:
                return None
            except OSError as e:
                raise self.error("read", path, e) from e
        import obstore
        from obstore.exceptions import NotFoundError

        store = self._object_store()

        def get() -> bytes | None:
            try:
                return bytes(obstore.get(store, self._key(path)).bytes())
            except (NotFoundError, FileNotFoundError):
                return None

        return self._retrying("read", path, get)

    def read_parquet(self, path: str, schema: Any, group: tuple[Any, int] | None = None) -> Any:
        """The Parquet file at ``path`` as a pyarrow Table of ``schema``'s columns, in its
        types (another engine's file may spell a type differently); a column the file
        lacks is all null. ``group`` (local files): (its footer, :meth:`parquet_metadata`;
        a row group index) reads that row group only. A local file is opened here: pyarrow
        opening a path reads it into Arrow's C++ pool, not pa.set_memory_pool's."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        def columns(source: Any) -> Any:
            file = pq.ParquetFile(source, metadata=group[0] if group else None)
            wanted = _present(file, schema)
            return file.read_row_group(group[1], columns=wanted) if group else file.read(columns=wanted)

        if self.is_local:
            try:
                with pa.OSFile(path) as source:
                    table = columns(source)
            except OSError as e:
                raise self.error("read", path, e) from e
        else:
            data = self.read_bytes(path)
            if data is None:
                raise self.error("read", path, FileNotFoundError(path))
            table = columns(pa.BufferReader(data))
        return _conformed(table, schema)

    def parquet_batches(self, path: str, schema: Any, group: tuple[Any, int], rows: int) -> Iterator[Any]:
        """One row group of the local Parquet file at ``path`` (``group`` as for
        :meth:`read_parquet`) as pyarrow Tables of ``schema``'s columns, ``rows`` at a
        time, front to back: a large group decoded whole is a fresh allocation of its full
        size, faulted in page by page, where small batches reuse the same memory. The
        file stays open until the iterator ends or is closed."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.is_local:
            raise ValueError(f"{path}: row groups are read from local files only")
        try:
            source = pa.OSFile(path)
        except OSError as e:
            raise self.error("read", path, e) from e
        with source:
            try:
                file = pq.ParquetFile(source, metadata=group[0])
            except OSError as e:
                raise self.error("read", path, e) from e
            batches = file.iter_batches(
                batch_size=rows, row_groups=[group[1]], columns=_present(file, schema), use_threads=False
            )
            while True:
                try:
                    batch = next(batches, None)
                except OSError as e:
                    raise self.error("read", path, e) from e
                if batch is None:
                    return
                yield _conformed(pa.Table.from_batches([batch]), schema)

    def parquet_metadata(self, path: str) -> Any:
        """The footer of the local Parquet file at ``path`` (its row groups), for
        :meth:`read_parquet` of one row group."""
        import pyarrow.parquet as pq

        if not self.is_local:
            raise ValueError(f"{path}: row groups are read from local files only")
        try:
            return pq.read_metadata(path)
        except OSError as e:
            raise self.error("read", path, e) from e

    def _object_store(self) -> Any:
        """An obstore client of the location (the object_store crate delta-rs uses: the
        same option names), for writes with a condition; built once."""
        if self._obstore is None:
            try:
                from obstore.store import from_url
            except ImportError as e:  # pragma: no cover - the producer extra depends on it
                raise ImportError(
                    f'writing to {self.location} needs the obstore package: pip install "deltamq[producer]"'
                ) from e
            config, client = _object_store_options(self.kind, self.delta_rs_options())
            for _ in range(len(config) + 1):
                try:
                    self._obstore = from_url(self.location, config=config, client_options=client)  # type: ignore[call-overload]
                    break
                except Exception as e:  # noqa: BLE001 - an option object_store does not take
                    unknown = re.search(r"key: '([^']+)' is not valid", str(e))
                    if type(e).__name__ != "UnknownConfigurationKeyError" or unknown is None:
                        raise self.error("reach", self.location, e) from e
                    # options only delta-rs reads (AWS_S3_ALLOW_UNSAFE_RENAME, ...) or other
                    # tools' variables from the environment (AWS_PROFILE, ...)
                    config = {k: v for k, v in config.items() if k.lower() != unknown.group(1)}
        return self._obstore

    def is_delta_table(self, path: str) -> bool:
        """Whether ``path`` holds a Delta table (its ``_delta_log`` has a commit or a
        checkpoint). A store that cannot be listed raises :class:`StorageError`."""
        return any(e.name.endswith((".json", ".parquet")) for e in self.list(path + "/_delta_log"))

    def check_reachable(self) -> None:
        """List the location once: a missing bucket, missing or rejected credentials or an
        unreachable endpoint raise :class:`StorageError` here, before any job runs."""
        if not self.is_local:
            self.list(self.location)

    # --- errors --------------------------------------------------------------------------
    def error(self, action: str, path: str, cause: BaseException) -> StorageError:
        detail = error_detail(cause)
        for name, value in self._options.items():  # a key or token the store echoed back
            if len(value) >= 6 and _SECRET_OPTION.search(name):
                detail = detail.replace(value, "***")
        return StorageError(f"cannot {action} {path}: {describe_cause(cause)} ({detail})")


_SECRET_OPTION = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL|SAS|SIGNATURE|CONNECTION|AUTH", re.I)
"""Storage options whose values an error must not show (a region or an endpoint is shown:
it says where the store was looked for)."""


def retry_commits(
    attempt: Callable[[], T], policy: CommitPolicy, give_up: Callable[[Exception, bool], BaseException]
) -> T:
    """``attempt()`` (a delta-rs write, or a conditional commit) again, with back-off,
    while delta-rs' conflict checker refuses its commit (``CommitFailedError``: another
    writer changed what it read), its version is taken (:class:`VersionTaken`) or the
    store fails transiently, at most ``policy.retries`` more times. deltamq's other
    errors pass through; any other error is raised as ``give_up(error, exhausted)``
    (``exhausted``: a refusal with no try left), chained from it. A taken version is
    tried again after a few milliseconds at first: the writer that took it has finished."""
    for n in range(policy.retries + 1):
        try:
            return attempt()
        except DeltaMQError as e:
            if not isinstance(e, VersionTaken):
                raise
            if n == policy.retries:
                error = give_up(e, True)
                if error is e:
                    raise
                raise error from e
            # a tenth of the back-off, doubling up to twice the back-off: quick while few
            # writers race, patient (about the plain back-off's total) when many do
            time.sleep(policy.backoff_ms / 10_000.0 * min(2**n, 20) * (1 + random.random()))
        except Exception as e:
            again = type(e).__name__ == "CommitFailedError" or is_transient(e)
            if not again or n == policy.retries:
                error = give_up(e, again)
                if error is e:
                    raise
                raise error from e
            time.sleep(policy.backoff_ms / 1000.0 * (n + 1) * (1 + random.random()))
    raise AssertionError("unreachable")  # pragma: no cover


def _beside(path: str, data: bytes | Callable[[str], None]) -> str:
    """``data`` (or what ``data(name)`` writes) in a new temporary file next to ``path``
    (same directory, so it can be renamed or linked into place); its name. A write that
    fails leaves none."""
    tmp = f"{path}.{os.getpid()}.{random.getrandbits(48):x}.tmp"
    try:
        if callable(data):
            data(tmp)
        else:
            with open(tmp, "wb") as fh:
                fh.write(data)
    except BaseException:  # an encoder's error too: no temporary file left behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return tmp


# object_store's client settings (not the store's): given as {PREFIX}{NAME} like the rest
_CLIENT_OPTIONS = (
    "ALLOW_HTTP",
    "ALLOW_INVALID_CERTIFICATES",
    "CONNECT_TIMEOUT",
    "TIMEOUT",
    "PROXY_URL",
    "PROXY_CA_CERTIFICATE",
    "PROXY_EXCLUDES",
    "USER_AGENT",
    "HTTP1_ONLY",
    "HTTP2_ONLY",
    "POOL_IDLE_TIMEOUT",
    "POOL_MAX_IDLE_PER_HOST",
)


def _present(file: Any, schema: Any) -> list[str]:
    """``schema``'s columns a Parquet file (a ``pq.ParquetFile``) has, in its order."""
    present = set(file.schema_arrow.names)
    return [n for n in schema.names if n in present]


def _conformed(table: Any, schema: Any) -> Any:
    """``table`` with ``schema``'s columns in its types, a missing column all null."""
    import pyarrow as pa

    for i, field in enumerate(schema):
        if field.name not in table.column_names:
            table = table.add_column(i, field.name, pa.nulls(table.num_rows, field.type))
    return table if table.schema.equals(schema) else table.cast(schema)


def _object_store_options(kind: Kind, options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """delta-rs' ``storage_options`` split into obstore's store config and client options."""
    config: dict[str, str] = {}
    client: dict[str, Any] = {}
    prefixes = _PREFIXES[kind]
    for key, value in options.items():
        bare = next((key[len(p) :] for p in prefixes if key.startswith(p)), key)
        if bare in _CLIENT_OPTIONS:
            client[bare.lower()] = value.lower() == "true" if value.lower() in ("true", "false") else value
        else:
            config[key] = value
    return config, client


def merge_rows_into(table: Any, source: Any, on: str, **kwargs: Any) -> Any:
    """delta-rs' merge builder of ``source`` (a few rows built in Python, aliased ``s``)
    into ``table`` (a ``DeltaTable``, aliased ``t``), not streamed: delta-rs then reads
    the source's key values first and skips the target's files whose statistics rule a
    match out. Streamed (its default) it reads every file of the table, three requests
    each on object storage (docs/design.md, "Reads without the engine")."""
    return table.merge(source, on, source_alias="s", target_alias="t", streamed_exec=False, **kwargs)


__all__ = [
    "Entry",
    "Storage",
    "canonical_options",
    "describe_cause",
    "is_transient",
    "kind_of",
    "merge_rows_into",
    "normalize_location",
]
