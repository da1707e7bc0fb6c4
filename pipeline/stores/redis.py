"""A published run served from Redis (docs/output.md#serving-from-redis): each user's list under a key of a version
of its own (`<run_id>.<nonce>`: every export of a run that is not resumed writes a new one), one pointer per namespace
naming the version readers use, switched only once every user of the run is written and counted against its
manifest, by a compare-and-set (a Lua script) against the version the export started from; the previous `keep`
versions stay for `--rollback`, older ones are removed after the switch, readable for `grace_s` more.

Keys (`ns`: serving.namespace; `{ns}` in braces is a Redis Cluster hash tag: the control keys share one slot, so one
script reads and changes them together, while the users' keys spread over every slot):
    {ns}:current              the version readers use; absent: none yet
    {ns}:versions             the versions switched to, newest first (a list): the current one, then the kept ones
    {ns}:dates                each version switched to -> its run's date (a hash)
    {ns}:pending              run id -> the version an unfinished export of it writes (a hash: a rerun resumes it;
                              removed once the run is superseded, `abandoned`)
    {ns}:done:<version>       the version's shards written (a hash: shard -> users); `__removed__` once removed: the
                              time its keys expire (Unix ms, the server's clock)
    {ns}:removing             versions being removed (a set: each export's trim passes over them again)
    <ns>:<version>:<user_id>  a user's list (`encode`): integer ids in decimal, string ids as UTF-8, bytes as bytes

A version is removed in steps. One script takes it out of the versions and marks its done hash removed with the time
its keys expire, the server's now + grace_s (no script can point readers at it again, and no writer writes it
again); then its keys are found (SCAN) and given that expiry (PEXPIREAT), so a reader that read the pointer before
still reads its list for grace_s; the first pass that starts after that time deletes whatever of it is left (UNLINK)
and ends the removal. A writer checks the mark after each round trip of SETs and expires what it just wrote when it
finds it, so no key of a removed version outlives it: a writer's keys written before the mark are found by the passes
(SCAN returns every key that exists throughout it), those written after by the writer itself, or by the last pass if
the writer died first. A reader (`Reader`) reads the pointer, then the user's key of that version: a user the version
does not hold gets None ("no list"), never another version's list.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import time
import urllib.parse
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage as S
from pipeline.config import Serving, check_serving
from pipeline.config import masked_url as masked
from pipeline.signals import ray_cause

log = logging.getLogger("genrec.serving")

NAME, SECTION, BEFORE = "Redis", "serving", "the version before"

FORMAT = 1  # the first byte of every list value (`encode`)
SAFE_POLICIES = ("noeviction",)  # a maxmemory-policy that never drops a key
USERS_PER_PIPELINE = 1000  # SETs a writer sends in one round trip
REMOVE_BATCH = 1000  # keys a removal pass expires or deletes in one round trip

REMOVED = "__removed__"  # the done hash's mark of a removed version: when its keys expire (kept TOMBSTONE_S)
TOMBSTONE_S = 7 * 86400

SWITCH = """
local now = redis.call('GET', KEYS[1])
if now == ARGV[2] then return {2, now} end
if (now or '') ~= ARGV[1] then return {0, now or ''} end
if redis.call('HEXISTS', KEYS[5], ARGV[7]) == 1 then return {3, ''} end
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[5])) do total = total + tonumber(v) end
if redis.call('HLEN', KEYS[5]) ~= tonumber(ARGV[4]) or total ~= tonumber(ARGV[5]) then return {4, ''} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('LREM', KEYS[2], 0, ARGV[2])
redis.call('LPUSH', KEYS[2], ARGV[2])
if redis.call('HGET', KEYS[3], ARGV[3]) == ARGV[2] then redis.call('HDEL', KEYS[3], ARGV[3]) end
redis.call('HSET', KEYS[4], ARGV[2], ARGV[6])
return {1, now or ''}
"""  # KEYS current, versions, pending, dates, done:V; ARGV expected ('': none), V, run id, shards, users, run date,
# REMOVED -> {1: switched | 2: V already current | 0: another version is (its name) | 3: V removed | 4: V incomplete}

MARK_REMOVED = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[6])
redis.call('HSETNX', KEYS[5], ARGV[4], string.format('%d', expiry))
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[3]))
redis.call('LREM', KEYS[2], 0, ARGV[1])
if redis.call('HGET', KEYS[3], ARGV[2]) == ARGV[1] then redis.call('HDEL', KEYS[3], ARGV[2]) end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('SADD', KEYS[6], ARGV[1])
return 1
"""  # version ARGV[1] (run ARGV[2]) marked removed (ARGV[4] -> when its keys expire: now + ARGV[6] ms, its first
# removal's) in its done hash KEYS[5] (which expires after ARGV[3] s), out of the versions KEYS[2], pending KEYS[3]
# and dates KEYS[4], into removing KEYS[6]: REMOVE's and ROLLBACK's end

