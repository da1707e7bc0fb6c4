"""A real PostgreSQL server for tests (Debian's `postgresql`): the database of an Iceberg SQL catalog, started on
127.0.0.1 with its own port, password and data folder (its unix socket there too), stopped on exit. initdb and
postgres refuse to run as root: as root they run as the `postgres` user, in a folder it owns. Where PostgreSQL is
missing a test is skipped with its reason, unless GENREC_REQUIRE_POSTGRES=1 (CI), where it fails."""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_ports, tail


def require_postgres() -> Path:
    """The folder of initdb and postgres (Debian: /usr/lib/postgresql/VERSION/bin, the newest), else skip or fail."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    found = found or [p for p in [shutil.which("initdb")] if p]
    if not found:
        if os.environ.get("GENREC_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL is required (GENREC_REQUIRE_POSTGRES=1): apt-get install postgresql")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql; `make postgres`)")
    return Path(found[-1]).parent


class PostgresServer:
    """One postgres process: `url` (SQLAlchemy's, with the password), `stop()`."""

    def __init__(self, folder: Path, port: int, password: str, proc: subprocess.Popen):
        self.folder, self.port, self.password, self.proc = folder, port, password, proc

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://genrec:{self.password}@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        """SIGINT: a fast shutdown (its clients cut off, its data written); SIGKILL after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def as_owner() -> dict:
    """Popen's arguments that run a command as the `postgres` user where this process is root (else nothing)."""
    return {"user": "postgres", "group": "postgres", "extra_groups": []} if os.geteuid() == 0 else {}


@contextlib.contextmanager
def postgres(timeout: float = 60.0) -> Iterator[PostgresServer]:
    """A PostgreSQL server on 127.0.0.1 (a free port), its cluster made by initdb in a folder of its own under /tmp
    (a unix socket's path is short), user genrec with a random password (scram-sha-256), fsync off (a test's data
    need not outlive the machine); stopped and its folder removed on exit."""
    bin_dir = require_postgres()
    folder = Path(tempfile.mkdtemp(prefix="genrec-pg-", dir="/tmp"))
    password = secrets.token_hex(12)
    (folder / "pw").write_text(password)
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
        shutil.chown(folder / "pw", "postgres", "postgres")
    log = folder / "postgres.log"
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": str(folder)}
    init = [str(bin_dir / "initdb"), "-D", str(folder / "data"), "-U", "genrec", f"--pwfile={folder / 'pw'}"]
    init += ["--auth=scram-sha-256", "-E", "UTF8", "--no-sync", "--locale=C"]
    done = subprocess.run(init, capture_output=True, text=True, env=env, cwd=folder, **as_owner())
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr[-2000:]}")
    port = free_ports(1)[0]
    cmd = [str(bin_dir / "postgres"), "-D", str(folder / "data"), "-p", str(port), "-k", str(folder)]
    cmd += ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder, **as_owner())
    server = PostgresServer(folder, port, password, proc)
    try:
        wait_ready(server, timeout, log)
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def wait_ready(server: PostgresServer, timeout: float, log: Path) -> None:
    import psycopg2

    deadline = time.monotonic() + timeout
    while True:
        try:
            psycopg2.connect(
                host="127.0.0.1", port=server.port, user="genrec", password=server.password, dbname="postgres"
            ).close()
            return
        except psycopg2.OperationalError as e:
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres on port {server.port} did not start ({e}):\n{tail(log)}") from None
            time.sleep(0.1)
