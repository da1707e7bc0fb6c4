"""Storage: local paths and s3:// URIs (pyarrow's S3FileSystem for tables, boto3 for small objects), whole objects
written atomically, file hashes, model directories copied once per node into a verified cache, and the one retry
policy of every call that talks to the object store (`retrying`).
The layout of a run's outputs is pipeline/runs.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import hashlib
import itertools
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

log = logging.getLogger("genrec.storage")
T = TypeVar("T")


@dataclass
class Storage:
    """The object store's settings (the config's `storage` section)."""

    endpoint: str | None = None  # S3-compatible endpoint override, e.g. http://127.0.0.1:8333
    region: str = "us-east-1"  # the S3 region (signing; most S3-compatible servers accept any)
    retry_s: float = 180.0  # a call that fails transiently (refused, reset, timed out, 5xx, SlowDown) is tried again
    # with backoff for this long before the job gives up (pipeline/storage.py, exit 4)


# ------------------------------------------------------------------ the retry policy
# Two layers. Inside each call the SDKs retry a few times at once (boto3's standard mode, pyarrow's
# AwsStandardS3RetryStrategy), which rides out a dropped connection; around each call `retrying` keeps trying a store
# that is down, restarting or throttling, with exponential backoff and full jitter, for storage.retry_s. Transient:
# refused, reset or timed-out connections, HTTP 5xx and 429, SlowDown and other throttling codes. Permanent, raised at
# once: everything else (access denied, no such bucket or key, a failed conditional put, a bad request).

SDK_ATTEMPTS = 3  # attempts inside one call (boto3 retries.max_attempts, pyarrow's retry strategy)
CONNECT_S, REQUEST_S = 5.0, 20.0  # an attempt gives up on a store that does not connect / send a byte for this long
BACKOFF_S = (0.2, 10.0)  # the n-th retry waits uniform(0, min(10, 0.2 * 2^n)) s (full jitter)
BATCH_RETRIES = 2  # a batch whose shard still cannot be written after the budget is run again by Ray this many times
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ConditionalRequestConflict",  # 409: a conditional write raced another in flight; AWS: retry it
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
_ARROW_TRANSIENT = re.compile(
    r"AWS Error (NETWORK_CONNECTION|SLOW_DOWN|THROTTLING|SERVICE_UNAVAILABLE|"
    r"INTERNAL_FAILURE|REQUEST_TIMEOUT)\b|HTTP status (429|5\d\d)\b"
)


class StoreUnavailable(Exception):
    """The object store kept failing transiently for storage.retry_s: the job gives up (exit 4) and can be resumed.
    The message names the store, the call and its URI, and the last cause."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message  # kept whole across pickling (Ray), whatever is appended to args on the way

    def __str__(self) -> str:
        return self.message


class StoreGaveUp(Exception):
    """A shard's StoreUnavailable after Ray ran its batch again BATCH_RETRIES times: not in the actors'
    retry_exceptions, so the job stops (exit 4, as for StoreUnavailable). Its own class, not a subclass: Ray retries
    every instance of a class it is told to retry."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def transient(e: BaseException) -> bool:
    """Whether an error from the store may pass if the call is tried again (see the policy above)."""
    import botocore.exceptions as be

    if isinstance(e, be.SSLError):  # a certificate the store presents will not change by trying again
        return False
    if isinstance(e, (be.ConnectionError, be.HTTPClientError, ConnectionError, TimeoutError)):
        return True
    if isinstance(e, be.ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        # 501 Not Implemented is the store's final word (a feature it lacks), not a passing fault
        return (
            (status >= 500 and status != 501)
            or status == 429
            or e.response.get("Error", {}).get("Code") in TRANSIENT_CODES
        )
    return isinstance(e, OSError) and _ARROW_TRANSIENT.search(str(e)) is not None  # pyarrow: "AWS Error ..."


def store_name(storage: Storage) -> str:
    return storage.endpoint or f"S3 ({storage.region})"


def retrying(
    call: Callable[[], T],
    storage: Storage | None,
    what: str,
    budget_s: float | None = None,
    store: tuple[str, Callable[[BaseException], bool], str] | None = None,
) -> T:
    """call() -> its result, tried again while it fails transiently, for budget_s (default storage.retry_s) from the
    first try; then StoreUnavailable naming the store, `what` (the request and its URI) and the last cause. A
    permanent error is raised at once. An attempt in flight when the budget ends is not cut short (at most the SDK's
    timeouts more). Only for calls that may run twice: reads, whole-object puts, conditional puts (`put_if`).
    `store`: another store's (name, transient, the budget's setting), e.g. a Redis (pipeline/stores/redis.py); default
    the object store's."""
    name, is_transient, setting = store or (f"object store {store_name(storage)}", transient, "storage.retry_s")
    budget = storage.retry_s if budget_s is None else budget_s
    start = time.monotonic()
    for attempt in itertools.count():
        try:
            result = call()
        except Exception as e:
            if not is_transient(e):
                raise
            waited = time.monotonic() - start
            cause = " ".join(str(e).split()) or type(e).__name__
            if waited >= budget:
                down = StoreUnavailable(
                    f"{name} unavailable: {what} failed for {waited:.0f} s ({attempt + 1} tries; {setting} = "
                    f"{budget:g}): {cause}"
                )
                log.error("giving up: %s", down)
                raise down from e
            delay = min(random.uniform(0, min(BACKOFF_S[1], BACKOFF_S[0] * 2**attempt)), budget - waited)
            log.warning("%s: %s failed (%s); retry %d in %.1f s", name, what, cause, attempt + 1, delay)
            time.sleep(delay)
        else:
            if attempt:
                log.warning("%s: %s succeeded after %d retries, %.1f s", name, what, attempt, time.monotonic() - start)
            return result