REMOVE = (
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then return 0 end
if ARGV[5] == 'unlisted' and redis.call('LPOS', KEYS[2], ARGV[1]) then return 0 end
"""
    + MARK_REMOVED
)  # KEYS current, versions, pending, dates, done:V, removing; ARGV V, its run id, TOMBSTONE_S,
# REMOVED, 'unlisted' (only a version never switched to) or '', grace ms -> 1, or 0 when V is current, or listed with
# 'unlisted' (not removed). Running it twice does what running it once does.

PENDING = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v then return v end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return ARGV[2]
"""  # KEYS pending; ARGV run id, a new version -> the version an export of the run writes (an unfinished one's)

ROLLBACK = (
    """
local now = redis.call('GET', KEYS[1])
if now == ARGV[5] and redis.call('HEXISTS', KEYS[5], ARGV[4]) == 1 then return 1 end
if now ~= ARGV[1] or not redis.call('LPOS', KEYS[2], ARGV[5]) then return 0 end
if redis.call('HEXISTS', KEYS[7], ARGV[4]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[5])
"""
    + MARK_REMOVED
)  # KEYS current, versions, pending, dates, done:cur, removing, done:prev; ARGV cur, its run id,
# TOMBSTONE_S, REMOVED, prev, grace ms -> 1: the pointer on prev and cur removed (also when a retry finds it done), 0:
# it moved

NOW_MS = """
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""  # KEYS any key of the slot to ask (a cluster's node) -> the server's time, Unix ms


def check_uri(uri: str) -> str | None:
    return None if urllib.parse.urlsplit(uri).scheme in ("redis", "rediss") else "must be redis:// or rediss://"


def target(uri: str, options: dict) -> Serving:
    """`genrec-batch export --to redis://...` -> the serving section it exports with (its flags)."""
    names = ("namespace", "keep", "retry_s", "writers", "allow_eviction", "allow_no_persistence", "allow_older")
    return Serving(uri, **{name: options[name] for name in (*names, "grace_s") if name in options})


def check(t: Serving, storage) -> None:
    """The plan's check of the serving section: its settings (the store itself is checked as the export starts)."""
    check_serving(t)


def refusals() -> list:
    from redis.exceptions import RedisClusterException, RedisError

    not_transient = (FileNotFoundError, ValueError, PermissionError, RedisError, RedisClusterException)
    return [(Raced, 3), (S.StoreUnavailable, 4), (not_transient, 2)]


def shown(uri: str) -> str:
    return masked(uri)


def export_flags(t: Serving) -> str:
    return f"--namespace {t.namespace}"


class Refused(ValueError):
    """The store, the namespace or the run cannot be exported to safely: exit 2, nothing written."""


class Raced(RuntimeError):
    """Another export switched the pointer after this one started: exit 3; this export's version is removed and
    the pointer names the other's."""


@dataclass(frozen=True)
class Keys:
    ns: str

    def control(self, name: str) -> str:
        return f"{{{self.ns}}}:{name}"

    @property
    def current(self) -> str:
        return self.control("current")

    def done(self, version: str) -> str:
        return self.control(f"done:{version}")

    def prefix(self, version: str) -> bytes:
        return f"{self.ns}:{version}:".encode()

    def user(self, version: str, user_id) -> bytes:
        return self.prefix(version) + id_bytes(user_id)

    def scripted(self, *done: str) -> list[str]:
        """The keys the scripts take: current, versions, pending, dates, the done hashes given, removing."""
        return [self.current, *(self.control(n) for n in ("versions", "pending", "dates")), *map(self.done, done)]


def run_of(version: str) -> str:
    """A version (`<run_id>.<nonce>`) -> its run id."""
    return version.rsplit(".", 1)[0]


@dataclass(frozen=True)
class Credentials:
    """The ACL user and password the URL lacks, from REDIS_USERNAME and REDIS_PASSWORD on the driver: handed to the
    writer tasks in memory (never printed: no repr of the password)."""

    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, url: str) -> Credentials:
        u = urllib.parse.urlsplit(url)
        user = None if u.username else os.environ.get("REDIS_USERNAME") or None
        return cls(user, None if u.password else os.environ.get("REDIS_PASSWORD") or None)

    def kwargs(self) -> dict:
        return {k: v for k, v in (("username", self.username), ("password", self.password)) if v}


