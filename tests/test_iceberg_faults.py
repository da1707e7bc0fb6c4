"""Iceberg commits killed from outside: `genrec-batch export RUN --to iceberg+...` in its own process (a driver of a
real Ray head), its table in a SQL catalog on a real PostgreSQL, its data files on SeaweedFS, SIGKILLed once its data
files are written and before its snapshot is committed, or once the snapshot is committed and before the call reports
it. Run again, the commit makes the run's snapshot exactly once: the date's rows are the run's, and the killed call's
files are in no snapshot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.output import open_run
from pipeline.storage import Storage
from pipeline.stores import iceberg
from pipeline.stores.lake import RUN_ID
from tests.postgres_server import postgres
from tests.servers import ray_head, seaweedfs
from tests.test_iceberg import DATE, KEY, catalog_env, date_rows, rows
from tests.test_nightly import make_world
from tests.test_store_faults import Driver

ROOT = Path(__file__).resolve().parents[1]
NAME = "lake"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """SeaweedFS, PostgreSQL, a Ray head, the catalog configured in the environment, and one published run (a
    `genrec-batch nightly` of 30 users, a driver of the head) -> (its folder, the environment of an export's
    process, the storage)."""
    root = tmp_path_factory.mktemp("icebergfaults")
    world = make_world(root / "world", n_users=30)
    with seaweedfs(root / "s3") as s3, postgres() as pg, ray_head(root / "ray", env=s3.env()) as head:
        props = {"uri": pg.url, "warehouse": s3.uri("warehouse"), "s3.endpoint": s3.endpoint}
        props |= {"s3.access-key-id": s3.access_key, "s3.secret-access-key": s3.secret_key, "s3.region": s3.region}
        env = {**os.environ, **s3.env(), **head.env(), **catalog_env(NAME, props), "RAY_ADDRESS": head.address}
        env["PYICEBERG_HOME"] = str(root)
        saved = dict(os.environ)
        os.environ.update(env)  # this process reads the table too
        try:
            rc, out, err = Driver(head, s3, [
                f"input={world / 'data' / 'test.parquet'}", f"catalog={world / 'data' / 'items.parquet'}",
                f"output={root / 'out'}", f"models.target={world / 'target'}", "decoding.k=5",
                "compute.batch_size=16", f"run_date={DATE}", f"models.cache_dir={world / 'cache'}",
            ]).finish()  # fmt: skip
            assert rc == 0, err[-3000:]
            run_id = json.loads(out[out.index("{") :])["run_id"]
            yield f"{root / 'out'}/run_date={DATE}/run_id={run_id}", env, Storage(s3.endpoint)
        finally:
            os.environ.clear()
            os.environ.update(saved)


def exported(run: str, uri: str, env: dict, logs: Path, point: str | None = None):
    """`genrec-batch export RUN --to URI` started in its own process and session, its stdout and stderr in `logs`
    (with `point`: held there, `logs` its folder: pipeline.signals.hold_for_test)."""
    logs.mkdir()
    extra = {f"GENREC_TEST_HOLD_{point}": str(logs)} if point else {}
    with open(logs / "out", "w") as out, open(logs / "err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "jobs.export", run, "--to", uri, "--endpoint", env["AWS_ENDPOINT_URL_S3"]],
            cwd=ROOT, env={**env, **extra}, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip


def killed_export(run: str, uri: str, env: dict, point: str, hold: Path) -> None:
    """`genrec-batch export RUN --to URI` in its own process and session, SIGKILLed (with all it started) once it
    reaches `point` (pipeline.signals.hold_for_test)."""
    proc = exported(run, uri, env, hold, point)
    deadline = time.monotonic() + 300
    while not (hold / "held").exists():
        assert proc.poll() is None, f"the export ended before {point}:\n{(hold / 'err').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {point} after 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_commit_killed_before_or_after_its_snapshot_is_made_once_by_its_retry(published, tmp_path):
    """Killed with its files written but no snapshot: the table holds nothing of the run; the retry commits it in
    one snapshot, the killed call's files in none. Killed with its snapshot committed: the retry finds it and makes
    no second one (`already committed`). Either way the date's rows are the run's, once."""
    run_dir, env, storage = published
    run = open_run(run_dir, storage)
    want = rows(run.table("recommendations"))
    for point, name in (("BEFORE_COMMIT", "killed_before"), ("AFTER_COMMIT", "killed_after")):
        uri = f"iceberg+{NAME}/recs.{name}"
        killed_export(run_dir, uri, env, point, tmp_path / point)
        table = iceberg.load(uri, storage)
        ours = [s for s in table.snapshots() if s.summary[RUN_ID] == run.run_id]
        assert len(ours) == (point == "AFTER_COMMIT"), (point, table.snapshots())
        data = iceberg.local(table.location()).split("/", 3)[3] + "/data/"
        before = {o["Key"] for o in s3_objects(env, data)}
        assert before, "the killed call wrote its data files"

        logs = tmp_path / f"retry-{point}"
        assert exported(run_dir, uri, env, logs).wait(300) == 0, (logs / "err").read_text()[-3000:]
        done = json.loads((logs / "out").read_text())
        assert done["skipped"] == (None if point == "BEFORE_COMMIT" else "already committed"), done
        table = iceberg.load(uri, storage)
        ours = [s for s in table.snapshots() if s.summary[RUN_ID] == run.run_id]
        assert len(ours) == 1 and len(table.snapshots()) == 1 and done["version"] == ours[0].snapshot_id
        assert rows(date_rows(table, DATE).select(KEY)) == want
        named = {iceberg.local(t.file.file_path).split("/", 3)[3] for t in table.scan().plan_files()}
        if point == "BEFORE_COMMIT":  # the killed call's files: in no snapshot (orphans for remove_orphan_files)
            assert before.isdisjoint(named) and named <= {o["Key"] for o in s3_objects(env, data)}
        else:
            assert named == before


def s3_objects(env: dict, prefix: str) -> list[dict]:
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="genrec", Prefix=prefix)
    return [o for page in pages for o in page.get("Contents", [])]