def unavailable(e: BaseException) -> StoreUnavailable | None:
    """The StoreUnavailable behind an error, however wrapped (Ray's task errors keep it as `cause`; a StoreGaveUp
    becomes its StoreUnavailable), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, StoreUnavailable) and type(e) is StoreUnavailable:
            return e
        if isinstance(e, StoreGaveUp) and type(e) is StoreGaveUp:
            return StoreUnavailable(e.message)
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


# ------------------------------------------------------------------ URIs, filesystems, clients


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


def filesystem(uri: str, storage: Storage) -> tuple[pafs.FileSystem, str]:
    """URI -> (pyarrow filesystem, path inside it). s3:// uses the environment's credentials (default chain)."""
    if not is_s3(uri):
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    kwargs = {"region": storage.region}
    if storage.endpoint:
        endpoint = urlparse(storage.endpoint)
        kwargs.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme)
    bucket, key = split_s3(uri)
    # allow_delayed_open: a small file is one PutObject at close (not a multipart upload's three requests)
    fs = pafs.S3FileSystem(
        **kwargs,
        connect_timeout=CONNECT_S,
        request_timeout=REQUEST_S,
        allow_delayed_open=True,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=SDK_ATTEMPTS),
    )
    return fs, f"{bucket}/{key}".rstrip("/")


def s3_client(storage: Storage):
    """A boto3 client resolving credentials now (a fresh session: the environment may have changed). The sessions
    share one botocore data loader: what it loads (the S3 service model, the endpoint rules) is the installed
    botocore's and never changes, and loading it again is most of a fresh client's cost (~0.1 s of CPU against
    ~0.015 s)."""
    import boto3
    import botocore.config
    import botocore.session

    config = botocore.config.Config(
        connect_timeout=CONNECT_S, read_timeout=REQUEST_S, retries={"mode": "standard", "max_attempts": SDK_ATTEMPTS}
    )
    session = botocore.session.get_session()
    loader = _botocore_loader(session.get_config_variable("data_path"))
    session.register_component("data_loader", loader)
    with _LOADER_LOCK:  # boto3's Session appends its data folder to its loader's search paths, each time: kept once
        kept = len(loader.search_paths)
        boto = boto3.session.Session(botocore_session=session)
        del loader.search_paths[kept:]
    return boto.client("s3", endpoint_url=storage.endpoint, region_name=storage.region, config=config)


_LOADER_LOCK = threading.Lock()


@functools.cache
def _botocore_loader(data_path: str | None):
    """This process's botocore data loader for a `data_path` (AWS_DATA_PATH or the config file's; None: botocore's
    own models), its files cached as loaded, shared by every `s3_client`'s session; boto3's data folder on its
    search paths once, as boto3 puts it there."""
    import boto3
    import botocore.loaders

    loader = botocore.loaders.create_loader(data_path)
    loader.search_paths.append(os.path.join(os.path.dirname(boto3.__file__), "data"))
    return loader


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


# ------------------------------------------------------------------ objects (tables, manifests, markers)


def write_bytes(uri: str, data: bytes, storage: Storage) -> None:
    """One object, whole or absent: on S3 a single PUT (no directory requests: S3 has none), tried again as a whole
    while the store fails transiently; locally write-then-rename. Either way a reader sees the old or the new object."""
    if not is_s3(uri):
        path = Path(uri).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")  # hidden: never read as part of a folder's table
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return
    fs, path = filesystem(uri, storage)

    def put():
        # one PutObject at close (allow_delayed_open); the bytes as given (pyarrow would gzip a name ending .gz)
        with fs.open_output_stream(path, compression=None) as out:
            out.write(data)

    retrying(put, storage, f"PUT {uri}")


def write_parquet(table: pa.Table, uri: str, storage: Storage) -> None:
    """One parquet file, encoded once (`encode_parquet`) and written whole (`write_bytes`)."""
    write_bytes(uri, encode_parquet(table), storage)


def encode_parquet(table: pa.Table) -> pa.Buffer:
    """A table as the bytes of one parquet file. Floating-point columns are not dictionary encoded: scores rarely
    repeat, and trying costs more than the rest of the encoding."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, use_dictionary=[p for f in table.schema for p in _leaves(f.name, f.type)])
    return sink.getvalue()


def _leaves(path: str, kind: pa.DataType) -> list[str]:
    """A column's leaf paths as parquet names them (`a.list.element`, `s.x`), but its floating-point ones."""
    if pa.types.is_struct(kind):
        return [p for i in range(kind.num_fields) for p in _leaves(f"{path}.{kind.field(i).name}", kind.field(i).type)]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _leaves(f"{path}.list.element", kind.value_type)
    return [] if pa.types.is_floating(kind) else [path]


def read_parquet(uri: str, storage: Storage, columns=None) -> pa.Table:
    """One parquet file (all of it, or `columns`), its reads retried as a whole."""
    fs, path = filesystem(uri, storage)
    return retrying(lambda: pq.read_table(path, filesystem=fs, columns=columns), storage, f"GET {uri}")


def unified_dataset(data, what: str, read=()):
    """A pyarrow dataset of parquet files (its footers read) -> the same files under their unified schema
    (`unified_schema`), which every read of them casts to: a column a file lacks reads as nulls."""
    import pyarrow.dataset as pads

    fragments = list(data.get_fragments())
    return pads.FileSystemDataset(fragments, unified_schema(fragments, what, read), data.format, data.filesystem)


def unified_schema(fragments: list, what: str, read=()) -> pa.Schema:
    """The schema of several parquet files from every file's own (its footer), never the first file's alone: a
    column some files lack is in it; a column whose files differ only in width or offsets takes the widest (int32
    and int64, list and large_list, string and large_string: pyarrow's permissive promotion, where no value is lost).
    A column `read` whose files hold two kinds of value (an integer and a string, a list and a string, uint64 and
    a signed integer) is refused, ValueError naming `what`, two of its files and their types; such a column that is
    not read is left out."""
    seen: dict[str, dict[pa.DataType, str]] = {}  # column -> each type it has -> the first file holding it so
    for fragment in fragments:
        for f in fragment.physical_schema:
            seen.setdefault(f.name, {}).setdefault(f.type, fragment.path)
    fields = []
    for name, kinds in seen.items():
        kind, clash = _widest(list(kinds))
        if clash is None:
            fields.append(pa.field(name, kind))
        elif name in read:
            a, b = clash
            raise ValueError(
                f"{what}: column {name!r} is {a} in {kinds[a]} and {b} in {kinds[b]}; its files must hold one type "
                "(cast it where they are written)"
            )
    return pa.schema(fields)


