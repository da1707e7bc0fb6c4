"""The object store's retry policy (pipeline/storage.py) on a real SeaweedFS behind a proxy that counts the requests
and injects faults (tests/servers.py StoreProxy): a shard costs its four PUTs; transient errors (throttling, reset
connections) are retried until they pass and only then; permanent ones (access denied, no such bucket, a failed
condition) fail at the first request; a conditional put whose answer was lost is recognised as the caller's own; a
store down for longer than storage.retry_s ends in StoreUnavailable naming the store, the URI and the cause; the lease
is released best effort; the output store check races conditional puts, counting a racer whose answer was lost once,
and refuses a gateway that checks, then writes."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import time

import pyarrow as pa
import pytest

from operators.outputs import table_schema
from pipeline import runs
from pipeline import storage as S
from pipeline.config import load_config
from pipeline.storage import Storage
from tests.servers import check_then_put, seaweedfs, store_proxy

BASE = ["input=x", "catalog=x", "output=x", "models.target=x"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with seaweedfs(tmp_path_factory.mktemp("s3")) as s3, store_proxy(s3) as proxy:
        saved = dict(os.environ)
        os.environ.update(s3.env())
        try:
            yield s3, proxy
        finally:
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture
def proxy(store):
    s3, proxy = store
    proxy.fault, proxy.requests[:] = None, []
    yield proxy
    proxy.fault = None


def storage_of(proxy, retry_s: float = 30.0) -> Storage:
    return Storage(endpoint=proxy.endpoint, retry_s=retry_s)


class First:
    """A fault for the first n requests of `method`, then none; `hit` lists the requests it failed."""

    def __init__(self, n: int, fault: str, method: str):
        self.n, self.fault, self.method, self.hit = n, fault, method, []

    def __call__(self, method: str, target: str) -> str | None:
        if method == self.method and len(self.hit) < self.n:
            self.hit.append(target)
            return self.fault
        return None


def shard_tables(n_users: int):
    recs = pa.table(
        {
            "user_id": list(range(n_users)),
            "rank": pa.array([1] * n_users, pa.int32()),
            "item_id": list(range(n_users)),
            "score": pa.array([0.5] * n_users, pa.float32()),
            "mode": ["beam"] * n_users,
        },
        schema=table_schema("rec", pa.int64()),
    )
    return recs, table_schema("reject", pa.int64()).empty_table()


def test_a_shard_costs_its_four_puts(store, proxy):
    """write_shard on S3 sends the recommendations, the rejects, the users and the metrics row, one PUT each, in that
    order (the metrics file, the commit, last), and no other request: no directory markers, bucket probes or
    multipart uploads."""
    from pipeline.shards import users_of, write_shard

    s3, _ = store
    storage, run = storage_of(proxy), s3.uri("count", "run_date=2026-11-21", "run_id=R")
    recs, rejects = shard_tables(5)
    for i in range(3):
        metric = {"run_id": "R", "shard": f"s{i:012d}", "users_in": 5}
        write_shard(f"s{i:012d}-a", recs, rejects, metric, run, storage, users_of(recs.select(["user_id"]), "decoded"))
    prefix = f"/{s3.bucket}/count/run_date%3D2026-11-21/run_id%3DR"
    assert proxy.requests == [
        ("PUT", f"{prefix}/{table}/s{i:012d}-a.parquet")
        for i in range(3)
        for table in ("recommendations", "rejects", "users", "metrics")
    ]
    stems = [f"s{i:012d}-a" for i in range(3)]
    assert runs.read_table(run, "recommendations", storage, files=stems).num_rows == 15
    assert runs.read_table(run, "metrics", storage, files=stems)["users_in"].to_pylist() == [5, 5, 5]


@pytest.mark.parametrize(
    "fault, method, call",
    [
        ("slowdown", "PUT", "write_parquet"),  # pyarrow (its retry strategy, then ours)
        ("reset", "PUT", "write_bytes"),
        ("reset", "GET", "read_bytes"),  # boto3 (standard retries, then ours)
        ("slowdown", "GET", "read_parquet"),
    ],
)
def test_transient_errors_are_retried_until_they_pass(store, proxy, caplog, fault, method, call):
    """Five failing requests in a row, more than the SDK's own attempts (3): the call still succeeds, whole, once
    they have passed, and our retry loop logged its retries."""
    s3, _ = store
    storage = storage_of(proxy)
    uri = s3.uri("transient", f"{fault}-{call}.parquet")
    table = pa.table({"x": list(range(100))})
    if method == "GET":
        S.write_parquet(table, uri, storage)
    proxy.fault = injected = First(5, fault, method)
    with caplog.at_level(logging.WARNING, logger="genrec.storage"):
        if call == "write_parquet":
            S.write_parquet(table, uri, storage)
        elif call == "write_bytes":
            S.write_bytes(uri, b"whole", storage)
        elif call == "read_bytes":
            assert S.read_bytes(uri, storage)[:4] == b"PAR1"
        else:
            assert S.read_parquet(uri, storage).equals(table)
    assert len(injected.hit) == 5 and all(target.startswith(f"/{s3.bucket}/transient/") for target in injected.hit)
    assert "retry 1 in" in caplog.text and "succeeded after" in caplog.text
    proxy.fault = None
    if call == "write_parquet":
        assert S.read_parquet(uri, storage).equals(table)
    elif call == "write_bytes":
        assert S.read_bytes(uri, storage) == b"whole"


def test_permanent_errors_fail_at_the_first_request(store, proxy, monkeypatch):
    """Access denied (a wrong secret), a missing bucket and a failed conditional put are never retried."""
    import botocore.exceptions

    s3, _ = store
    storage = storage_of(proxy)
    uri = s3.uri("permanent", "object")
    S.write_bytes(uri, b"x", storage)
    etag = S.read_versioned(uri, storage)[1]
    proxy.requests[:] = []
    assert S.put_if(uri, b"y", storage, None) is None  # exists: If-None-Match fails; the read-back finds another's
    assert [m for m, _ in proxy.requests] == ["PUT", "GET"]
    proxy.requests[:] = []
    with pytest.raises(botocore.exceptions.ClientError, match="NoSuchBucket"):
        S.read_versioned(f"s3://no-such-bucket-{os.getpid()}/key", storage)
    assert len(proxy.requests) == 1
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    proxy.requests[:] = []
    with pytest.raises(botocore.exceptions.ClientError, match="SignatureDoesNotMatch|AccessDenied"):
        S.put_if(uri, b"z", storage, etag)
    with pytest.raises(OSError, match="ACCESS_DENIED|SIGNATURE_DOES_NOT_MATCH"):
        S.read_parquet(uri, storage)
    assert len(proxy.requests) == 2  # one each
    monkeypatch.undo()
    assert S.read_bytes(uri, storage) == b"x"


@pytest.mark.parametrize("existing", [False, True])
def test_a_conditional_put_whose_answer_was_lost_is_its_own(store, proxy, existing):
    """The store carries out a conditional put and the answer is lost; the put is tried again, fails its condition
    (the object is already the new version), and put_if recognises the object as its own: the new ETag, not None
    (which would be a LeaseLost, or a publish refused, after a mere dropped connection)."""
    s3, _ = store
    storage = storage_of(proxy)
    uri = s3.uri("lost", f"existing-{existing}")
    etag = S.put_if(uri, b"old", storage, None) if existing else None
    proxy.fault, proxy.requests[:] = First(1, "lose", "PUT"), []
    new = S.put_if(uri, b"new", storage, etag)
    body, now = S.read_versioned(uri, storage)
    assert body == b"new" and new == now
    assert [m for m, _ in proxy.requests][:3] == ["PUT", "PUT", "GET"]  # lost, refused by its condition, read back
    proxy.fault = None
    assert S.put_if(uri, b"newer", storage, etag) is None  # a stale version still fails: the object is not ours


def test_a_store_down_longer_than_the_budget_is_unavailable(store, proxy):
    """Every connection reset for longer than storage.retry_s: StoreUnavailable, one line naming the store, the call
    with its URI and the cause, raised no sooner than the budget; it survives pickling (Ray) whole and is found behind
    Ray's task error."""
    import ray.exceptions

    s3, _ = store
    storage = storage_of(proxy, retry_s=1.5)
    uri = s3.uri("down", "shard.parquet")
    proxy.fault = lambda method, target: "reset"
    start = time.monotonic()
    with pytest.raises(S.StoreUnavailable) as err:
        S.write_parquet(pa.table({"x": [1]}), uri, storage)
    assert time.monotonic() - start >= 1.5
    message = str(err.value)
    assert "\n" not in message and proxy.endpoint in message and f"PUT {uri}" in message
    assert "reset" in message.lower() and "storage.retry_s = 1.5" in message
    assert len(proxy.requests) >= S.SDK_ATTEMPTS  # the SDK tried too, inside each of our attempts
    e = err.value
    e.args = (e.args[0] + "\nFailed to apply UDF transform after 1/1 attempts",)  # what Ray Data appends
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == message
    wrapped = ray.exceptions.RayTaskError("f", "Traceback ...", back).as_instanceof_cause()
    assert S.unavailable(wrapped) is not None and str(S.unavailable(wrapped)) == message
    assert S.unavailable(ValueError("x")) is None