def id_bytes(user_id) -> bytes:
    """A user id as its key's last part: an integer in decimal, a string as UTF-8, bytes as they are."""
    if isinstance(user_id, bytes):
        return user_id
    if isinstance(user_id, (int, np.integer)) and not isinstance(user_id, bool):
        return str(int(user_id)).encode()
    if isinstance(user_id, str):
        return user_id.encode()
    raise TypeError(f"a user id is an integer, a string or bytes, not {type(user_id).__name__}")


def connect(t: Serving, creds: Credentials | None = None):
    """A client of the store (redis.Redis, or redis.cluster.RedisCluster when the server runs in cluster mode):
    credentials from the URL, else `creds` (default: REDIS_USERNAME and REDIS_PASSWORD here)."""
    import redis
    from redis.cluster import RedisCluster

    extra = (creds or Credentials.of(t.url)).kwargs()
    one = redis.Redis.from_url(t.url, socket_timeout=30, socket_connect_timeout=10, **extra)
    cluster = retrying(lambda: one.info("cluster").get("cluster_enabled") == 1, t, "INFO cluster")
    if not cluster:
        return one
    one.close()
    return RedisCluster.from_url(t.url, socket_timeout=30, socket_connect_timeout=10, **extra)


def transient(e: BaseException) -> bool:
    """Whether a Redis error may pass if the call is tried again: a lost or refused connection, a timeout, a server
    loading its data, a cluster failing over or resharding. Not a refused password or permission."""
    import redis.exceptions as rx

    if isinstance(e, (rx.AuthenticationError, rx.AuthenticationWrongNumberOfArgsError, rx.NoPermissionError)):
        return False
    kinds = (rx.ConnectionError, rx.TimeoutError, rx.BusyLoadingError, rx.TryAgainError, rx.ClusterDownError)
    kinds += (rx.MasterDownError, rx.ReadOnlyError)
    return isinstance(e, kinds)


def retrying(call, t: Serving, what: str):
    """`storage.retrying` for the Redis of `t`: transient errors tried again for serving.retry_s, then
    StoreUnavailable (exit 4) naming the store (without its password)."""
    return S.retrying(call, None, what, t.retry_s, (f"Redis {masked(t.url)}", transient, "serving.retry_s"))


def per_node(client, command: str, *args) -> list[dict]:
    """INFO or CONFIG GET from every primary (a cluster) or the server -> one reply per node."""
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        reply = getattr(client, command)(*args, target_nodes=RedisCluster.PRIMARIES)
        return list(reply.values()) if all(isinstance(v, dict) for v in reply.values()) else [reply]
    return [getattr(client, command)(*args)]