def _widest(kinds: list[pa.DataType]) -> tuple[pa.DataType | None, tuple | None]:
    """A column's types -> (the type each widens to, None), or (None, two of them that do not unify)."""
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            if _unified([a, b]) is None:
                return None, (a, b)
    out = _unified(kinds)
    return (out, None) if out is not None else (None, (kinds[0], kinds[-1]))


def _unified(kinds: list[pa.DataType]) -> pa.DataType | None:
    """pyarrow's permissive promotion of `kinds` when each widens into it without loss (`_widens`), else None."""
    try:
        out = pa.unify_schemas([pa.schema([("c", k)]) for k in kinds], promote_options="permissive").field("c").type
    except (pa.ArrowTypeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    return out if all(_widens(k, out) for k in kinds) else None


def _widens(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether every value of type `src` is one of `dst`: the same kind of value, as wide or wider."""
    t = pa.types
    if src == dst or t.is_null(src):
        return True
    if t.is_integer(src) and t.is_integer(dst):
        if t.is_signed_integer(src) == t.is_signed_integer(dst):
            return src.bit_width <= dst.bit_width
        return t.is_unsigned_integer(src) and src.bit_width < dst.bit_width
    if t.is_floating(src) and t.is_floating(dst):
        return src.bit_width <= dst.bit_width
    for kind in ((t.is_string, t.is_large_string), (t.is_binary, t.is_large_binary)):
        if any(k(src) for k in kind) and any(k(dst) for k in kind):
            return True
    lists = (t.is_list, t.is_large_list)
    if any(k(src) for k in lists) and any(k(dst) for k in lists):
        return _widens(src.value_type, dst.value_type)
    return False


class TooLarge(ValueError):
    """An object larger than its reader's bound: not read whole."""


def read_bytes(uri: str, storage: Storage, limit: int | None = None) -> bytes | None:
    """An object's bytes, or None when there is none. With `limit`, no more than limit + 1 bytes are ever read (S3: a
    ranged GET; locally the size first): a larger object raises TooLarge naming it."""
    if limit is not None:
        return _read_bounded(uri, storage, limit)
    if is_s3(uri):
        got = read_versioned(uri, storage)
        return got[0] if got else None
    path = Path(uri).expanduser()
    return path.read_bytes() if path.is_file() else None


def _read_bounded(uri: str, storage: Storage, limit: int) -> bytes | None:
    if is_s3(uri):
        bucket, key = split_s3(uri)

        def get():
            import botocore.exceptions

            client = s3_client(storage)
            try:
                got = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
            except client.exceptions.NoSuchKey:
                return None
            except botocore.exceptions.ClientError as e:  # 416: an empty object has no byte 0
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                    return b""
                raise
            return got["Body"].read(limit + 1)

        data = retrying(get, storage, f"GET {uri} (at most {limit} bytes)")
    else:
        path = Path(uri).expanduser()
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    if data is not None and len(data) > limit:
        raise TooLarge(f"{uri} is larger than {limit} bytes")
    return data


def read_versioned(uri: str, storage: Storage, budget_s: float | None = None) -> tuple[bytes, str] | None:
    """An S3 object's bytes and ETag (its version for `put_if`), or None."""
    bucket, key = split_s3(uri)

    def get():
        client = s3_client(storage)
        try:
            got = client.get_object(Bucket=bucket, Key=key)
        except client.exceptions.NoSuchKey:
            return None
        return got["Body"].read(), got["ETag"]  # the body read inside: a cut stream is retried too

    return retrying(get, storage, f"GET {uri}", budget_s)


def put_if(
    uri: str, data: bytes, storage: Storage, etag: str | None, budget_s: float | None = None, client=None
) -> str | None:
    """A conditional put on S3: etag None creates the object only if it does not exist (If-None-Match: *), an ETag
    replaces it only if it is still that version (If-Match) -> the new ETag, or None if the condition failed (never
    retried: another writer won). A put whose answer was lost lands before its retry, which then fails the condition:
    so a failed condition is checked against the object, and an object holding exactly `data` is this put's own
    (what callers write is unique to the call: a lease body with its holder's pid and stamp, _LATEST naming the run
    that holds the date's lease). `client`: one to reuse (the store check's racers share one), else a fresh one."""
    import botocore.exceptions

    bucket, key = split_s3(uri)
    cond = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}

    def put():
        try:
            return (client or s3_client(storage)).put_object(Bucket=bucket, Key=key, Body=data, **cond)["ETag"]
        except botocore.exceptions.ClientError as e:
            failed = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412)
            if failed and not transient(e):  # 409 ConditionalRequestConflict is a race in flight: tried again
                return None
            raise

    new = retrying(put, storage, f"conditional PUT {uri}", budget_s)
    if new is not None:
        return new
    now = read_versioned(uri, storage, budget_s)
    return now[1] if now is not None and now[0] == data else None