def test_transient_and_permanent_are_told_apart():
    """The classification itself, on the errors each client raises (messages as pyarrow and botocore write them)."""
    import botocore.exceptions as be

    def client_error(code, status):
        return be.ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    transient = [
        be.EndpointConnectionError(endpoint_url="http://s3"),
        be.ReadTimeoutError(endpoint_url="http://s3"),
        be.ConnectionClosedError(endpoint_url="http://s3"),
        client_error("SlowDown", 503),
        client_error("InternalError", 500),
        client_error("Whatever", 502),
        client_error("Throttling", 400),
        OSError("When uploading ...: AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 7"),
        OSError("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate."),
        OSError("AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body."),
        ConnectionResetError(104, "Connection reset by peer"),
    ]
    permanent = [
        client_error("AccessDenied", 403),
        client_error("NoSuchBucket", 404),
        client_error("NoSuchKey", 404),
        client_error("PreconditionFailed", 412),
        be.NoCredentialsError(),
        be.SSLError(endpoint_url="https://s3", error="certificate verify failed"),
        OSError("AWS Error ACCESS_DENIED during HeadObject operation: No response body."),
        OSError("AWS Error NO_SUCH_BUCKET during PutObject operation"),
        FileNotFoundError("x"),
        ValueError("x"),
    ]
    assert [S.transient(e) for e in transient] == [True] * len(transient)
    assert [S.transient(e) for e in permanent] == [False] * len(permanent)