def check_store(client, t: Serving) -> dict:
    """Refused unless the store keeps what it is given, on every primary: its maxmemory-policy never evicts (else
    serving.allow_eviction), and it persists, by RDB snapshots or an append-only file (else
    serving.allow_no_persistence) -> what was found."""
    import redis.exceptions as rx

    memory = retrying(lambda: per_node(client, "info", "memory"), t, "INFO memory")
    policies = {m.get("maxmemory_policy", "unknown") for m in memory}
    evicting = policies - set(SAFE_POLICIES)
    if evicting and not t.allow_eviction:
        raise Refused(
            f"Redis {masked(t.url)}: maxmemory-policy {', '.join(sorted(evicting))} may evict the lists of a version "
            "readers use; set it to noeviction (CONFIG SET maxmemory-policy noeviction), or opt in with "
            "serving.allow_eviction=true"
        )
    persistence = retrying(lambda: per_node(client, "info", "persistence"), t, "INFO persistence")
    try:
        saves = [str(c.get("save", "")) for c in retrying(lambda: per_node(client, "config_get", "save"), t, "CONFIG")]
    except rx.ResponseError:  # a managed Redis may refuse CONFIG: its snapshots are unknown here
        saves = ["unknown"] * len(persistence)
    kept = [int(p.get("aof_enabled", 0)) == 1 or save not in ("", "unknown") for p, save in zip(persistence, saves)]
    if not all(kept) and not t.allow_no_persistence:
        raise Refused(
            f"Redis {masked(t.url)} may not persist ({sum(not k for k in kept)} of {len(kept)} nodes with appendonly "
            f"no and RDB save points {' / '.join(sorted(set(map(repr, saves))))}): a restart would lose every "
            "version; turn on appendonly or RDB snapshots (docs/deploy.md#12-serve-from-redis), or opt in with "
            "serving.allow_no_persistence=true"
        )
    return {"maxmemory_policy": sorted(policies), "appendonly": [int(p.get("aof_enabled", 0)) for p in persistence]}


def encode(items: np.ndarray, scores: np.ndarray) -> bytes:
    """A list (items [n] int64, scores [n] float32, in rank order: rank i+1 at i) -> FORMAT (1 byte), n (uint16), the
    items (int64, little-endian), the scores (float32, little-endian)."""
    return struct.pack("<BH", FORMAT, len(items)) + items.astype("<i8").tobytes() + scores.astype("<f4").tobytes()


def decode(value: bytes) -> list[tuple[int, int, float]]:
    """`encode`'s bytes -> [(rank, item_id, score)]."""
    version, n = struct.unpack_from("<BH", value)
    if version != FORMAT or len(value) != 3 + 12 * n:
        raise ValueError(f"a list value of format {version} and {len(value)} bytes: expected format {FORMAT}")
    items = np.frombuffer(value, "<i8", n, 3)
    scores = np.frombuffer(value, "<f4", n, 3 + 8 * n)
    return [(i + 1, int(items[i]), float(scores[i])) for i in range(n)]


class Reader:
    """The documented read: the pointer, then the user's key of the version it names -> [(rank, item_id, score)],
    or None when the namespace has no version or the version no list for the user."""

    def __init__(self, client, namespace: str):
        self.client, self.keys = client, Keys(namespace)

    def version(self) -> str | None:
        v = self.client.get(self.keys.current)
        return v.decode() if v else None

    def get(self, user_id) -> list[tuple[int, int, float]] | None:
        version = self.version()
        if version is None:
            return None
        value = self.client.get(self.keys.user(version, user_id))
        return decode(value) if value is not None else None


def write_shard(batch: pa.Table, t: Serving, version: str, creds: Credentials, storage) -> pa.Table:
    """Ray Data map over the run's recommendation files (one a row: `file`, `shard`): the file's users written (one
    SET each, USERS_PER_PIPELINE a round trip, each round trip retried as a whole), then the shard recorded in the
    version's done hash -> (shard, users, bytes). The version's removed mark is read before the first round trip and
    after each: found after one, the keys it wrote are given the version's expiry (`expire_own`), and Raced."""
    from pipeline.carry import list_starts

    uri, shard = batch["file"][0].as_py(), batch["shard"][0].as_py()
    recs = S.read_parquet(uri, storage, columns=["user_id", "rank", "item_id", "score"])
    starts = list_starts(recs)
    if starts is None:
        recs = recs.sort_by([("user_id", "ascending"), ("rank", "ascending")])
        starts = list_starts(recs)
        if starts is None:
            raise Refused(f"{uri}: a user's recommendations are not ranks 1, 2, .. of one list")
    ends = np.r_[starts[1:], recs.num_rows]  # [U]
    ids = recs["user_id"].combine_chunks().take(pa.array(starts)).to_pylist()  # [U]
    items = recs["item_id"].combine_chunks().cast(pa.int64()).to_numpy()
    scores = pc.cast(recs["score"].combine_chunks(), pa.float32()).to_numpy(zero_copy_only=False)
    keys, client = Keys(t.namespace), connect(t, creds)
    written = 0
    try:
        expire_own(client, t, version, [])
        for lo in range(0, len(ids), USERS_PER_PIPELINE):
            values = [
                (keys.user(version, ids[u]), encode(items[starts[u] : ends[u]], scores[starts[u] : ends[u]]))
                for u in range(lo, min(lo + USERS_PER_PIPELINE, len(ids)))
            ]
            retrying(lambda v=values: _set_all(client, v), t, f"SET {len(values)} lists of {version}")
            written += sum(len(v) for _, v in values)
            expire_own(client, t, version, [key for key, _ in values])
        retrying(lambda: client.hset(keys.done(version), shard, len(ids)), t, f"HSET {keys.done(version)}")
    finally:
        client.close()
    return pa.table({"shard": [shard], "users": [len(ids)], "bytes": [written]})


