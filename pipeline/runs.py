"""The run layout: the one home of a run's paths, manifest, markers, publication, resolution and reading.

    <output>/run_date=<D>/run_id=<R>/recommendations/*.parquet   user_id, rank, item_id, score, mode
    <output>/run_date=<D>/run_id=<R>/metrics/*.parquet           one row per processed batch
    <output>/run_date=<D>/run_id=<R>/rejects/*.parquet           user_id, reason, detail
    <output>/run_date=<D>/run_id=<R>/users/*.parquet             user_id, input_hash, source (decoded, carried)
    <output>/run_date=<D>/run_id=<R>/manifest.json, then _SUCCESS (written last); the manifest's `files` lists
                                                                 every table's files: readers read those only
    <output>/run_date=<D>/_LATEST                                {"run_id": R}, replaced in one put
    <run>/report/                                                reports and evaluations of the run

    <output>/run_date=<D>/_LEASE                                 the date's writer (pipeline/lease.py)
    <run>/_RUN.json                                              the run's config and the content identity of its
                                                                 input, catalog and models, written when it starts;
                                                                 `interruptions`: each execution a signal stopped
    <run>/_ATTEMPTS/<n>-<attempt>.json                           each driver execution and the shards it trusts
    <run>/_SUPERSEDED                                            {"by", "at"}: another run of the date was published
    <run>/_PINS/<date>_<run_id>.json                             {"by", "until"}: an incremental run reads this
                                                                 run (its base); no deletion before `until`
    <run>/_ENGINE.json                                           compute.engine auto's one decision for the run
                                                                 (`EngineRecord`: created once, first writer wins)

A reader resolves _LATEST, then trusts the run only if it has _SUCCESS. A run publishes (holding the date's lease) by
replacing _LATEST (on S3 compare-and-swap), then marks the date's other runs superseded; they stay readable for a
grace period (a reader that resolved _LATEST just before keeps its run) and are deleted by a later publish or
`--gc`. A run without _SUCCESS and not superseded is unfinished: `--resume` continues it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa

from pipeline import storage as S
from pipeline.config import checked_date
from pipeline.storage import Storage

TABLES = ("recommendations", "rejects", "users", "metrics")
log = logging.getLogger("genrec.runs")


def date_dir(output: str, run_date: str) -> str:
    return S.join(output, f"run_date={run_date}")


def run_dir(output: str, run_date: str, run_id: str) -> str:
    return S.join(date_dir(output, run_date), f"run_id={run_id}")


def table_dir(run: str, name: str) -> str:
    """The folder of one of the run's TABLES."""
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r}; a run has {', '.join(TABLES)}")
    return S.join(run, name)


def report_dir(run: str, compare_id: str | None = None) -> str:
    return S.join(run, "report" if compare_id is None else f"report-vs-{compare_id}")


# ------------------------------------------------------------------ writing


def write_table(run: str, name: str, table: pa.Table, storage: Storage) -> None:
    """One parquet file holding a whole (small) table: rejects, metrics."""
    S.write_parquet(table, S.join(table_dir(run, name), f"{name}.parquet"), storage)


def finish(run: str, manifest: dict, storage: Storage, check=lambda: None) -> None:
    """manifest.json, then _SUCCESS last (a reader only trusts a run that has both), each created only if absent: a
    driver fenced out of the run (it paused past its lease while another took the run over) can never replace the
    manifest readers follow. `check` (the lease's) runs between the two, and _SUCCESS is created only over this
    driver's own manifest, read back. Another manifest there raises LeaseLost."""
    from pipeline.lease import LeaseLost

    body = json.dumps(manifest, indent=2, default=str).encode()
    uri = S.join(run, "manifest.json")
    lost = f"run {run}: {uri} was written by another driver of this run; this one publishes nothing"
    if not S.create(uri, body, storage) and S.read_bytes(uri, storage) != body:
        if S.exists(S.join(run, "_SUCCESS"), storage):  # another driver completed the run: it publishes
            raise LeaseLost(lost)
        check()  # this driver holds the date: the manifest is a fenced driver's, left without _SUCCESS
        S.delete_files(run, ["manifest.json"], storage)
        if not S.create(uri, body, storage):
            raise LeaseLost(lost)
    check()
    if S.read_bytes(uri, storage) != body:  # a driver that took the run over replaced it meanwhile
        raise LeaseLost(lost)
    S.create(S.join(run, "_SUCCESS"), b"", storage)


