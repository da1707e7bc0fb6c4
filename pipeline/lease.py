"""The lease on a run date: at most one run writes and publishes a date at a time.

S3: the object `<output>/run_date=D/_LEASE` ({run_id, host, pid, expires}) is created with `If-None-Match: *` and
renewed, taken over or released with `If-Match` on its ETag: compare-and-swap, so of two runs racing for a date
exactly one wins. The holder renews it every ttl / 3 from a background thread; a run killed without releasing holds
the date until `expires`, then the next run (or its resume) takes it over. A run whose renewal failed has lost the
date and never publishes.

Local storage: an exclusive `flock` on the same file, held by the driver process for the whole run and released by
the kernel when the process dies (no expiry needed); the file names the holder for the refusal message.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from pipeline import storage as S
from pipeline.config import Storage

log = logging.getLogger("genrec.lease")


class LeaseHeld(RuntimeError):
    """Another live run holds the date."""


class LeaseLost(RuntimeError):
    """This run's lease expired and was taken over: it must not publish."""


class Lease:
    def __init__(self, date_dir: str, run_id: str, storage: Storage, ttl_s: float):
        self.uri, self.run_id, self.storage, self.ttl_s = S.join(date_dir, "_LEASE"), run_id, storage, ttl_s
        self.etag: str | None = None  # S3: the version we wrote last
        self.fd: int | None = None  # local: the locked file
        self.lost: str | None = None
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def body(self, expires: float) -> bytes:
        return json.dumps({"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "expires": expires}).encode()

    # ------------------------------------------------------------------ acquire / renew / release

    def acquire(self, resuming: bool = False) -> "Lease":
        """Takes the date, or raises LeaseHeld naming the run that holds it. resuming: a lease still held by this
        same run id (its killed driver's, on S3) is waited for until it expires, at most ttl_s."""
        if not S.is_s3(self.uri):
            return self._lock_local()
        self.etag = S.put_if(self.uri, self.body(time.time() + self.ttl_s), self.storage, None)
        if self.etag is None:
            got = S.read_versioned(self.uri, self.storage)
            if got is not None:
                holder = json.loads(got[0])
                wait = holder["expires"] - time.time()
                if resuming and holder["run_id"] == self.run_id and 0 < wait <= self.ttl_s:
                    log.warning("lease %s: held by this run's previous driver until %s; waiting %.0f s",
                                self.uri, _utc(holder["expires"]), wait)
                    time.sleep(wait + 1)
                    got = S.read_versioned(self.uri, self.storage)
                    holder = json.loads(got[0]) if got else holder
                if got is not None and holder["expires"] > time.time():
                    raise LeaseHeld(self._held_message(holder, f"until {_utc(holder['expires'])}"))
                log.warning("lease %s: taking over the expired lease of run %s", self.uri, holder["run_id"])
            self.etag = S.put_if(self.uri, self.body(time.time() + self.ttl_s), self.storage,
                                 got[1] if got else None)
            if self.etag is None:
                raise LeaseHeld(f"run_date lease {self.uri}: another run took it at the same moment")
        self._start_renewing()
        return self

    def check(self) -> None:
        """Before publishing: renews once more (S3), raising LeaseLost if the date is no longer ours."""
        if self.lost:
            raise LeaseLost(self.lost)
        if S.is_s3(self.uri):
            self._renew()

    def release(self) -> None:
        self.stop.set()
        if self.fd is not None:
            os.close(self.fd)  # the flock goes with the descriptor
            self.fd = None
        elif self.etag is not None and not self.lost:
            with self.lock:  # expired now: the next run takes it at once
                S.put_if(self.uri, self.body(0.0), self.storage, self.etag)
            self.etag = None

    def _renew(self) -> None:
        with self.lock:
            if self.lost:
                raise LeaseLost(self.lost)
            etag = S.put_if(self.uri, self.body(time.time() + self.ttl_s), self.storage, self.etag)
            if etag is None:
                self.lost = (f"run {self.run_id} lost its run_date lease {self.uri} (it expired and another run took "
                             "it): this run does not publish")
                raise LeaseLost(self.lost)
            self.etag = etag

    def _start_renewing(self) -> None:
        def loop():
            while not self.stop.wait(self.ttl_s / 3):
                try:
                    self._renew()
                except LeaseLost as e:
                    log.error("%s", e)
                    return
                except Exception as e:  # a transient store error: try again at the next tick
                    log.warning("lease %s: renewal failed (%s); retrying", self.uri, e)

        threading.Thread(target=loop, name="lease-renewal", daemon=True).start()

    def _lock_local(self) -> "Lease":
        path = Path(self.uri).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            holder = json.loads(text) if text.strip() else {"run_id": "?", "host": "?", "pid": "?"}
            raise LeaseHeld(self._held_message(holder, "while its driver lives")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, self.body(float("inf")), 0)
        self.fd = fd
        return self

    def _held_message(self, holder: dict, until: str) -> str:
        return (f"run_date {Path(self.uri).parent.name.removeprefix('run_date=')} is being written by run "
                f"{holder['run_id']} (host {holder['host']}, pid {holder['pid']}), which holds {self.uri} {until}; "
                f"this run ({self.run_id}) refuses to start. Wait for it, or resume it with --resume "
                f"{holder['run_id']} once it is gone")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