def expire_own(client, t: Serving, version: str, written: list[bytes]) -> None:
    """A writer's check of its version: when it is marked removed, the keys it just wrote (`written`) are given the
    version's expiry (at once if that has passed), and Raced; else nothing."""
    done = Keys(t.namespace).done(version)
    expiry = retrying(lambda: client.hget(done, REMOVED), t, f"HGET {done}")
    if expiry is None:
        return
    if written:
        retrying(lambda: _per_key(client, "pexpireat", written, int(expiry)), t, f"PEXPIREAT {len(written)} keys")
    raise Raced(f"version {version} was removed while this export wrote it (a rollback or another export)")


def _set_all(client, values: list[tuple[bytes, bytes]]) -> None:
    pipe = client.pipeline(transaction=False)
    for key, value in values:
        pipe.set(key, value)
    pipe.execute()


def _per_key(client, command: str, keys: list[bytes], *args) -> int:
    """One command per key in one round trip (a cluster's keys lie in many slots) -> how many it applied to."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        getattr(pipe, command)(key, *args)
    return sum(map(int, pipe.execute()))


@dataclass(frozen=True)
class Export:
    """What an export did (`export`'s return; the nightly prints it under `serving`)."""

    url: str  # without its password
    namespace: str
    run_id: str
    version: str  # the version its lists are under
    previous: str | None  # the version the pointer named before
    switched: bool  # False: the run already was the current version
    users: int
    bytes: int
    resumed_shards: int  # shards an earlier export of the run had written
    seconds: float
    removed: list[str]  # versions removed after the switch (their keys expire serving.grace_s later)
    removal_error: str | None = None  # a removal that failed after the switch (the next export's trim finishes it)
    skipped: str | None = None  # why the pointer was not switched: the run is no longer its date's published run

    def record(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def export(run, t: Serving) -> Export:
    """A published run (pipeline.output.PublishedRun) -> its lists written under a version of its own (an unfinished
    export's, resumed), counted against its manifest, the pointer switched to it (compare-and-set against the
    version found at the start), versions beyond `keep` previous ones removed. A run that is not, or no longer, its
    date's published run (superseded by a later run of its date, which exports itself) is never switched to: the
    export is `skipped` (its version, if written, removed). Raises Refused (exit 2), Raced (exit 3),
    StoreUnavailable (exit 4); a removal that fails after the switch is recorded, not raised."""
    check_serving(t)
    start, creds = time.perf_counter(), Credentials.of(t.url)
    client, keys, run_id = connect(t, creds), Keys(t.namespace), run.run_id
    if (why := superseded(run)) is not None:
        removed, error = after(lambda: abandoned(client, t, run), "removing its unfinished version")
        client.close()
        return Export(masked(t.url), t.namespace, run_id, "", None, False, 0, 0, 0, 0.0, removed, error, why)
    try:
        check_store(client, t)
        previous = _str(retrying(lambda: client.get(keys.current), t, f"GET {keys.current}"))
        if previous and run_of(previous) == run_id:
            log.info("export: %s is already the current version of %s at %s", run_id, t.namespace, masked(t.url))
            return Export(masked(t.url), t.namespace, run_id, previous, previous, False, 0, 0, 0, 0.0, [])
        check_newer(client, t, keys, previous, run.run_date)
        log.info("export: run %s to %s namespace %s, whose version is %s", run_id, masked(t.url), t.namespace, previous)
        version = version_of(client, t, run_id)
        names = run.manifest["files"]["recommendations"]
        files = {n.removesuffix(".parquet"): f for n, f in zip(names, run.files("recommendations"), strict=True)}
        resumed, size, users = write_and_count(run, t, version, files, creds, client)
        if (why := superseded(run)) is not None:  # while it wrote: its successor's export is the one to switch
            remove_version(client, t, version, unlisted=True)
            took = time.perf_counter() - start
            return Export(masked(t.url), t.namespace, run_id, version, previous, False, users, size, resumed, took, [],
                          skipped=why)  # fmt: skip
        version = switch(client, t, run, version, previous, len(files), users)
        removed, error = after(lambda: trim(client, t) + abandoned(client, t, run), "removing old versions")
        took = time.perf_counter() - start
        url = masked(t.url)
        return Export(url, t.namespace, run_id, version, previous, True, users, size, resumed, took, removed, error)
    finally:
        client.close()


commit_run = export  # the Sink protocol's name (pipeline/stores/base.py)


def write_and_count(run, t: Serving, version: str, files: dict, creds: Credentials, client) -> tuple[int, int, int]:
    """The run's lists written under `version` (`write_version`) and counted (`counted`) -> (shards resumed, bytes,
    users); zeros where the writes raced the version's removal because the run was superseded meanwhile (Raced: its
    successor's export removed it, `abandoned`)."""
    try:
        resumed, size = write_version(run, t, version, files, creds, client)
        return resumed, size, counted(client, t, run, version, files)
    except Exception as e:
        if not isinstance(ray_cause(e), Raced) or superseded(run) is None:
            raise
        return 0, 0, 0


def superseded(run) -> str | None:
    """Why a run is not its date's published run now (`runs.unpublished`), or None."""
    from pipeline import runs

    why = runs.unpublished(run.uri, run.storage)
    if why is not None:
        log.info("export: run %s is not exported: it is not its date's published run (%s)", run.run_id, why)
    return None if why is None else f"not published: {why}"


def version_of(client, t: Serving, run_id: str) -> str:
    """The version an export of `run_id` writes: an unfinished export's (`{ns}:pending`), else a new one."""
    import uuid

    pending, new = Keys(t.namespace).control("pending"), f"{run_id}.{uuid.uuid4().hex[:8]}"
    return _str(retrying(lambda: client.eval(PENDING, 1, pending, run_id, new), t, f"version of {run_id}"))


def write_version(run, t: Serving, version: str, files: dict, creds: Credentials, client) -> tuple[int, int]:
    """The run's shards the version's done hash lacks, written by Ray tasks (`write_shard`, serving.writers at once)
    -> (shards an earlier export had written, bytes of list values written now)."""
    import ray

    done = written(client, t, version)
    todo = [{"file": f, "shard": s} for s, f in files.items() if s not in done]
    log.info("export: version %s: %d shards, %d already written", version, len(files), len(files) - len(todo))
    if not todo:
        return len(files), 0
    ds = ray.data.from_items(todo).map_batches(
        write_shard,
        batch_size=1,
        batch_format="pyarrow",
        compute=ray.data.TaskPoolStrategy(size=t.writers),
        fn_kwargs={"t": t, "version": version, "creds": creds, "storage": run.storage},
    )
    ds.context.raise_original_map_exception = True
    size = sum(int(pc.sum(b["bytes"]).as_py() or 0) for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    return len(files) - len(todo), size


def counted(client, t: Serving, run, version: str, files: dict) -> int:
    """The users the version's done hash counts -> their number; Refused unless it holds every shard of the run and
    as many users with a list as its manifest says."""
    done, expected = written(client, t, version), int(run.manifest["counts"]["users_ok"])
    users = sum(done.get(s, 0) for s in files)
    if set(files) - set(done) or users != expected:
        raise Refused(
            f"export of {run.run_id}: its files hold {users} users with a list in {len(set(files) & set(done))} of "
            f"{len(files)} shards, its manifest says {expected}: the pointer is not switched"
        )
    return users


def switch(client, t: Serving, run, version: str, previous: str | None, shards: int, users: int) -> str:
    """The pointer from `previous` to `version` (`SWITCH`) -> the version readers now use: `version`, or another
    export's of the same run that switched first. Raced (this export's version removed) when another export or a
    rollback moved it to another run, or removed the version."""
    keys = Keys(t.namespace)
    names = keys.scripted(version)
    args = (previous or "", version, run.run_id, shards, users, run.run_date, REMOVED)
    outcome, now = retrying(lambda: client.eval(SWITCH, len(names), *names, *args), t, "switch")
    if outcome in (0, 3):
        try:  # only a version never switched to: one that was (a retried switch, an export of the same run) is kept
            remove_version(client, t, version, unlisted=True)
        except Exception as e:
            log.warning("export: could not remove version %s (%s); the next export's trim does", version, e)
        if _str(now) and run_of(_str(now)) == run.run_id:  # an export of the same run switched first: its lists
            log.info("export: %s already reads run %s (version %s)", keys.current, run.run_id, _str(now))
            return _str(now)
        raise Raced(
            f"export of {run.run_id}: another export or a rollback changed {keys.current} (now {_str(now) or 'none'}) "
            f"after this one started from {previous or 'none'}; this export's version is removed, readers see the "
            "other's"
        )
    if outcome == 4:
        raise Refused(f"export of {run.run_id}: version {version}'s shards changed before the switch; run it again")
    log.info("export: %s now reads %s (was %s)", keys.current, version, previous or "nothing")
    return version


def after(remove, what: str) -> tuple[list[str], str | None]:
    """A removal after the export's outcome is settled (`trim`, `abandoned`) -> (versions removed, the error that
    cut it short: the outcome stands, and the next export finishes the removal)."""
    try:
        return remove(), None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        log.warning("export: %s failed (%s), the next export retries", what, error)
        return [], error


def abandoned(client, t: Serving, run) -> list[str]:
    """The versions that unfinished exports of the superseded runs of `run`'s date left (`{ns}:pending`: an export
    died part-way, then a rerun of the date published) removed, `run`'s own if it is superseded (`remove_version`:
    their keys expire grace_s later) -> them. No export switches to a superseded run's version, and no rerun resumes
    it: left, its keys would outlive it. A run of another date or output is its own export's."""
    from pipeline import runs

    pending = Keys(t.namespace).control("pending")
    date = run.uri.rstrip("/").rpartition("/")[0]
    out = []
    for rid, version in sorted(retrying(lambda: client.hgetall(pending), t, f"HGETALL {pending}").items()):
        folder = S.join(date, f"run_id={rid.decode()}")
        if runs.complete(folder, run.storage) and runs.unpublished(folder, run.storage) is not None:
            out += [version.decode()] * remove_version(client, t, version.decode(), unlisted=True)
    return out


def check_newer(client, t: Serving, keys: Keys, current: str | None, run_date: str) -> None:
    """Refused when the current version's run is of a later date than the run's (readers would go back a night),
    unless serving.allow_older."""
    if current is None or t.allow_older:
        return
    dates = keys.control("dates")
    date = _str(retrying(lambda: client.hget(dates, current), t, f"HGET {dates}"))
    if date and date > run_date:
        raise Refused(
            f"the current version of {t.namespace} serves run_date {date}, later than this run's {run_date}: readers "
            "would go back; opt in with serving.allow_older=true (--allow-older), or roll back (--rollback)"
        )


def written(client, t: Serving, version: str) -> dict[str, int]:
    """A version's done hash (shard -> users); Raced when the version was removed meanwhile."""
    done = {
        k.decode(): int(v)
        for k, v in retrying(lambda: client.hgetall(Keys(t.namespace).done(version)), t, "HGETALL").items()
    }
    if REMOVED in done:
        raise Raced(f"version {version} was removed while this export wrote it (a rollback or another export); rerun")
    return done


def _str(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v or None


def versions(client, t: Serving) -> list[str]:
    """The versions switched to, newest first: the current one, then the kept ones."""
    name = Keys(t.namespace).control("versions")
    return [v.decode() for v in retrying(lambda: client.lrange(name, 0, -1), t, f"LRANGE {name}")]


def trim(client, t: Serving) -> list[str]:
    """The versions beyond the current one and `keep` previous ones removed (readable grace_s more), then a pass over
    every version being removed (`pass_over`: the ones removed now, and earlier ones whose removal is not over) ->
    the versions removed now."""
    removed = [v for v in versions(client, t)[t.keep + 1 :] if remove_version(client, t, v, unlink=False)]
    removing = Keys(t.namespace).control("removing")
    for version in sorted(v.decode() for v in retrying(lambda: client.smembers(removing), t, f"SMEMBERS {removing}")):
        pass_over(client, t, version)
    return removed


def remove_version(client, t: Serving, version: str, unlink: bool = True, unlisted: bool = False) -> bool:
    """A version taken out of the versions and marked removed (`REMOVE`: never again switched or rolled back to, its
    keys to expire grace_s from now), then, with `unlink`, a pass over its keys (`pass_over`) -> False when it is the
    current version, or with `unlisted` one that was switched to (nothing done)."""
    keys = Keys(t.namespace)
    names = [*keys.scripted(version), keys.control("removing")]
    args = (version, run_of(version), TOMBSTONE_S, REMOVED, "unlisted" if unlisted else "", grace_ms(t))
    if not retrying(lambda: client.eval(REMOVE, len(names), *names, *args), t, f"remove {version}"):
        return False
    if unlink:
        pass_over(client, t, version)
    return True


def grace_ms(t: Serving) -> int:
    """serving.grace_s in whole milliseconds (at least one: PEXPIREAT's unit)."""
    return max(1, round(t.grace_s * 1000))


def pass_over(client, t: Serving, version: str) -> bool:
    """One pass over a removed version's keys (SCAN by its prefix on every primary of a cluster, REMOVE_BATCH keys a
    round trip, the whole pass tried again on a transient error): before the expiry its mark holds, each key is
    given that expiry (PEXPIREAT: readers of the version keep their lists until then); a pass that starts after it
    deletes them (UNLINK) and ends the removal (the version leaves the removing set) -> whether it ended."""
    keys = Keys(t.namespace)
    done, current = keys.done(version), keys.current
    expiry = int(retrying(lambda: client.hget(done, REMOVED), t, f"HGET {done}") or 0)  # 0: its mark expired
    final = retrying(lambda: client.eval(NOW_MS, 1, current), t, "TIME") >= expiry
    pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", keys.prefix(version)) + b"*"
    command, args = ("unlink", ()) if final else ("pexpireat", (expiry,))

    def scan() -> int:
        n, batch = 0, []
        for key in client.scan_iter(match=pattern, count=REMOVE_BATCH):
            batch.append(key)
            if len(batch) >= REMOVE_BATCH:
                n, batch = n + _per_key(client, command, batch, *args), []
        return n + (_per_key(client, command, batch, *args) if batch else 0)

    n = retrying(scan, t, f"SCAN and {command.upper()} {pattern.decode()}")
    if final:
        retrying(lambda: client.srem(keys.control("removing"), version), t, "SREM")
        log.info("export: version %s of %s removed (%d keys deleted)", version, t.namespace, n)
    else:
        log.info("export: version %s of %s removed: its %d keys expire in %.0f s", version, t.namespace, n, t.grace_s)
    return final


def rollback(t: Serving) -> tuple[str, str]:
    """The pointer moved back to the previous kept version (`ROLLBACK`, a compare-and-set), the rolled-back version
    removed (readable grace_s more) -> (from, to). Refused when there is no previous version, Raced when the pointer
    moved meanwhile."""
    check_serving(t)
    client, keys = connect(t), Keys(t.namespace)
    try:
        kept = versions(client, t)
        now = _str(retrying(lambda: client.get(keys.current), t, "GET"))
        if len(kept) < 2 or kept[0] != now:
            raise Refused(f"namespace {t.namespace} at {masked(t.url)}: no previous version to roll back to ({kept})")
        names = [*keys.scripted(kept[0]), keys.control("removing"), keys.done(kept[1])]
        args = (kept[0], run_of(kept[0]), TOMBSTONE_S, REMOVED, kept[1], grace_ms(t))
        if not retrying(lambda: client.eval(ROLLBACK, len(names), *names, *args), t, "rollback"):
            raise Raced(f"namespace {t.namespace}: the pointer moved during the rollback; nothing changed")
        log.info("export: %s rolled back from %s to %s", keys.current, kept[0], kept[1])
        try:
            pass_over(client, t, kept[0])
        except Exception as e:  # the rollback stands; the next export's trim expires the rest
            log.warning("export: rolled back; expiring %s failed (%s), the next export's trim does", kept[0], e)
        return kept[0], kept[1]
    finally:
        client.close()