def complete(run: str, storage: Storage) -> bool:
    """Whether a run is complete: _SUCCESS and the manifest it vouches for."""
    return S.exists(S.join(run, "_SUCCESS"), storage) and S.exists(S.join(run, "manifest.json"), storage)


def clear_unfinished(run: str, storage: Storage) -> None:
    """What an attempt that stopped part-way through `finish` left of a run that is not complete (a manifest.json
    without _SUCCESS, or a _SUCCESS without its manifest) is deleted: the attempt that resumes it, holding the date's
    lease, writes its own."""
    if not complete(run, storage):
        S.delete_files(run, ["manifest.json", "_SUCCESS"], storage)


def start(run: str, state: dict, storage: Storage) -> None:
    S.write_bytes(S.join(run, "_RUN.json"), json.dumps(state, indent=2, default=str).encode(), storage)


def record(run: str, key: str, entry: dict, storage: Storage) -> None:
    """Appends `entry` to the list `key` of the run's state (_RUN.json, rewritten whole: a reader sees the old or the
    new state), e.g. `interruptions`: each driver execution stopped by a signal."""
    state = state_of(run, storage)
    if state is None:
        raise FileNotFoundError(f"run {run}: no _RUN.json to record {key} in")
    state.setdefault(key, []).append(entry)
    start(run, state, storage)


def state_of(run: str, storage: Storage) -> dict | None:
    raw = S.read_bytes(S.join(run, "_RUN.json"), storage)
    return json.loads(raw) if raw is not None else None


@dataclass(frozen=True)
class EngineRecord:
    """compute.engine auto's decision for one run, `<run>/_ENGINE.json`: created once (S3: If-None-Match; locally a
    hard link of a written file, which fails if the name exists), so of actors racing to record one the first writer
    wins and the others read it; every actor, restart and resume of the run then uses that one."""

    run: str  # the run folder
    storage: Storage

    @property
    def uri(self) -> str:
        return S.join(self.run, "_ENGINE.json")

    def read(self) -> dict | None:
        raw = S.read_bytes(self.uri, self.storage)
        return json.loads(raw) if raw is not None else None

    def claim(self, decision: dict) -> dict:
        """Records `decision` unless the run has one -> the run's decision (this one, or the one recorded first)."""
        S.create(self.uri, json.dumps(decision, default=str).encode(), self.storage)
        return self.read()


def unfinished(output: str, run_date: str, storage: Storage) -> list[str]:
    """The date's run ids that started, have no _SUCCESS and were not superseded, newest first."""
    folder = date_dir(output, run_date)
    ids = [c.removeprefix("run_id=") for c in S.list_children(folder, storage) if c.startswith("run_id=")]
    return [
        r
        for r in sorted(ids, reverse=True)
        if state_of(run_dir(output, run_date, r), storage) is not None
        and not complete(run_dir(output, run_date, r), storage)
        and S.read_bytes(S.join(run_dir(output, run_date, r), "_SUPERSEDED"), storage) is None
    ]