def create(uri: str, data: bytes, storage: Storage) -> bool:
    """The object created only if absent -> whether this call created it (False: something holds the name; an
    object holding exactly `data` is this call's own, its answer lost). S3: `put_if` with If-None-Match; locally a
    hard link of a written file, which fails if the name exists: whole or absent, never over another's."""
    if is_s3(uri):
        return put_if(uri, data, storage, None) is not None
    path = Path(uri).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def content_id(path: str, fs: pafs.FileSystem, storage: Storage) -> str:
    """A file's content identity: on S3 its ETag (the store's digest of the bytes, read with a HEAD), locally the
    sha256 of its bytes; a folder's (a catalog or item set written as a folder of parquet files) the sha256 of its
    files' names and identities, the files pyarrow reads as its dataset (`folder_id`). `path` is the filesystem's
    own (`bucket/key` on S3)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return folder_id(path, fs, storage) if Path(path).is_dir() else "sha256:" + sha256_file(Path(path))
    import botocore.exceptions

    bucket, key = path.split("/", 1)
    try:
        head = retrying(lambda: s3_client(storage).head_object(Bucket=bucket, Key=key), storage, f"HEAD s3://{path}")
    except botocore.exceptions.ClientError as e:  # no such object: a folder (a prefix), or nothing
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
            raise
        info = retrying(lambda: fs.get_file_info(path), storage, f"HEAD s3://{path}/")
        if info.type != pafs.FileType.Directory:
            raise FileNotFoundError(f"s3://{path} not found") from None
        return folder_id(path, fs, storage)
    return f"etag:{head['ETag'].strip(chr(34))}:{head['ContentLength']}"


def folder_id(path: str, fs: pafs.FileSystem, storage: Storage) -> str:
    """A folder's content identity: the sha256 of each of its files' path inside it and content identity, over the
    files a pyarrow dataset of it reads (names starting with `.` or `_`, such as Spark's _SUCCESS, left out)."""
    import pyarrow.dataset as pads

    files = retrying(lambda: pads.dataset(path, filesystem=fs, format="parquet").files, storage, f"LIST {path}")
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f"{f.removeprefix(path.rstrip('/') + '/')}\0{content_id(f, fs, storage)}\n".encode())
    return f"folder:{h.hexdigest()}"


def _listing(uri: str, storage: Storage) -> list:
    """The FileInfos directly in a folder ([] if it does not exist)."""
    fs, path = filesystem(uri, storage)
    return retrying(lambda: fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)), storage, f"LIST {uri}")


def list_files(uri: str, storage: Storage) -> list[str]:
    """Names of the files directly in a folder ([] if it does not exist)."""
    return sorted(Path(i.path).name for i in _listing(uri, storage) if i.type == pafs.FileType.File)


def delete_files(uri: str, names: list[str], storage: Storage) -> None:
    """Deletes files of a folder (on S3 in batches of 1,000 keys per request; a missing file is no error)."""
    if not is_s3(uri):
        for name in names:
            Path(uri, name).expanduser().unlink(missing_ok=True)
        return
    bucket, key = split_s3(join(uri, ""))
    for i in range(0, len(names), 1000):
        objects = [{"Key": key + name} for name in names[i : i + 1000]]
        done = retrying(
            lambda: s3_client(storage).delete_objects(Bucket=bucket, Delete={"Objects": objects}),
            storage,
            f"DELETE {len(objects)} objects in {uri}",
        )
        if done.get("Errors"):  # per key, in a 200 answer
            e = done["Errors"][0]
            raise OSError(
                f"DELETE s3://{bucket}/{e.get('Key')}: {e.get('Code')} ({e.get('Message')}); "
                f"{len(done['Errors'])} of {len(objects)} objects in {uri} not deleted"
            )


def exists(uri: str, storage: Storage) -> bool:
    fs, path = filesystem(uri, storage)
    return retrying(lambda: fs.get_file_info(path), storage, f"HEAD {uri}").type != pafs.FileType.NotFound


def delete_tree(uri: str, storage: Storage) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        pages = retrying(
            lambda: list(
                s3_client(storage)
                .get_paginator("list_objects_v2")
                .paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/")
            ),
            storage,
            f"LIST {uri}",
        )
        names = [o["Key"].removeprefix(key.rstrip("/") + "/") for page in pages for o in page.get("Contents", [])]
        delete_files(uri, names, storage)
    else:
        shutil.rmtree(Path(uri).expanduser(), ignore_errors=True)


def list_children(uri: str, storage: Storage) -> list[str]:
    """Names of the immediate sub-folders of a URI."""
    try:
        infos = _listing(uri, storage)
    except OSError:  # permanent (transient errors end as StoreUnavailable)
        return []
    return sorted(Path(i.path).name for i in infos if i.type == pafs.FileType.Directory)


def check_access(uri: str, storage: Storage) -> None:
    """Fails fast, naming the URI, when the object store rejects the credentials; never prints a secret."""
    if not is_s3(uri):
        return
    import botocore.exceptions

    bucket, _ = split_s3(uri)
    try:
        retrying(lambda: s3_client(storage).head_bucket(Bucket=bucket), storage, f"HEAD bucket {bucket} of {uri}")
    except botocore.exceptions.NoCredentialsError:
        raise PermissionError(
            f"{uri}: no object-store credentials (set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
            "or use the cloud's default credential chain)"
        ) from None
    except botocore.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        raise PermissionError(
            f"{uri}: the object store refused access to bucket {bucket!r} ({code}); check the "
            "credentials in the environment and storage.endpoint"
        ) from None


# ------------------------------------------------------------------ what the store must honour

STORE_CHECK = "_STORE_CHECK"  # the scratch objects' names under the output (with a random suffix), deleted after
RACERS, RACE_ROUNDS = 3, 2  # conditional puts of one key at once, and rounds of them (a fresh key each): few, as
# SeaweedFS makes a put that finds the key locked by another retry after 1 s (~1 s more per racer per race)


