"""The run layout: the one home of a run's paths, manifest, markers, publication, resolution and reading.

    <output>/run_date=<D>/run_id=<R>/recommendations/*.parquet   user_id, rank, item_id, score, mode
    <output>/run_date=<D>/run_id=<R>/metrics/*.parquet           one row per processed batch
    <output>/run_date=<D>/run_id=<R>/rejects/*.parquet           user_id, reason, detail
    <output>/run_date=<D>/run_id=<R>/manifest.json, then _SUCCESS (written last)
    <output>/run_date=<D>/_LATEST                                {"run_id": R}, replaced in one put
    <run>/report/                                                reports and evaluations of the run

A reader resolves _LATEST, then trusts the run only if it has _SUCCESS. A rerun writes a new run id, publishes it by
replacing _LATEST, then deletes the older run ids of that date: readers never see a mixture.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage as S
from pipeline.config import Storage

TABLES = ("recommendations", "rejects", "metrics")


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
    fs, path = S.filesystem(table_dir(run, name), storage)
    fs.create_dir(path)
    pq.write_table(table, f"{path}/{name}.parquet", filesystem=fs)


def finish(run: str, manifest: dict, storage: Storage) -> None:
    """manifest.json, then _SUCCESS last: a reader only trusts a run that has it."""
    S.write_bytes(S.join(run, "manifest.json"), json.dumps(manifest, indent=2, default=str).encode(), storage)
    S.write_bytes(S.join(run, "_SUCCESS"), b"", storage)


def publish(output: str, run_date: str, run_id: str, storage: Storage) -> None:
    """Points _LATEST of the date at this run (one atomic put), then deletes the date's other runs."""
    folder = date_dir(output, run_date)
    S.write_bytes(S.join(folder, "_LATEST"), json.dumps({"run_id": run_id}).encode(), storage)
    for child in S.list_children(folder, storage):
        if child.startswith("run_id=") and child != f"run_id={run_id}":
            S.delete_tree(S.join(folder, child), storage)


# ------------------------------------------------------------------ reading


def latest_run(output: str, run_date: str, storage: Storage) -> str | None:
    """The published, complete run of a date (its folder URI), or None."""
    latest = S.read_bytes(S.join(date_dir(output, run_date), "_LATEST"), storage)
    if latest is None:
        return None
    run = run_dir(output, run_date, json.loads(latest)["run_id"])
    return run if S.read_bytes(S.join(run, "_SUCCESS"), storage) is not None else None


def resolve(uri: str, storage: Storage) -> str:
    """A run folder, `<output>/run_date=D` or `<output>` -> the folder of a complete, published run."""
    uri = uri.rstrip("/")
    run = uri
    if S.read_bytes(S.join(uri, "manifest.json"), storage) is None:
        parent, _, name = uri.rpartition("/")
        if name.startswith("run_date="):
            run = latest_run(parent, name.removeprefix("run_date="), storage)
        else:
            dates = sorted(c for c in S.list_children(uri, storage) if c.startswith("run_date="))
            runs = [latest_run(uri, d.removeprefix("run_date="), storage) for d in reversed(dates)]
            run = next((r for r in runs if r), None)
        if run is None:
            raise FileNotFoundError(f"{uri}: no published run (expected a run folder with manifest.json, a run_date= "
                                    "folder with _LATEST, or an output root)")
    if S.read_bytes(S.join(run, "_SUCCESS"), storage) is None:
        raise ValueError(f"run {run}: no _SUCCESS marker; the run is incomplete or failed and is not read")
    return run


def read_table(run: str, name: str, storage: Storage, columns=None) -> pa.Table:
    fs, path = S.filesystem(table_dir(run, name), storage)
    return pq.read_table(path, filesystem=fs, columns=list(columns) if columns else None)


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
    """A complete, published run (see `resolve`) with its manifest and metrics."""
    run = resolve(uri, storage)
    manifest = json.loads(S.read_bytes(S.join(run, "manifest.json"), storage))
    metrics = read_table(run, "metrics", storage).to_pandas()
    if metrics.empty:
        raise ValueError(f"run {run}: the metrics table is empty")
    return Run(run, manifest, metrics)


def read_recommendations(run: Run, storage: Storage, columns=("user_id", "rank", "item_id", "score")) -> pa.Table:
    return read_table(run.uri, "recommendations", storage, columns)