def publish(
    output: str, run_date: str, run_id: str, storage: Storage, grace_s: float, latest: str | None = None
) -> list[str]:
    """Points _LATEST of the date at this run, marks the date's other runs superseded now, and deletes those
    superseded more than grace_s ago -> the run ids deleted. The caller holds the date's lease and checked it just
    before. On S3 _LATEST is replaced by compare-and-swap: only if it is still the version `latest` the caller read
    when it took the lease (None: absent), so a driver that paused past its lease while another run published never
    overwrites it (LeaseLost; locally the lease is a lock held while the driver lives). Once _LATEST names the run it
    is published: a failure in the clean-up after is logged and left to `--gc`."""
    from pipeline.lease import LeaseLost

    folder = date_dir(output, run_date)
    body = json.dumps({"run_id": run_id}).encode()
    if S.is_s3(folder):
        if S.put_if(S.join(folder, "_LATEST"), body, storage, latest) is None:
            raise LeaseLost(
                f"run {run_id}: {S.join(folder, '_LATEST')} changed since this run took the date's "
                "lease (another run published the date): this run publishes nothing"
            )
    else:
        S.write_bytes(S.join(folder, "_LATEST"), body, storage)
    try:
        now = time.time()
        for child in S.list_children(folder, storage):
            marker = S.join(folder, child, "_SUPERSEDED")
            if child.startswith("run_id=") and child != f"run_id={run_id}" and S.read_bytes(marker, storage) is None:
                S.write_bytes(marker, json.dumps({"by": run_id, "at": now}).encode(), storage)
        return collect(output, storage, grace_s, run_date)
    except Exception as e:  # published: the clean-up is not the job's success
        log.error(
            "run %s is published; marking or deleting the date's superseded runs failed (%s): `--gc` will finish it",
            run_id,
            e,
        )
        return []


def prune(run: str, files: dict, storage: Storage) -> int:
    """Deletes the files of the run's tables that its manifest does not list (a fenced attempt's late shards) ->
    how many."""
    n = 0
    for name in TABLES:
        keep = set(files.get(name, []))
        stale = [f for f in S.list_files(table_dir(run, name), storage) if f not in keep]
        S.delete_files(table_dir(run, name), stale, storage)
        n += len(stale)
    return n


def latest_version(output: str, run_date: str, storage: Storage) -> str | None:
    """The version (S3 ETag) of the date's _LATEST, None when absent or on local storage: what `publish` swaps."""
    uri = S.join(date_dir(output, run_date), "_LATEST")
    got = S.read_versioned(uri, storage) if S.is_s3(uri) else None
    return got[1] if got else None


def complete_unpublished(output: str, run_date: str, storage: Storage) -> list[str]:
    """The date's run ids that have _SUCCESS but that _LATEST does not name and no publish superseded, newest
    first: complete runs whose driver stopped before publishing them."""
    folder = date_dir(output, run_date)
    latest = S.read_bytes(S.join(folder, "_LATEST"), storage)
    named = json.loads(latest)["run_id"] if latest else None
    ids = [c.removeprefix("run_id=") for c in S.list_children(folder, storage) if c.startswith("run_id=")]
    return [
        r
        for r in sorted(ids, reverse=True)
        if r != named
        and complete(run_dir(output, run_date, r), storage)
        and S.read_bytes(S.join(run_dir(output, run_date, r), "_SUPERSEDED"), storage) is None
    ]


def collect(output: str, storage: Storage, grace_s: float, run_date: str | None = None) -> list[str]:
    """Deletes the runs superseded more than grace_s ago (of one date, or of every date) -> their run ids. The run
    _LATEST points at is never deleted; files in it that its manifest does not list (a fenced driver's late shards)
    are."""
    dates = (
        [run_date]
        if run_date
        else [c.removeprefix("run_date=") for c in S.list_children(output, storage) if c.startswith("run_date=")]
    )
    deleted = []
    for d in dates:
        latest = S.read_bytes(S.join(date_dir(output, d), "_LATEST"), storage)
        keep = json.loads(latest)["run_id"] if latest else None
        manifest = S.read_bytes(S.join(run_dir(output, d, keep), "manifest.json"), storage) if keep else None
        if (
            manifest is not None
            and json.loads(manifest).get("files")
            and prune(run_dir(output, d, keep), json.loads(manifest)["files"], storage)
        ):
            log.warning(
                "run %s of %s: deleted files its manifest does not list (a fenced driver's late shards)", keep, d
            )
        for child in S.list_children(date_dir(output, d), storage):
            run_id = child.removeprefix("run_id=")
            marker = S.read_bytes(S.join(date_dir(output, d), child, "_SUPERSEDED"), storage)
            if (
                child.startswith("run_id=")
                and run_id != keep
                and marker is not None
                and time.time() - json.loads(marker)["at"] >= grace_s
                and not pinned(run_dir(output, d, run_id), storage)
            ):
                S.delete_tree(run_dir(output, d, run_id), storage)
                log.info("deleted run %s of %s (superseded by %s)", run_id, d, json.loads(marker)["by"])
                deleted.append(run_id)
    return deleted


