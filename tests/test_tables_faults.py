"""Delta tables and faults from outside, on a real Ray head with real driver processes against SeaweedFS: a night
killed mid-run commits nothing to its table; the history table gets a new version meanwhile, and the resume reads the
version the run started on, then commits; a resume whose version was vacuumed is refused, exit 2."""

import json
import os
import signal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline import runs
from pipeline.output import open_run
from pipeline.storage import Storage
from pipeline.stores import delta
from tests.servers import ray_head, seaweedfs
from tests.test_nightly import direct_beam_search, make_world
from tests.test_store_faults import DATE, Driver, K, items, wait_committed
from tests.test_tables import rows, write

EARLIER = "2026-11-20"
OUT = "tables-out"
USERS = 120  # 15 shards of 8


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """SeaweedFS holding the world's catalog, and a Ray head whose drivers and workers get its credentials."""
    root = tmp_path_factory.mktemp("lakefaults")
    world = make_world(root / "world", n_users=USERS)
    with seaweedfs(root / "s3") as s3, ray_head(root / "ray", env=s3.env()) as head:
        s3.client().upload_file(str(world / "data" / "items.parquet"), s3.bucket, "data/items.parquet")
        saved = dict(os.environ)
        os.environ.update(s3.env())  # this process reads the outputs too
        try:
            yield world, s3, head
        finally:
            os.environ.clear()
            os.environ.update(saved)


def table_state(uri: str, storage: Storage) -> tuple[int, list]:
    from deltalake import DeltaTable

    dt = DeltaTable(delta.location(uri), storage_options=delta.storage_options(storage))
    return dt.version(), rows(dt.to_pyarrow_table())


def killed(driver: Driver, s3, shards: int) -> None:
    """The driver SIGKILLed, with everything it started in its session, once `shards` shards are committed."""
    wait_committed(s3, OUT, shards, driver)
    os.killpg(driver.proc.pid, signal.SIGKILL)
    driver.proc.wait()


def test_a_killed_night_commits_nothing_and_its_resume_reads_its_version(lake):
    world, s3, head = lake
    storage = Storage(s3.endpoint)
    users = pq.read_table(world / "data" / "test.parquet")
    history, table = s3.uri("lake", "histories"), f"delta+{s3.uri('lake', 'recommendations')}"
    write(history, users, storage, "overwrite")  # version 0
    base = items(world, s3, s3.endpoint, OUT, f"input=delta+{history}", f"table.uri={table}", "runs.lease_s=10")
    # ^ a killed driver's lease expires after 10 s: its resume takes it over then

    rc, out, err = Driver(head, s3, [*base, f"run_date={EARLIER}"]).finish()  # an earlier date, committed
    assert rc == 0, err[-3000:]
    assert json.loads(out[out.index("{") :])["table"]["version"] == 1  # 0: the table's creation
    before = table_state(table, storage)

    killed(Driver(head, s3, base), s3, 3)
    assert runs.latest_run(s3.uri(OUT), DATE, storage) is None and table_state(table, storage) == before

    new = users.set_column(1, "history", pc.list_slice(users["history"], 0, 1))  # every history changed
    extra = users.slice(0, 10).set_column(0, "user_id", pc.add(users["user_id"].slice(0, 10), 10**6))
    write(history, pa.concat_tables([new, extra]), storage, "overwrite")  # version 1
    rc, out, err = Driver(head, s3, base, "--resume", "latest").finish()
    assert rc == 0, err[-3000:]
    done = json.loads(out[out.index("{") :])
    assert done["resume"]["resumed"] and done["resume"]["shards_committed_before"] >= 3
    run = open_run(f"{s3.uri(OUT)}/run_date={DATE}", storage)
    assert run.manifest["input"]["version"] == 0 and run.run_id == done["run_id"]
    published = run.table("recommendations")
    ref, _ = direct_beam_search(world, users["history"].to_pylist(), k=K)  # version 0's histories
    want = dict(zip(users["user_id"].to_pylist(), ref.item_ids.tolist(), strict=True))
    got = published.to_pandas().sort_values(["user_id", "rank"]).groupby("user_id").item_id.apply(list).to_dict()
    assert got == want and len(got) == USERS
    version, now = table_state(table, storage)
    assert version == before[0] + 1 == done["table"]["version"] and sorted(before[1] + rows(published)) == now

    killed(Driver(head, s3, base), s3, run.manifest["counts"]["batches"] + 2)  # a rerun of the date, on version 1
    write(history, new, storage, "overwrite")  # version 2; then version 1's files are vacuumed
    from deltalake import DeltaTable

    DeltaTable(history, storage_options=delta.storage_options(storage)).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False
    )
    rc, _, err = Driver(head, s3, base, "--resume", "latest").finish()
    assert rc == 2 and "version 1" in err and "vacuumed" in err and "Start a new run" in err, err[-3000:]
    assert table_state(table, storage) == (version, now)