def check_conditional_writes(output: str, storage: Storage) -> None:
    """Verifies that the output store honours what the run-date lease and _LATEST rest on, on scratch objects under
    `output` (deleted after, also on failure): on S3 conditional create (`If-None-Match: *`: a second create of a key
    fails) and conditional replace (`If-Match: ETag`: a replace of the current version succeeds, of a replaced one
    fails), both atomic: of RACERS creates of a fresh key released at once exactly one succeeds, as of RACERS
    replaces of its current version (RACE_ROUNDS rounds), which a store that checks and then writes (a HEAD, then a
    PUT) fails; locally, where the lease is an exclusive flock and a create-if-absent a hard link, that the folder's
    filesystem grants one such lock at a time and refuses a link over an existing name.
    A store that does not -> ValueError naming the capability it lacks and what it did."""
    name = f"{STORE_CHECK}-{uuid.uuid4().hex[:12]}"
    if not is_s3(output):
        folder = Path(output).expanduser()
        made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first: removed after
        folder.mkdir(parents=True, exist_ok=True)
        try:
            _check_flock(folder, name)
            return _check_link(folder, name)
        finally:
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
    uri, raced = join(output, name), [f"{name}-{r}" for r in range(RACE_ROUNDS)]
    client = s3_client(storage)  # one for every request of the check (making one costs ~0.1 s of CPU)
    try:
        gaps = _conditional_gaps(uri, client, storage) or _race_gaps([join(output, n) for n in raced], client, storage)
    finally:
        delete_files(output, [name, *raced], storage)
    if gaps:
        raise ValueError(
            f"output store {store_name(storage)} lacks what the run-date lease and _LATEST rest on (checked on "
            f"{uri}): {'; '.join(gaps)}. Without it two runs of a date could both publish: use a store that honours "
            "conditional writes (S3 does, as does SeaweedFS)"
        )


_STORES_CHECKED: set[tuple] = set()  # (endpoint, region, output) whose store passed check_conditional_writes


def check_store_once(output: str, storage: Storage) -> None:
    """`check_conditional_writes` of an s3:// output once per process (its pass remembered for the output at that
    endpoint: a store's capability does not change while a process runs; a local output is checked each time, as
    its check costs nothing). The plan and the table sinks call this; the check itself stays a check each call."""
    if not is_s3(output):
        return check_conditional_writes(output, storage)
    client = s3_client(storage)  # the endpoint and region it resolved (storage.endpoint, else the environment's)
    key = (client.meta.endpoint_url, client.meta.region_name, output.rstrip("/"))
    if key not in _STORES_CHECKED:
        check_conditional_writes(output, storage)
        _STORES_CHECKED.add(key)


CREATE, REPLACE = "conditional create (If-None-Match: *)", "conditional replace (If-Match: ETag)"


def _conditional_gaps(uri: str, client, storage: Storage) -> list[str]:
    """Conditional puts of four distinct bodies on a fresh key, one after another -> the capabilities the store
    failed, with what it did ([] when it honoured both)."""
    gaps = []
    if _put(uri, b"1", None, client, storage) is None:
        return [f"{CREATE}: it refused to create a new object"]
    if _put(uri, b"2", None, client, storage) is not None:
        gaps.append(f"{CREATE}: a second create of one key succeeded")
    current = _etag(uri, client, storage)
    if _put(uri, b"3", current, client, storage) is None:
        gaps.append(f"{REPLACE}: it refused to replace the current version")
    elif _put(uri, b"4", current, client, storage) is not None:
        gaps.append(f"{REPLACE}: a replace of a version already replaced succeeded")
    return gaps


def _race_gaps(uris: list[str], client, storage: Storage) -> list[str]:
    """A round per fresh key: RACERS concurrent creates of it, then RACERS concurrent replaces of its version then
    -> the capabilities whose race had not exactly one winner, with what happened, from the first round that found
    any ([] when every race had one)."""
    for uri in uris:
        gaps = [_race(CREATE, "creates of one key", uri, None, client, storage)]
        if (current := _etag(uri, client, storage)) is not None:
            gaps.append(_race(REPLACE, "replaces of one version", uri, current, client, storage))
        if gaps := [gap for gap in gaps if gap]:
            return gaps
    return []


def _race(capability: str, what: str, uri: str, etag: str | None, client, storage: Storage) -> str | None:
    """RACERS conditional puts of `uri` (etag None: creates, else replaces of that version), each with a body of its
    own, released together by a barrier on one shared client (made before: racers that each made one would set off
    ~0.1 s apart) -> what the store did when not exactly one succeeded, else None."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier = threading.Barrier(RACERS)

    def racer(i: int) -> bool:
        body = f"{STORE_CHECK} {what}: racer {i + 1} of {RACERS}".encode()
        barrier.wait()
        return _put(uri, body, etag, client, storage) is not None

    with ThreadPoolExecutor(RACERS) as pool:  # RACERS threads: none is free for another racer before the barrier
        won = sum(pool.map(racer, range(RACERS)))
    if won == 0:
        return f"{capability}: none of {RACERS} concurrent {what} succeeded"
    if won > 1:
        return (
            f"{capability}: {won} of {RACERS} concurrent {what} succeeded (the store checks, then writes: not atomic)"
        )
    return None


def _put(uri: str, data: bytes, etag: str | None, client, storage: Storage) -> str | None:
    """`put_if` on a given client, a store's refusal of the condition itself (400 InvalidArgument, 501
    NotImplemented) read as a failed condition. A racer's transient errors are retried as put_if's are (one that
    still fails raises StoreUnavailable, counted neither a win nor a loss), and its lost answer is recognised by its
    own bytes (every put of the check writes bytes no other put writes)."""
    import botocore.exceptions

    try:
        return put_if(uri, data, storage, etag, client=client)
    except botocore.exceptions.ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (400, 501):
            raise
        log.warning("store %s: conditional PUT %s answered %s", store_name(storage), uri, e)
        return None


def _etag(uri: str, client, storage: Storage) -> str | None:
    """An S3 object's ETag (a HEAD on `client`), or None."""
    import botocore.exceptions

    bucket, key = split_s3(uri)

    def head() -> str | None:
        try:
            return client.head_object(Bucket=bucket, Key=key)["ETag"]
        except botocore.exceptions.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
            return None

    return retrying(head, storage, f"HEAD {uri}")


def _check_flock(folder: Path, name: str) -> None:
    """Two descriptors of one scratch file: the second exclusive flock must be refused while the first holds."""
    path = folder / name
    first = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    second = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # the second lock was refused: the lease's lock excludes
    except OSError as e:
        raise ValueError(f"output folder {folder}: its filesystem has no exclusive locks (flock: {e})") from None
    else:
        raise ValueError(
            f"output folder {folder}: its filesystem granted two exclusive locks (flock) on one file at once; the "
            "run-date lease rests on them. Write to a local disk or to an s3:// output"
        )
    finally:
        os.close(first)
        os.close(second)
        path.unlink(missing_ok=True)


