"""The integration-test servers themselves: S3 round trips on SeaweedFS, and a token-authenticated Ray head
that accepts `ray job submit` with the token and refuses it without."""

from __future__ import annotations

import json
import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.servers import find_executable, ray_head, seaweedfs


def test_seaweedfs_s3_round_trip(tmp_path):
    with seaweedfs(tmp_path / "s3") as s3:
        assert s3.endpoint.startswith("http://127.0.0.1:")
        # pyarrow: parquet write and read back
        fs = s3.filesystem()
        table = pa.table(
            {
                "user_id": pa.array([1, 2, 3], pa.int64()),
                "history": pa.array([[10, 11], [12], []], pa.list_(pa.int64())),
            }
        )
        pq.write_table(table, f"{s3.bucket}/runs/2026-01-01/part-0.parquet", filesystem=fs)
        assert pq.read_table(f"{s3.bucket}/runs/2026-01-01/part-0.parquet", filesystem=fs).equals(table)
        infos = fs.get_file_info(pa.fs.FileSelector(f"{s3.bucket}/runs", recursive=True))
        assert [i.path for i in infos if i.is_file] == [f"{s3.bucket}/runs/2026-01-01/part-0.parquet"]

        # boto3: a small JSON object
        client = s3.client()
        client.put_object(Bucket=s3.bucket, Key="manifests/run.json", Body=json.dumps({"rows": 3}).encode())
        body = client.get_object(Bucket=s3.bucket, Key="manifests/run.json")["Body"].read()
        assert json.loads(body) == {"rows": 3}

        # a wrong secret key is refused, by both clients
        import botocore.exceptions

        with pytest.raises(botocore.exceptions.ClientError) as err:
            s3.client(secret_key="wrong").get_object(Bucket=s3.bucket, Key="manifests/run.json")
        assert err.value.response["Error"]["Code"] in ("SignatureDoesNotMatch", "AccessDenied")
        with pytest.raises(OSError, match="(?i)access.denied|signature|forbidden"):
            pq.read_table(f"{s3.bucket}/runs/2026-01-01/part-0.parquet", filesystem=s3.filesystem("wrong"))


def _submit(head, env, working_dir):
    cmd = [
        find_executable("ray"),
        "job",
        "submit",
        "--address",
        head.dashboard_url,
        "--working-dir",
        str(working_dir),
        "--",
        "python",
        "-c",
        "import ray; ray.init(); print(ray.cluster_resources())",
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_ray_head_token_auth(tmp_path):
    working_dir = tmp_path / "job"
    working_dir.mkdir()
    (working_dir / "hello.txt").write_text("a tiny working dir\n")
    # A client environment without any token: no RAY_AUTH_* variables, and a HOME without ~/.ray/auth_token.
    home = tmp_path / "home"
    home.mkdir()
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    bare |= {"HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"}

    with ray_head(tmp_path / "ray", num_cpus=2) as head:
        assert head.address.startswith("127.0.0.1:") and head.dashboard_url.startswith("http://127.0.0.1:")

        ok = _submit(head, bare | head.env(), working_dir)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "'CPU': 2.0" in ok.stdout and "succeeded" in ok.stdout + ok.stderr

        refused = _submit(head, bare, working_dir)
        assert refused.returncode != 0
        assert "AuthenticationError" in refused.stderr and "Unauthorized" in refused.stderr, refused.stderr

        wrong = _submit(head, bare | head.env() | {"RAY_AUTH_TOKEN": "0" * 64}, working_dir)
        assert wrong.returncode != 0
        assert "Invalid authentication token" in wrong.stderr, wrong.stderr

    from tests.servers import _session_pids

    assert _session_pids(head.session_id) == []
    assert not head.temp_dir.exists()
