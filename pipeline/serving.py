"""A published run served from Redis (docs/output.md#serving-from-redis): each user's list under a key of the run's
own version, one pointer per namespace naming the version readers use, switched only once every user of the run is
written and counted against its manifest, by a compare-and-set (a Lua script) against the version the export started
from; the previous `keep` versions stay for `--rollback`, older ones are unlinked after the switch.

Keys (`ns`: serving.namespace; `{ns}` in braces is a Redis Cluster hash tag: the control keys share one slot, so
one script switches them together, while the users' keys spread over every slot):
    {ns}:current              the version readers use (a run id); absent: none yet
    {ns}:versions             the versions switched to, newest first (a list): the current one, then the kept ones
    {ns}:done:<run_id>        the run's exported shards (a hash: shard -> users written), for a rerun to resume
    <ns>:<run_id>:<user_id>   a user's list (`encode`): integer ids in decimal, string ids as UTF-8, bytes as bytes

A reader (`Reader`) reads the pointer, then the user's key of that version: a user the version does not hold gets
None ("no list"), never another version's list.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import time
import urllib.parse
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage as S
from pipeline.config import Serving, check_serving
from pipeline.config import masked_url as masked

log = logging.getLogger("genrec.serving")

FORMAT = 1  # the first byte of every list value (`encode`)
SAFE_POLICIES = ("noeviction",)  # a maxmemory-policy that never drops a key
USERS_PER_PIPELINE = 1000  # SETs a writer sends in one round trip
UNLINK_BATCH = 1000  # keys one UNLINK deletes when a version is removed

SWITCH = """
local now = redis.call('GET', KEYS[1])
if (now or '') ~= ARGV[1] then return {0, now or ''} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('LREM', KEYS[2], 0, ARGV[2])
redis.call('LPUSH', KEYS[2], ARGV[2])
return {1, now or ''}
"""  # compare-and-set the pointer (KEYS[1]) from ARGV[1] ('' : none) to ARGV[2], which heads the versions (KEYS[2])

ROLLBACK = """
local now = redis.call('GET', KEYS[1])
if (now or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('LREM', KEYS[2], 0, ARGV[1])
return 1
"""  # the pointer (KEYS[1]) from ARGV[1] back to ARGV[2], the rolled-back version dropped from the versions (KEYS[2])


class Refused(ValueError):
    """The store, the namespace or the run cannot be exported to safely: exit 2, nothing written."""


class Raced(RuntimeError):
    """Another export switched the pointer after this one started: exit 3; this export's version is removed and
    the pointer names the other's."""


@dataclass(frozen=True)
class Keys:
    ns: str

    @property
    def current(self) -> str:
        return f"{{{self.ns}}}:current"

    @property
    def versions(self) -> str:
        return f"{{{self.ns}}}:versions"

    def done(self, run_id: str) -> str:
        return f"{{{self.ns}}}:done:{run_id}"

    def prefix(self, run_id: str) -> bytes:
        return f"{self.ns}:{run_id}:".encode()

    def user(self, run_id: str, user_id) -> bytes:
        return self.prefix(run_id) + id_bytes(user_id)


def id_bytes(user_id) -> bytes:
    """A user id as its key's last part: an integer in decimal, a string as UTF-8, bytes as they are."""
    if isinstance(user_id, bytes):
        return user_id
    if isinstance(user_id, (int, np.integer)) and not isinstance(user_id, bool):
        return str(int(user_id)).encode()
    if isinstance(user_id, str):
        return user_id.encode()
    raise TypeError(f"a user id is an integer, a string or bytes, not {type(user_id).__name__}")


def connect(t: Serving):
    """A client of the store (redis.Redis, or redis.cluster.RedisCluster when the server runs in cluster mode):
    credentials from the URL, else REDIS_USERNAME and REDIS_PASSWORD."""
    import redis
    from redis.cluster import RedisCluster

    env = {k: v for k, v in (("username", "REDIS_USERNAME"), ("password", "REDIS_PASSWORD")) if os.environ.get(v)}
    u = urllib.parse.urlsplit(t.url)
    creds = {k: os.environ[v] for k, v in env.items() if getattr(u, k) is None}
    one = redis.Redis.from_url(t.url, socket_timeout=30, socket_connect_timeout=10, **creds)
    cluster = retrying(lambda: one.info("cluster").get("cluster_enabled") == 1, t, "INFO cluster")
    if not cluster:
        return one
    one.close()
    return RedisCluster.from_url(t.url, socket_timeout=30, socket_connect_timeout=10, **creds)


def transient(e: BaseException) -> bool:
    """Whether a Redis error may pass if the call is tried again: a lost or refused connection, a timeout, a server
    loading its data, a cluster failing over or resharding."""
    import redis.exceptions as rx

    kinds = (rx.ConnectionError, rx.TimeoutError, rx.BusyLoadingError, rx.TryAgainError, rx.ClusterDownError)
    kinds += (rx.MasterDownError, rx.ReadOnlyError)
    return isinstance(e, kinds)


def retrying(call, t: Serving, what: str):
    """`storage.retrying` for the Redis of `t`: transient errors tried again for serving.retry_s, then
    StoreUnavailable (exit 4) naming the store (without its password)."""
    return S.retrying(call, None, what, t.retry_s, (f"Redis {masked(t.url)}", transient, "serving.retry_s"))


def check_store(client, t: Serving) -> dict:
    """Refused unless the store keeps what it is given, on every node: its maxmemory-policy never evicts (else
    serving.allow_eviction), and it persists, by RDB snapshots or an append-only file (else
    serving.allow_no_persistence) -> what was found."""
    found = {"maxmemory_policy": set(), "appendonly": set(), "save": set()}
    for memory in nodes(retrying(lambda: client.info("memory"), t, "INFO memory")):
        found["maxmemory_policy"].add(memory.get("maxmemory_policy", "unknown"))
    evicting = found["maxmemory_policy"] - set(SAFE_POLICIES)
    if evicting and not t.allow_eviction:
        raise Refused(
            f"Redis {masked(t.url)}: maxmemory-policy {', '.join(sorted(evicting))} may evict the lists of a version "
            "readers use; set it to noeviction (CONFIG SET maxmemory-policy noeviction), or opt in with "
            "serving.allow_eviction=true"
        )
    for persistence in nodes(retrying(lambda: client.info("persistence"), t, "INFO persistence")):
        found["appendonly"].add(int(persistence.get("aof_enabled", 0)) == 1)
    try:
        saves = nodes(retrying(lambda: client.config_get("save"), t, "CONFIG GET save"))
        found["save"] = {str(c.get("save", "")) for c in saves}
    except Exception:  # a managed Redis may refuse CONFIG: its snapshots are unknown here
        found["save"] = {"unknown"}
    if (False in found["appendonly"]) and ("" in found["save"] or "unknown" in found["save"]):
        if not t.allow_no_persistence:
            raise Refused(
                f"Redis {masked(t.url)} may not persist (appendonly no; RDB save points "
                f"{' / '.join(repr(v) for v in sorted(found['save']))}): a restart would lose every version; turn on "
                "appendonly or RDB snapshots (docs/deploy.md#redis), or opt in with serving.allow_no_persistence=true"
            )
    return {k: sorted(v, key=str) for k, v in found.items()}


def nodes(reply) -> list[dict]:
    """A reply -> one dict per node (a cluster client answers INFO and CONFIG GET per node: {node: reply})."""
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        return list(reply.values())
    return [reply]


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


def write_shard(batch: pa.Table, t: Serving, run_id: str, storage) -> pa.Table:
    """Ray Data map over the run's recommendation files (one a row: `file`, `shard`): the file's users written (one
    SET each, USERS_PER_PIPELINE a round trip, each round trip retried as a whole), then the shard recorded in the
    run's done hash -> (shard, users, bytes)."""
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
    keys, client = Keys(t.namespace), connect(t)
    written = 0
    try:
        for lo in range(0, len(ids), USERS_PER_PIPELINE):
            chunk = range(lo, min(lo + USERS_PER_PIPELINE, len(ids)))
            values = [
                (keys.user(run_id, ids[u]), encode(items[starts[u] : ends[u]], scores[starts[u] : ends[u]]))
                for u in chunk
            ]
            retrying(lambda v=values: _set_all(client, v), t, f"SET {len(values)} lists of {run_id}")
            written += sum(len(v) for _, v in values)
        retrying(lambda: client.hset(keys.done(run_id), shard, len(ids)), t, f"HSET {keys.done(run_id)}")
    finally:
        client.close()
    return pa.table({"shard": [shard], "users": [len(ids)], "bytes": [written]})


def _set_all(client, values: list[tuple[bytes, bytes]]) -> None:
    pipe = client.pipeline(transaction=False)
    for key, value in values:
        pipe.set(key, value)
    pipe.execute()


@dataclass(frozen=True)
class Export:
    """What an export did (`export`'s return; the nightly's manifest records it under `serving`)."""

    url: str  # without its password
    namespace: str
    run_id: str
    previous: str | None  # the version the pointer named before
    switched: bool  # False: the run was already the current version
    users: int
    bytes: int
    resumed_shards: int  # shards an earlier export of the run had written
    seconds: float
    removed: list[str]  # versions removed after the switch

    def record(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def export(run, t: Serving) -> Export:
    """A published run (pipeline.output.PublishedRun) -> its lists written under its version, counted against its
    manifest, the pointer switched to it (compare-and-set against the version found at the start), versions beyond
    `keep` previous ones removed. Raises Refused (exit 2), Raced (exit 3), StoreUnavailable (exit 4)."""
    import ray

    check_serving(t)
    start = time.perf_counter()
    client, keys, run_id = connect(t), Keys(t.namespace), run.run_id
    try:
        check_store(client, t)
        previous = _str(retrying(lambda: client.get(keys.current), t, f"GET {keys.current}"))
        if previous == run_id:
            log.info("export: %s is already the current version of %s at %s", run_id, t.namespace, masked(t.url))
            return Export(masked(t.url), t.namespace, run_id, previous, False, 0, 0, 0, 0.0, [])
        expected = int(run.manifest["counts"]["users_ok"])
        files = {
            name.removesuffix(".parquet"): f
            for name, f in zip(run.manifest["files"]["recommendations"], run.files("recommendations"), strict=True)
        }
        done = {
            k.decode(): int(v) for k, v in retrying(lambda: client.hgetall(keys.done(run_id)), t, "HGETALL").items()
        }
        todo = [{"file": f, "shard": s} for s, f in files.items() if s not in done]
        log.info(
            "export: run %s (%d users, %d shards, %d already written) to %s namespace %s",
            run_id,
            expected,
            len(files),
            len(files) - len(todo),
            masked(t.url),
            t.namespace,
        )
        users, size = 0, 0
        if todo:
            ds = ray.data.from_items(todo).map_batches(
                write_shard,
                batch_size=1,
                batch_format="pyarrow",
                concurrency=t.writers,
                fn_kwargs={"t": t, "run_id": run_id, "storage": run.storage},
            )
            ds.context.raise_original_map_exception = True
            for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                users += int(pc.sum(b["users"]).as_py() or 0)
                size += int(pc.sum(b["bytes"]).as_py() or 0)
        done = {
            k.decode(): int(v) for k, v in retrying(lambda: client.hgetall(keys.done(run_id)), t, "HGETALL").items()
        }
        counted = sum(done[s] for s in files if s in done)
        if set(files) - set(done) or counted != expected:
            raise RuntimeError(
                f"export of {run_id}: {counted} users in {len(set(files) & set(done))} of {len(files)} shards written, "
                f"the manifest has {expected}: the pointer is not switched"
            )
        ok, now = retrying(
            lambda: client.eval(SWITCH, 2, keys.current, keys.versions, previous or "", run_id), t, "switch"
        )
        if not ok:
            remove_version(client, t, run_id)
            raise Raced(
                f"export of {run_id}: another export switched {keys.current} to {_str(now) or 'nothing'} after this "
                "one "
                f"started from {previous or 'nothing'}; this export's version is removed, readers see the other's"
            )
        log.info("export: %s now reads %s (was %s)", keys.current, run_id, previous or "nothing")
        removed = trim(client, t)
        took = time.perf_counter() - start
        return Export(
            masked(t.url), t.namespace, run_id, previous, True, counted, size, len(files) - len(todo), took, removed
        )
    finally:
        client.close()


def _str(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v or None


def versions(client, t: Serving) -> list[str]:
    """The versions switched to, newest first: the current one, then the kept ones."""
    keys = Keys(t.namespace)
    return [v.decode() for v in retrying(lambda: client.lrange(keys.versions, 0, -1), t, f"LRANGE {keys.versions}")]


def trim(client, t: Serving) -> list[str]:
    """The versions beyond the current one and `keep` previous ones, removed (their keys unlinked, then they leave
    the list) -> their run ids."""
    old = versions(client, t)[t.keep + 1 :]
    for run_id in old:
        remove_version(client, t, run_id)
        retrying(lambda r=run_id: client.lrem(Keys(t.namespace).versions, 0, r), t, "LREM")
    return old


def remove_version(client, t: Serving, run_id: str) -> int:
    """A version's keys unlinked (SCAN by its prefix, UNLINK_BATCH at a time; every primary of a cluster) and its
    done hash -> keys removed. Never the current version's."""
    keys = Keys(t.namespace)
    if _str(retrying(lambda: client.get(keys.current), t, "GET")) == run_id:
        raise Refused(f"version {run_id} is the current one of {t.namespace}: not removed")
    pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", keys.prefix(run_id)) + b"*"
    n, batch = 0, []
    for key in client.scan_iter(match=pattern, count=UNLINK_BATCH):
        batch.append(key)
        if len(batch) >= UNLINK_BATCH:
            n += retrying(lambda b=batch: _unlink(client, b), t, "UNLINK")
            batch = []
    if batch:
        n += retrying(lambda b=batch: _unlink(client, b), t, "UNLINK")
    retrying(lambda: client.delete(keys.done(run_id)), t, "DEL")
    log.info("export: version %s of %s removed (%d keys)", run_id, t.namespace, n)
    return n


def _unlink(client, batch: list[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for key in batch:
        pipe.unlink(key)  # one key a command: a cluster's keys lie in many slots
    return sum(pipe.execute())


def rollback(t: Serving) -> tuple[str, str]:
    """The pointer moved back to the previous kept version (compare-and-set), the rolled-back version removed ->
    (from, to). Refused when there is no previous version."""
    check_serving(t)
    client, keys = connect(t), Keys(t.namespace)
    try:
        kept = versions(client, t)
        now = _str(retrying(lambda: client.get(keys.current), t, "GET"))
        if len(kept) < 2 or kept[0] != now:
            raise Refused(f"namespace {t.namespace} at {masked(t.url)}: no previous version to roll back to ({kept})")
        ok = retrying(lambda: client.eval(ROLLBACK, 2, keys.current, keys.versions, kept[0], kept[1]), t, "rollback")
        if not ok:
            raise Raced(f"namespace {t.namespace}: the pointer moved during the rollback; nothing changed")
        remove_version(client, t, kept[0])
        log.info("export: %s rolled back from %s to %s", keys.current, kept[0], kept[1])
        return kept[0], kept[1]
    finally:
        client.close()