def _check_link(folder: Path, name: str) -> None:
    """A hard link onto a name that exists must fail: how a local create-if-absent is done (`runs.EngineRecord`)."""
    path, link = folder / name, folder / f"{name}.link"
    path.write_bytes(b"")
    try:
        os.link(path, link)
        os.link(path, link)
    except FileExistsError:
        return  # refused: a create-if-absent excludes
    except OSError as e:
        raise ValueError(f"output folder {folder}: its filesystem has no hard links ({e})") from None
    finally:
        path.unlink(missing_ok=True)
        link.unlink(missing_ok=True)
    raise ValueError(f"output folder {folder}: its filesystem let a hard link replace an existing name")


# ------------------------------------------------------------------ model directories


def sha256_file(path: Path, h=None) -> str:
    """The sha256 of a file's bytes (or, given `h`, those bytes fed into that hash)."""
    h = hashlib.sha256() if h is None else h
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(model_dir) -> str:
    """A model's fingerprint: `weights_fingerprint` of its safetensors files' sha256s."""
    from decoding.models import check_model_dir

    files = [f for f in check_model_dir(model_dir).glob("*.safetensors") if not f.name.startswith(".")]  # as uploaded
    return weights_fingerprint({f.name: sha256_file(f) for f in files})


def weights_fingerprint(sums: dict[str, str]) -> str:
    """{file name: sha256} of a model's files -> sha256 over its safetensors files' names and sha256s, sorted by name:
    the same from a local folder (hashed) and from an s3:// model's sha256sums.json (its weights never read)."""
    weights = sorted((name, digest) for name, digest in sums.items() if name.endswith(".safetensors"))
    return hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in weights).encode()).hexdigest()


def files_fingerprint(sums: dict[str, str]) -> str:
    """{file name: sha256} of a model's files -> sha256 over the names and sha256s of all but its weights (config,
    tokenizer, generation config, chat and prompt templates), sorted by name: with `weights_fingerprint`, what the
    model is; the same from a local folder (`local_files_fingerprint`) and an s3:// model's sha256sums.json."""
    files = sorted((name, digest) for name, digest in sums.items() if not _weights_or_hidden(name))
    return hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in files).encode()).hexdigest()


def _weights_or_hidden(name: str) -> bool:
    return name.startswith(".") or name.endswith(".safetensors") or name == MODEL_SUMS


def local_files_fingerprint(model_dir) -> str:
    """`files_fingerprint` of a local model folder's regular files (its weights never read)."""
    files = [f for f in Path(model_dir).iterdir() if f.is_file() and not _weights_or_hidden(f.name)]
    return files_fingerprint({f.name: sha256_file(f) for f in files})


MODEL_SUMS = "sha256sums.json"  # beside an s3:// model's files: their sha256, written last (`upload_model_dir`)


def model_files(local) -> list[Path]:
    """The files of a model directory that travel with it: its regular top-level files but hidden ones. A symbolic
    link is refused (ValueError naming it): uploaded, it would carry its target's bytes, maybe from outside."""
    entries = sorted(p for p in Path(local).iterdir() if not p.name.startswith("."))
    links = [f"{p.name} -> {os.readlink(p)}" for p in entries if p.is_symlink()]
    if links:
        raise ValueError(f"{local}: symbolic links are not uploaded; copy the files in place of {', '.join(links)}")
    return [p for p in entries if p.is_file()]


PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")  # weights (or state) that load by unpickling: code


def model_file_name(uri: str, name: str) -> str:
    """A file name from an s3:// model's sha256sums.json, checked: a plain name (no folder, no `..`, not hidden)
    and no pickle, else ValueError naming the model and the name (it would escape the node's cache, or run code)."""
    if not isinstance(name, str) or not name or Path(name).name != name or name.startswith(".") or "\\" in name:
        raise ValueError(f"model {uri}: {MODEL_SUMS} names {name!r}, not a plain file name; refused")
    if name.endswith(PICKLED):
        raise ValueError(f"model {uri}: {MODEL_SUMS} names {name!r}, a pickled file (it runs code when loaded)")
    return name


def upload_model_dir(local: str, uri: str, storage: Storage) -> dict:
    """Copies a model directory's files (`model_files`) to an s3:// prefix, then its sha256sums.json (last: a prefix
    without it is no model to `local_model_dir`), then reads every object back and checks it against its sha256
    -> {file name: sha256}. A prefix that already holds another model is refused before anything is written (a run
    in flight would find its model gone: a new version goes to a new prefix); the same model again is uploaded again.
    sha256sums.json is a conditional put over the version read first, so an upload racing another to the prefix
    is refused."""
    files = model_files(local)
    sums = {p.name: sha256_file(p) for p in files}
    held = read_versioned(join(uri, MODEL_SUMS), storage)
    if held is not None and json.loads(held[0]) != sums:
        raise ValueError(
            f"{uri} already holds another model (its {MODEL_SUMS} differs): runs reading it would refuse a model "
            "replaced under them; upload a new version to a new prefix"
        )
    bucket, key = split_s3(uri)
    client = s3_client(storage)
    for p in files:
        retrying(
            lambda: client.upload_file(str(p), bucket, f"{key.rstrip('/')}/{p.name}"),
            storage,
            f"PUT {join(uri, p.name)}",
        )
    # only over the version read above (absent: If-None-Match): of two uploads racing to one prefix one loses here
    if put_if(join(uri, MODEL_SUMS), json.dumps(sums, indent=1).encode(), storage, held and held[1]) is None:
        raise ValueError(
            f"{join(uri, MODEL_SUMS)} changed while this model was uploaded (another upload to {uri}); upload each "
            "model to its own prefix"
        )
    verify_model_upload(uri, sums, storage)
    return sums