def pin(run: str, by: str, until: float, storage: Storage) -> str:
    """Pins a run (an incremental run's base) against deletion until `until` (epoch seconds) -> the pin's URI."""
    uri = S.join(run, "_PINS", by.replace("/", "_") + ".json")
    S.write_bytes(uri, json.dumps({"by": by, "until": until}).encode(), storage)
    return uri


def pinned(run: str, storage: Storage) -> bool:
    """Whether a run holds a pin that has not expired (`pin`): `collect` leaves it."""
    folder = S.join(run, "_PINS")
    now = time.time()
    for name in S.list_files(folder, storage):
        raw = S.read_bytes(S.join(folder, name), storage)
        try:
            if raw is not None and json.loads(raw)["until"] > now:
                return True
        except (ValueError, KeyError, TypeError):
            return True  # unreadable: kept, as a pin would keep it
    return False


# ------------------------------------------------------------------ reading


def latest_run(output: str, run_date: str, storage: Storage) -> str | None:
    """The published, complete run of a date (its folder URI), or None."""
    latest = S.read_bytes(S.join(date_dir(output, run_date), "_LATEST"), storage)
    if latest is None:
        return None
    run = run_dir(output, run_date, json.loads(latest)["run_id"])
    return run if S.read_bytes(S.join(run, "_SUCCESS"), storage) is not None else None


def unpublished(run: str, storage: Storage) -> str | None:
    """Why a run folder is not its date's published run (None when it is): _LATEST of its date must name it and no
    publish may have marked it superseded."""
    folder, _, name = run.rstrip("/").rpartition("/")
    latest = S.read_bytes(S.join(folder, "_LATEST"), storage)
    named = json.loads(latest)["run_id"] if latest else None
    if named != name.removeprefix("run_id="):
        return f"{S.join(folder, '_LATEST')} names {'no run' if named is None else f'run {named}'}"
    marker = S.read_bytes(S.join(run, "_SUPERSEDED"), storage)
    return f"superseded by run {json.loads(marker)['by']}" if marker is not None else None


def dates(output: str, storage: Storage) -> list[str]:
    """The dates of an output's `run_date=D` folders, in order. A folder whose D is not spelled YYYY-MM-DD
    (`checked_date`: made by hand, or by a version that took other spellings) is no date of the layout: left out,
    and logged."""
    out = []
    for child in S.list_children(output, storage):
        if child.startswith("run_date="):
            try:
                out.append(checked_date(child.removeprefix("run_date="), "run_date"))
            except ValueError as e:
                log.warning("%s is left out: %s", S.join(output, child), e)
    return sorted(out)


def resolve(uri: str, storage: Storage, allow_unpublished: bool = False) -> str:
    """A run folder, `<output>/run_date=D` or `<output>` -> the folder of a complete, published run. A run folder
    must be its date's published run (`unpublished`: else ValueError) unless `allow_unpublished`; complete always.
    A date D given (a `run_date=D` folder, or a run folder's) must be spelled YYYY-MM-DD (`checked_date`)."""
    uri = uri.rstrip("/")
    run = uri
    if S.read_bytes(S.join(uri, "manifest.json"), storage) is None:
        parent, _, name = uri.rpartition("/")
        if name.startswith("run_date="):
            run = latest_run(parent, checked_date(name.removeprefix("run_date="), f"{uri}: run_date"), storage)
        else:
            runs = [latest_run(uri, d, storage) for d in reversed(dates(uri, storage))]
            run = next((r for r in runs if r), None)
        if run is None:
            raise FileNotFoundError(
                f"{uri}: no published run (expected a run folder with manifest.json, a run_date= "
                "folder with _LATEST, or an output root)"
            )
    folder = run.rpartition("/")[0].rpartition("/")[2]
    if folder.startswith("run_date="):
        checked_date(folder.removeprefix("run_date="), f"run {run}: run_date")
    if S.read_bytes(S.join(run, "_SUCCESS"), storage) is None:
        raise ValueError(f"run {run}: no _SUCCESS marker; the run is incomplete or failed and is not read")
    why = None if allow_unpublished else unpublished(run, storage)
    if why:
        raise ValueError(
            f"run {run} is not published ({why}): it is unfinished, failed or superseded; read its date's "
            "published run, or opt in to reading it anyway (allow_unpublished=True, `show --any`)"
        )
    return run


