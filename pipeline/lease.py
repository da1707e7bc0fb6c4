"""The lease on a run date: at most one run writes and publishes a date at a time.

S3: the object `<output>/run_date=D/_LEASE` ({run_id, host, pid, expires}) is created with `If-None-Match: *` and
renewed, taken over or released with `If-Match` on its ETag: compare-and-swap, so of two runs racing for a date
exactly one wins. The holder renews it every ttl / 3 from a background thread. Takeover never trusts another
machine's wall clock: a lease is taken over only when its ETag has not changed for ttl on the taker's own monotonic
clock (or its holder released it); `expires` (the holder's clock) only lets a taker refuse at once a lease that is
live even by its own clock. A run killed without releasing holds the date until then; the next run (or its resume)
takes it over. A holder whose renewal was refused (taken over), or that could not renew for ttl (a pause, a network
partition from the store), has lost the date: it stops and never publishes. Every put and read here is tried again
while the store fails transiently (pipeline/storage.py). Release is best effort: one that cannot reach the store is
logged, not raised over the run's own error, and the lease then stays held until it expires, as a killed run's does.

Local storage: an exclusive `flock` on the same file, held by the driver process for the whole run and released by
the kernel when the process dies (no expiry needed); the file names the holder for the refusal message.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from pipeline import storage as S
from pipeline.storage import Storage

log = logging.getLogger("genrec.lease")


class LeaseHeld(RuntimeError):
    """Another live run holds the date."""


class LeaseLost(RuntimeError):
    """This run's lease expired and was taken over: it must not publish."""


def unguarded(what: str):
    """No signal handling around the lease's release (a lease used outside the nightly's driver)."""
    return contextlib.nullcontext()


NONE, RELEASED, HELD, UNKNOWN = "none", "released", "held", "unknown"  # what became of a run's lease (`state`)
READ_BACK_S = 10.0  # the most a read-back of the lease after an interrupted put may take