def test_a_lease_release_that_cannot_reach_the_store_is_logged(store, proxy, caplog):
    """release() while the store is unreachable logs and returns (it runs while the job stops with its own error).
    The lease stays held (it expires as if its driver were killed), and a resume of the same run watches it for ttl_s
    before taking it over (what the README tells operators). A release that gets through lets the next run take the
    date at once."""
    from pipeline.lease import Lease

    s3, _ = store
    storage = storage_of(proxy, retry_s=0.5)
    date = s3.uri("release", "run_date=2026-11-21")
    a = Lease(date, "A", storage, ttl_s=2.0).acquire()
    proxy.fault = lambda method, target: "reset"
    with caplog.at_level(logging.ERROR, logger="genrec.lease"):
        a.release()
    assert "could not release it" in caplog.text
    proxy.fault = None
    held = json.loads(S.read_bytes(S.join(date, "_LEASE"), storage))
    assert held["run_id"] == "A" and held["expires"] > 0  # not released (expires 0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="genrec.lease"):
        again = Lease(date, "A", storage, ttl_s=2.0).acquire(resuming=True)  # watches 2 s, then takes it over
    assert "watching it for 2 s" in caplog.text
    again.release()
    assert json.loads(S.read_bytes(S.join(date, "_LEASE"), storage))["expires"] == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="genrec.lease"):
        Lease(date, "B", storage, ttl_s=2.0).acquire().release()  # released: taken at once, nothing watched
    assert "watching" not in caplog.text


def test_the_budget_is_configured_and_a_resume_may_change_it():
    """storage.retry_s is validated; it is not part of what a resume must find unchanged (a run that gave up on
    the store resumes with a larger budget), while the endpoint is."""
    from pipeline.plan import resume_config

    with pytest.raises(ValueError, match=r"storage.retry_s must be >= 0 seconds"):
        load_config(None, BASE + ["storage.retry_s=-1"])
    assert load_config(None, BASE).storage.retry_s == 180.0
    small, large = (load_config(None, BASE + [f"storage.retry_s={s}"]).to_dict() for s in (2, 600))
    assert resume_config(small) == resume_config(large)
    other = load_config(None, BASE + ["storage.endpoint=http://elsewhere:8333"]).to_dict()
    assert resume_config(other) != resume_config(small)


# ------------------------------------------------------------------ the output store check: racing conditional puts


def scratch_keys(s3, prefix: str) -> list[str]:
    got = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix + "/")
    return [o["Key"] for o in got.get("Contents", [])]


def test_an_atomic_store_passes_the_racing_store_check(store, proxy):
    """SeaweedFS (through the counting proxy, which passes every byte as it came) passes the check three times in a
    row: in each of RACE_ROUNDS rounds, on a key of its own, RACERS creates and then RACERS replaces raced, and each
    race had exactly one winner; no scratch object stays."""
    s3, _ = store
    storage = storage_of(proxy)
    for _ in range(3):
        proxy.requests[:] = []
        S.check_conditional_writes(s3.uri("atomic"), storage)
        puts = [target.rsplit("/", 1)[1] for method, target in proxy.requests if method == "PUT"]
        name = puts[0]
        assert [puts.count(f"{name}-{r}") for r in range(S.RACE_ROUNDS)] == [2 * S.RACERS] * S.RACE_ROUNDS
    assert scratch_keys(s3, "atomic") == []