def verify_model_upload(uri: str, sums: dict, storage: Storage) -> None:
    """Reads an uploaded model back: its sha256sums.json must be `sums` and every file must hash to its sum."""
    raw = read_bytes(join(uri, MODEL_SUMS), storage)
    if raw is None or json.loads(raw) != sums:
        raise ValueError(f"{join(uri, MODEL_SUMS)}: read back {'nothing' if raw is None else 'other sums'}")
    for name, digest in sums.items():
        got = sha256_object(join(uri, name), storage)
        if got != digest:
            raise ValueError(f"{join(uri, name)}: read back with sha256 {got}, uploaded {digest}")


def sha256_object(uri: str, storage: Storage) -> str:
    """The sha256 of an S3 object's bytes, streamed (read again whole while the store fails transiently)."""
    bucket, key = split_s3(uri)

    def get():
        h = hashlib.sha256()
        for chunk in s3_client(storage).get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 20):
            h.update(chunk)
        return h.hexdigest()

    return retrying(get, storage, f"GET {uri}")


def model_sums(uri: str, storage: Storage) -> dict[str, str]:
    """An s3:// model's sha256sums.json, every name checked (`model_file_name`) -> {file name: sha256}."""
    raw = read_bytes(join(uri, MODEL_SUMS), storage, limit=1 << 20)
    if raw is None:
        raise FileNotFoundError(
            f"model {uri}: no {MODEL_SUMS}, so its files cannot be verified; upload the model folder with "
            f"`genrec-batch upload-model LOCAL_DIR {uri} --catalog items.parquet`, which checks it and writes it"
        )
    try:
        sums = json.loads(raw)
    except ValueError:
        sums = None
    if not isinstance(sums, dict) or not all(isinstance(d, str) for d in sums.values()):
        raise ValueError(f"model {uri}: {MODEL_SUMS} is not a {{file name: sha256}} object")
    for name in sums:
        model_file_name(uri, name)
    return sums


HEAD_FILES = ("*.json", "tokenizer*", "*.model", "vocab*", "merges.txt", "*.tiktoken", "chat_template*", "*.jinja*")
# ^ what a driver downloads of an s3:// model: its config, tokenizer, templates and chat templates (never weights)


def model_head(uri: str, storage: Storage, dest: Path) -> dict[str, str]:
    """What a driver checks of an s3:// model without its weights -> its sums. Its config, tokenizer and template
    (HEAD_FILES) downloaded into `dest` and checked against sha256sums.json; each safetensors file's header read (a
    ranged GET of its first bytes: its tensors' offsets) and its size (HEAD) checked against it, so that a missing,
    truncated or pickled weight file is refused here, not on a GPU node. Nothing else is read."""
    sums = model_sums(uri, storage)
    if not any(name.endswith(".safetensors") for name in sums):
        raise ValueError(f"model {uri}: {MODEL_SUMS} names no *.safetensors weights")
    bucket, key = split_s3(uri)
    client = s3_client(storage)
    for name, digest in sums.items():
        obj = f"{key.rstrip('/')}/{name}"
        if name.endswith(".safetensors"):
            retrying(
                lambda: _check_safetensors(client, bucket, obj, join(uri, name)), storage, f"HEAD {join(uri, name)}"
            )
            continue
        if not any(fnmatch.fnmatch(name, pattern) for pattern in HEAD_FILES):
            continue
        retrying(lambda: client.download_file(bucket, obj, str(dest / name)), storage, f"GET {join(uri, name)}")
        if sha256_file(dest / name) != digest:
            raise ValueError(f"model {uri}: {name} does not match its sha256 in {MODEL_SUMS}")
    return sums


def _check_safetensors(client, bucket: str, key: str, uri: str) -> None:
    """A safetensors object's size (HEAD) against its header's: 8 bytes of header length, the JSON header, the data
    its tensors' offsets end at. ValueError naming the file when it is missing, not safetensors, or cut short."""
    import botocore.exceptions

    try:
        size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    except botocore.exceptions.ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            raise ValueError(f"{uri}: missing (named in {MODEL_SUMS})") from None
        raise
    head = client.get_object(Bucket=bucket, Key=key, Range="bytes=0-7")["Body"].read() if size >= 8 else b""
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= min(size - 8, 100 << 20):
        raise ValueError(f"{uri}: not a safetensors file ({size} bytes, header length {n})")
    raw = client.get_object(Bucket=bucket, Key=key, Range=f"bytes=8-{7 + n}")["Body"].read()
    try:
        tensors = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise ValueError(f"{uri}: not a safetensors file (its header is not one)") from None
    if size != 8 + n + end:
        raise ValueError(f"{uri}: {size} bytes stored, its safetensors header says {8 + n + end}: cut short or padded")


class ModelChanged(ValueError):
    """The model an actor would load is not the one the run's plan fingerprinted (exit 2): replaced at its URI since."""


class NodeDenied(PermissionError):
    """A worker node cannot read from the object store: no credentials there, or they are refused (exit 9). The
    driver has its own: every node needs them (`on_node`)."""


DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
    }
)  # S3's error codes for credentials that are missing, wrong or refused
_ARROW_DENIED = re.compile(
    r"AWS Error (ACCESS_DENIED|INVALID_ACCESS_KEY_ID|SIGNATURE_DOES_NOT_MATCH|UNRECOGNIZED_CLIENT)"
)