class Lease:
    def __init__(self, date_dir: str, run_id: str, storage: Storage, ttl_s: float, guard=unguarded):
        self.uri, self.run_id, self.storage, self.ttl_s = S.join(date_dir, "_LEASE"), run_id, storage, ttl_s
        self.guard = guard  # what -> a context in which signals wait and never raise: the driver's STOP.ending
        self.etag: str | None = None  # S3: the version we wrote last
        self.fd: int | None = None  # local: the locked file
        self.state = NONE  # none: never taken; held; released; unknown: a put's answer lost, the read-back failed
        self.lost: str | None = None
        self.renewed = 0.0  # monotonic time of the last successful put
        self.clock = time.time  # wall clock: only written into the lease for people and refusals, never to take over
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def body(self, expires: float) -> bytes:
        return json.dumps(
            {"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(), "expires": expires}
        ).encode()

    # ------------------------------------------------------------------ acquire / renew / release

    def acquire(self, resuming: bool = False) -> Lease:
        """Takes the date, or raises LeaseHeld naming the run that holds it. A lease that its holder released is
        taken at once; one that looks expired by this machine's clock (or, resuming, is held by this same run id:
        its killed driver's) is watched for ttl_s on the monotonic clock and taken over only if no renewal came."""
        if not S.is_s3(self.uri):
            return self._lock_local()
        if self._put(None) is None:
            got = S.read_versioned(self.uri, self.storage)
            if got is not None:
                holder = json.loads(got[0])
                mine = resuming and holder["run_id"] == self.run_id
                if holder["expires"] > self.clock() and not mine:
                    raise LeaseHeld(self._held_message(holder, f"until {_utc(holder['expires'])}"))
                if holder["expires"] > 0:  # not released: dead only if nobody renews it for ttl_s
                    got = self._watch(got)
                log.warning(
                    "lease %s: taking over the lease of run %s (released, or not renewed for %.0f s)",
                    self.uri,
                    holder["run_id"],
                    self.ttl_s,
                )
            if self._put(got[1] if got else None) is None:
                raise LeaseHeld(f"run_date lease {self.uri}: another run took it at the same moment")
        self.renewed = time.monotonic()
        self._start_renewing()
        return self

    def _put(self, etag: str | None) -> str | None:
        """One put of the lease (a create, or a takeover of version `etag`) -> its new version (kept), None if
        another run holds it. A put cut short by anything (a signal, the store's errors after the store may have taken
        it) reads the lease back before the error goes on: holding this put's own body (its stamp is unique), the
        lease is this run's to release; a read-back that fails leaves the state unknown."""
        body = self.body(self.clock() + self.ttl_s)
        try:
            got = S.put_if(self.uri, body, self.storage, etag)
            if got is not None:
                self.etag, self.state = got, HELD
            return got
        except BaseException:
            self._read_back(body)
            raise

    def _read_back(self, body: bytes) -> None:
        """After an interrupted put of `body`: the lease's version if it holds it (HELD), NONE if it holds another's,
        UNKNOWN if the store could not say (within READ_BACK_S); never raises."""
        try:
            got = S.read_versioned(self.uri, self.storage, budget_s=min(READ_BACK_S, self.storage.retry_s))
        except BaseException:  # the store is down, or a second signal: the put may have landed
            self.state = UNKNOWN
            return
        if got is not None and got[0] == body:
            self.etag, self.state = got[1], HELD

    def _watch(self, got: tuple[bytes, str]) -> tuple[bytes, str] | None:
        """Polls the lease for ttl_s (monotonic): LeaseHeld as soon as its ETag changes (its holder renewed it) ->
        the unchanged version, to take over."""
        log.warning(
            "lease %s: held by run %s, which may be dead; watching it for %.0f s before taking it over",
            self.uri,
            json.loads(got[0])["run_id"],
            self.ttl_s,
        )
        deadline = time.monotonic() + self.ttl_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.ttl_s / 10))
            now = S.read_versioned(self.uri, self.storage)
            if now is None or now[1] != got[1]:
                holder = json.loads(now[0]) if now else json.loads(got[0])
                raise LeaseHeld(self._held_message(holder, "(it renewed the lease while this run watched it)"))
        return got

    def check(self) -> None:
        """Before publishing: renews once more (S3), raising LeaseLost if the date is no longer ours (a renewal that
        succeeds proves nobody took it: the put is conditional on the version this run wrote last)."""
        if self.lost:
            raise LeaseLost(self.lost)
        if S.is_s3(self.uri):
            self._renew()

    def _expire_if_stale(self) -> None:
        """A holder that has not renewed for ttl_s (its own monotonic clock) may have been taken over: lost."""
        if self.etag is not None and not self.lost and time.monotonic() - self.renewed > self.ttl_s:
            self.lost = (
                f"run {self.run_id} could not renew its run_date lease {self.uri} for {self.ttl_s:.0f} s "
                "(another run may have taken it over): this run does not publish"
            )

    def release(self) -> str:
        """Gives the date back (S3: expires 0, so the next run takes it at once) -> what became of this run's lease
        (`state`: none, released, held, unknown). Best effort: it runs while the job stops, perhaps for a store that
        is down (tried for at most ttl_s / 3), so an error is logged and never raised over the job's own; signals wait
        until it is done and never replace the error on its way (`guard`). A lease left held expires: `--resume
        latest` of this run then watches it for ttl_s before taking it over. Called again, it says the same."""
        self.stop.set()
        with self.guard("releasing the run date's lease"):
            if self.fd is not None:
                os.close(self.fd)  # the flock goes with the descriptor
                self.fd, self.state = None, RELEASED
            elif self.etag is not None and self.state == HELD and not self.lost:
                self.state = RELEASED if self._give_back() else HELD
                self.etag = None
            elif self.lost:
                self.state = NONE  # taken over: the date is another run's
        return self.state

    def _give_back(self) -> bool:
        """The release's put -> False when the store could not be reached (a refused condition means another run
        holds the date now: nothing of this run's is left)."""
        try:
            with self.lock:
                S.put_if(self.uri, self.body(0.0), self.storage, self.etag, min(self.storage.retry_s, self.ttl_s / 3))
                return True
        except Exception as e:
            log.error(
                "lease %s: could not release it (%s); it stays held until it expires: a `--resume latest` "
                "of run %s watches it for %.0f s before taking it over",
                self.uri,
                e,
                self.run_id,
                self.ttl_s,
            )
            return False

    def _renew(self, budget_s: float | None = None) -> None:
        """One renewal, its put tried again for budget_s (default storage.retry_s) while the store fails transiently."""
        with self.lock:
            if self.lost:
                raise LeaseLost(self.lost)
            t = time.monotonic()
            etag = S.put_if(self.uri, self.body(self.clock() + self.ttl_s), self.storage, self.etag, budget_s)
            if etag is None:
                self.lost = (
                    f"run {self.run_id} lost its run_date lease {self.uri} (it expired and another run took "
                    "it): this run does not publish"
                )
                raise LeaseLost(self.lost)
            self.etag, self.renewed = etag, t

    def _start_renewing(self) -> None:
        def loop():
            while not self.stop.wait(self.ttl_s / 3):
                try:
                    self._renew(budget_s=self.ttl_s / 3)  # then the next tick tries again, until ttl_s has passed
                except LeaseLost as e:
                    log.error("%s", e)
                    return
                except Exception as e:  # a transient store error: try again at the next tick, until ttl_s
                    log.warning("lease %s: renewal failed (%s); retrying", self.uri, e)
                    self._expire_if_stale()
                    if self.lost:
                        log.error("%s", self.lost)
                        return

        threading.Thread(target=loop, name="lease-renewal", daemon=True).start()

    def _lock_local(self) -> Lease:
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
        self.fd, self.state = fd, HELD
        os.ftruncate(fd, 0)
        os.pwrite(fd, self.body(float("inf")), 0)
        return self

    def _held_message(self, holder: dict, until: str) -> str:
        return (
            f"run_date {Path(self.uri).parent.name.removeprefix('run_date=')} is being written by run "
            f"{holder['run_id']} (host {holder['host']}, pid {holder['pid']}), which holds {self.uri} {until}; "
            f"this run ({self.run_id}) refuses to start. Wait for it, or resume it with --resume "
            f"{holder['run_id']} once it is gone"
        )


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