def test_the_plan_checks_an_output_store_once_per_process(store, proxy, monkeypatch):
    """`check_store_once` (what the plan and the Delta sink call): the first call on an output runs the check (its
    scratch puts reach the store), a second on the same output at the same endpoint sends nothing, and another
    output is checked anew. The endpoint is the one the client resolved: a pass at the endpoint the environment
    named (AWS_ENDPOINT_URL_S3, storage.endpoint unset) is not another endpoint's pass."""
    s3, _ = store
    monkeypatch.setattr(S, "_STORES_CHECKED", set())
    storage, check, checked = storage_of(proxy), S.check_conditional_writes, []
    monkeypatch.setattr(S, "check_conditional_writes", lambda out, st: checked.append(out) or check(out, st))
    proxy.requests[:] = []
    S.check_store_once(s3.uri("once"), storage)
    assert any(method == "PUT" and "_STORE_CHECK" in target for method, target in proxy.requests)
    proxy.requests[:] = []
    S.check_store_once(s3.uri("once") + "/", storage)
    assert proxy.requests == [] and checked == [s3.uri("once")]
    S.check_store_once(s3.uri("once-more"), storage)
    assert any(method == "PUT" and "once-more/_STORE_CHECK" in target for method, target in proxy.requests)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    S.check_store_once(s3.uri("env"), Storage())
    S.check_store_once(s3.uri("env"), Storage())
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)  # another endpoint, named the same way
    S.check_store_once(s3.uri("env"), Storage())
    assert checked == [s3.uri("once"), s3.uri("once-more"), s3.uri("env"), s3.uri("env")]
    assert scratch_keys(s3, "once") == scratch_keys(s3, "once-more") == scratch_keys(s3, "env") == []


def test_a_store_that_checks_then_writes_fails_the_races(store, proxy):
    """A gateway that emulates conditional puts with a HEAD, then a PUT (`check_then_put`) answers each put alone as
    S3 would, so the sequential checks pass; of the racing creates, and of the racing replaces, more than one
    succeeds, and the check names both, not atomic; no scratch object stays. It cannot pass by chance: the racers
    are released together by a barrier and send at once (milliseconds apart), and the gateway holds every put that
    passed its HEAD for 0.2 s before it writes, so every racer's HEAD comes before any racer's put lands."""
    s3, _ = store
    proxy.rewrite, proxy.continue_early = check_then_put(s3, delay_s=0.2), True
    try:
        with pytest.raises(ValueError) as err:
            S.check_conditional_writes(s3.uri("checks-then-puts"), storage_of(proxy))
    finally:
        proxy.rewrite, proxy.continue_early = None, False
    message, how = str(err.value), re.escape("succeeded (the store checks, then writes: not atomic)")
    for capability, what in ((S.CREATE, "creates of one key"), (S.REPLACE, "replaces of one version")):
        won = re.search(rf"{re.escape(capability)}: (\d+) of {S.RACERS} concurrent {what} {how}", message)
        assert won and int(won[1]) > 1, message
    assert "a second create" not in message and "already replaced" not in message  # one at a time it behaves
    assert scratch_keys(s3, "checks-then-puts") == []


def test_a_racer_whose_answer_was_lost_is_counted_once(store, proxy):
    """The store carries out every racer's first create and the answers are lost: each racer tries again, fails its
    condition, and reads the object back; the one whose bytes it holds counts itself the winner, the others losers,
    and the check passes. Racers whose puts keep failing for longer than storage.retry_s end the check in
    StoreUnavailable, counted neither a win nor a loss; either way no scratch object stays."""
    s3, _ = store
    lost = []

    def lose_first_creates(method: str, target: str) -> str | None:
        if method == "PUT" and target.endswith("-0") and len(lost) < S.RACERS:
            lost.append(target)
            return "lose"
        return None

    proxy.fault = lose_first_creates
    S.check_conditional_writes(s3.uri("lost-race"), storage_of(proxy))
    raced = [target for method, target in proxy.requests if method == "PUT" and target.endswith("-0")]
    assert len(lost) == S.RACERS and len(raced) >= 3 * S.RACERS  # lost, tried again; then the replaces
    assert scratch_keys(s3, "lost-race") == []
    proxy.fault = lambda method, target: "reset" if method == "PUT" and target.endswith("-0") else None
    with pytest.raises(S.StoreUnavailable, match="conditional PUT"):
        S.check_conditional_writes(s3.uri("down-race"), storage_of(proxy, retry_s=0.5))
    assert scratch_keys(s3, "down-race") == []
