"""A real redis-server for tests (Debian's `redis-server`): started on 127.0.0.1 with its own port and folder, its
append-only file fsynced on every write (so a `kill -9` loses nothing it acknowledged), killed and restarted from
outside. Where redis-server is missing a test is skipped with its reason, unless GENREC_REQUIRE_REDIS=1 (CI), where
it fails."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def require_redis() -> str:
    path = shutil.which("redis-server")
    if path is None:
        if os.environ.get("GENREC_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is required (GENREC_REQUIRE_REDIS=1): apt-get install redis-server")
        pytest.skip("redis-server is not installed (apt-get install redis-server; `make redis`)")
    return path


def free_port(bus: bool = False) -> int:
    """A free loopback port; `bus`: one below 55536 whose cluster bus port (+10000) is free too."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0 if not bus else random.randrange(20000, 55535)))
            port = s.getsockname()[1]
        if not bus:
            return port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server process: `url`, `client()`, `kill()` (SIGKILL), `start()` again on the same folder."""

    def __init__(self, folder: Path, *args: str, port: int | None = None, password: str | None = None):
        self.folder, self.args, self.port = folder, list(args), port or free_port()
        self.password = password
        self.args += ["--requirepass", password] if password else []
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [require_redis(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        cmd += ["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=(self.folder / "redis.log").open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=10)

    def kill(self) -> None:
        """SIGKILL, from outside: nothing is flushed but what the append-only file already holds."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_cluster(folder: Path, nodes: int = 3) -> list[RedisServer]:
    """`nodes` cluster-enabled servers on loopback, their slots assigned by `redis-cli --cluster create`."""
    servers = [
        RedisServer(
            folder / f"node{i}", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", port=free_port(True)
        ).start()
        for i in range(nodes)
    ]
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    subprocess.run(
        ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    deadline = time.monotonic() + 30
    while not all(cluster_ok(s.client().execute_command("CLUSTER INFO")) for s in servers):
        if time.monotonic() > deadline:
            raise RuntimeError("the redis cluster did not reach state ok")
        time.sleep(0.1)
    return servers


def cluster_ok(info) -> bool:
    """CLUSTER INFO's reply (parsed into a dict or not) -> whether the node sees the cluster as ok."""
    if isinstance(info, dict):
        return str(info.get("cluster_state")) in ("ok", "b'ok'")
    return b"cluster_state:ok" in (info if isinstance(info, bytes) else str(info).encode())