def read_files(
    run: str, name: str, storage: Storage, columns=None, in_flight: int = 16, files: list[str] | None = None
) -> Iterator[pa.Table]:
    """One of the run's tables, file by file in name order (`in_flight` reads at once: object stores are latency
    bound): the files its manifest lists (`files`: these shard stems instead, while the run is being written; a run
    written before manifests listed files: the folder's). Memory stays flat in the number of files, where one
    pyarrow dataset over them keeps every file's footer (a run of 3,910 metric files: 500 MiB)."""
    folder = table_dir(run, name)
    if files is not None:
        names = [f"{stem}.parquet" for stem in files]
    else:
        raw = S.read_bytes(S.join(run, "manifest.json"), storage)
        listed = json.loads(raw).get("files") if raw is not None else None
        names = (
            listed[name]
            if listed
            else [f for f in S.list_files(folder, storage) if f.endswith(".parquet") and not f.startswith(".")]
        )
    read = functools.partial(read_columns, storage=storage, columns=list(columns) if columns else None)
    with ThreadPoolExecutor(in_flight) as pool:
        for i in range(0, len(names), in_flight):
            yield from pool.map(read, [S.join(folder, f) for f in names[i : i + in_flight]])


def read_columns(uri: str, storage: Storage, columns: list[str] | None) -> pa.Table:
    """One file's `columns`; a column a file written by an older version lacks reads as nulls (a resume across an
    upgrade tallies the shards committed before it)."""
    try:
        return S.read_parquet(uri, storage, columns)
    except pa.ArrowInvalid as e:
        if columns is None or "No match for FieldRef" not in str(e):
            raise
    table = S.read_parquet(uri, storage)
    have = [c for c in columns if c in table.column_names]
    out = table.select(have)
    for c in columns:
        if c not in have:
            out = out.append_column(c, pa.nulls(table.num_rows))
    return out.select(columns)


def read_table(run: str, name: str, storage: Storage, columns=None, files: list[str] | None = None) -> pa.Table:
    tables = list(read_files(run, name, storage, columns, files=files))
    if not tables:  # no file: the table's schema is unknown here
        raise FileNotFoundError(f"run {run}: the {name} table has no files")
    return pa.concat_tables(tables, promote_options="permissive")


@dataclass
class Run:
    """A published run as readers see it."""

    uri: str  # the run folder
    manifest: dict
    metrics: pd.DataFrame  # one row per processed batch (operators/recommender.py)

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def mode(self) -> str:
        return self.manifest["config"]["decoding"]["mode"]


def load_run(uri: str, storage: Storage) -> Run:
    """A complete run (see `resolve`; a run folder given may be superseded: a report compares runs of one date) with
    its manifest and metrics."""
    run = resolve(uri, storage, allow_unpublished=True)
    manifest = json.loads(S.read_bytes(S.join(run, "manifest.json"), storage))
    try:
        metrics = read_table(run, "metrics", storage).to_pandas()
    except FileNotFoundError:
        metrics = pd.DataFrame()
    if metrics.empty:
        raise ValueError(f"run {run}: the metrics table is empty")
    return Run(run, manifest, metrics)


def read_recommendations(run: Run, storage: Storage, columns=("user_id", "rank", "item_id", "score")) -> pa.Table:
    return read_table(run.uri, "recommendations", storage, columns)