def denied(e: BaseException) -> bool:
    """Whether a store error says this process has no credentials, or that they are refused (boto3's, or pyarrow's
    "AWS Error ..." words)."""
    import botocore.exceptions as be

    if isinstance(e, (be.NoCredentialsError, be.PartialCredentialsError, be.CredentialRetrievalError)):
        return True
    if isinstance(e, be.ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status == 403 or e.response.get("Error", {}).get("Code") in DENIED_CODES
    return isinstance(e, OSError) and _ARROW_DENIED.search(str(e)) is not None


@contextlib.contextmanager
def on_node(what: str, uri: str, verb: str = "read"):
    """A worker node's reads of `what` at `uri` (the input, the items, a model, a base run) or its writes (`verb`:
    the run's shards): an error saying the node has no credentials, or that they are refused, raises NodeDenied
    naming the node, the URI and the fix (exit 9)."""
    try:
        yield
    except Exception as e:
        if not denied(e):
            raise
        cause = " ".join(str(e).split()) or type(e).__name__
        raise NodeDenied(
            f"node {node_name()} cannot {verb} {what} {uri}: {cause}. Every worker node reads the input, the items, "
            "the models and an incremental base and writes its shards itself, so each needs the object store's "
            "credentials, not only the driver: give the worker pods the IAM role (IRSA: their serviceAccountName) or "
            "the AWS_* variables (the Secret in the RayJob's worker group, or the job's runtime_env env_vars); "
            "docs/deploy.md#3-credentials-and-region-one-place"
        ) from None


def node_name() -> str:
    """This process's node for messages: its host name, and its Ray node's address when it runs in Ray."""
    import socket
    import sys

    host = socket.gethostname()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return f"{host} ({ray.util.get_node_ip_address()})"
    return host


def local_model_dir(uri: str, cache_dir: str, storage: Storage, sha256: str = "", files: str = "") -> Path:
    """A local directory holding the model: the path itself, or an s3:// model copied once per node into the cache
    (`cached_model`). With `sha256` and `files` (what the run's plan fingerprinted: `weights_fingerprint`,
    `files_fingerprint`) a model whose weights or other files (its config, tokenizer, ...) are others now is refused,
    ModelChanged naming the URI and both digests; an s3:// one before any file is downloaded. A node whose
    credentials the store lacks or refuses raises NodeDenied naming the node, the URI and the fix."""
    if not is_s3(uri):
        path = Path(uri).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {uri} not found (no config.json)")
        if sha256:
            check_model(uri, "weights", fingerprint(path), sha256)
        if files:
            check_model(uri, "files but the weights", local_files_fingerprint(path), files)
        return path
    with on_node("the model", uri):
        sums = model_sums(uri, storage)
        if sha256:
            check_model(uri, "weights", weights_fingerprint(sums), sha256)
        if files:
            check_model(uri, "files but the weights", files_fingerprint(sums), files)
        return cached_model(uri, sums, Path(cache_dir).expanduser(), storage)


def check_model(uri: str, what: str, got: str, want: str) -> None:
    """A model's digest of its `what` against the plan's: ModelChanged naming the URI and both when they differ."""
    if got != want:
        raise ModelChanged(
            f"model {uri} on node {node_name()}: its {what} are {got} now, the run was planned with {want}: the "
            "model was replaced at its URI after the run started. Start a new run (it fingerprints the model there "
            "now); upload each model version to a prefix of its own"
        )


CACHE_LAYOUT = "content-v1"  # models.cache_dir/<layout>/<URI's digest>/<content digest>/: the node's copies


def content_digest(sums: dict[str, str]) -> str:
    """An s3:// model's content identity: the sha256 of its sha256sums.json's entries (every file, by name)."""
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()


_IN_USE: dict[Path, int] = {}  # the cache entries this process uses -> its shared lock on each (held until it exits)


def cached_model(uri: str, sums: dict[str, str], cache_dir: Path, storage: Storage) -> Path:
    """The node's copy of the model `sums` describe, under the cache folder of its URI, keyed by content: a model
    replaced at the URI is another entry, downloaded anew. This process holds a shared lock on the entry's `.use` file
    as long as it lives (it uses the files); the first actor of the node fills the entry under an exclusive lock on
    its `.fill` file, checking every file against its sha256, and the others wait for it. Then the entries of the URI
    that no process uses (other contents: older models) are deleted (`sweep`)."""
    root = cache_dir / CACHE_LAYOUT / hashlib.sha256(uri.encode()).hexdigest()[:16]
    name = content_digest(sums)[:32]
    entry = root / name
    root.mkdir(parents=True, exist_ok=True)
    if entry not in _IN_USE:
        _IN_USE[entry] = hold(root / f"{name}.use", fcntl.LOCK_SH)
    with open(root / f"{name}.fill", "a") as fill:
        fcntl.flock(fill, fcntl.LOCK_EX)
        if not (entry / ".complete").is_file():
            download_model(uri, sums, entry, storage)
    sweep(root, keep=name)
    return entry


def hold(path: Path, how: int) -> int:
    """A lock taken on `path` (created if absent) -> its descriptor. Retried when the file was deleted or replaced
    while this process waited (`sweep` deletes a lock file under its exclusive lock): the lock is on the name's file."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, how)
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def download_model(uri: str, sums: dict[str, str], entry: Path, storage: Storage) -> None:
    """The model's files downloaded into `entry` (emptied first: a fill cut short), each checked against its
    sha256, then `.complete` written."""
    shutil.rmtree(entry, ignore_errors=True)
    entry.mkdir()
    bucket, key = split_s3(uri)
    client = s3_client(storage)
    for name, digest in sums.items():
        retrying(
            lambda: client.download_file(bucket, f"{key.rstrip('/')}/{name}", str(entry / name)),
            storage,
            f"GET {join(uri, name)}",
        )
        if sha256_file(entry / name) != digest:
            raise ValueError(f"model {uri}: {name} does not match its sha256 in {MODEL_SUMS}")
    (entry / ".complete").write_text(uri)


def sweep(root: Path, keep: str) -> list[str]:
    """The entries of one URI's cache folder but `keep` that no process uses (their `.use` lock free) deleted, with
    their lock files -> their names. An entry in use is left for a later actor's sweep."""
    gone = []
    for use in sorted(root.glob("*.use")):
        name = use.name.removesuffix(".use")
        if name == keep:
            continue
        try:
            fd = os.open(use, os.O_RDWR)
        except FileNotFoundError:  # another actor's sweep took it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(root / name, ignore_errors=True)
            (root / f"{name}.fill").unlink(missing_ok=True)
            use.unlink(missing_ok=True)  # under its lock: a process that opened it before retries (`hold`)
            gone.append(name)
        finally:
            os.close(fd)
    if gone:
        log.info("model cache %s: removed %d older model(s) of this URI no process uses", root, len(gone))
    return gone
