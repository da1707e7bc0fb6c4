"""Reading a published run (docs/output.md): `open_run(uri)` -> its manifest and its tables as pyarrow datasets built
from the files its manifest lists, never from a listing of the run's folders (a fenced driver's late shards may lie
there until a later publish or `--gc` deletes them).

    from pipeline.output import open_run
    run = open_run("s3://bucket/genrec/nightly")          # the newest date's published run
    recs = run.dataset("recommendations").to_table()       # user_id, rank, item_id, score, mode

`uri` is what `runs.resolve` takes: an output root (its newest date's published run), `<output>/run_date=D` (that
date's published run) or a run folder (`<output>/run_date=D/run_id=R`, which must be complete and named by its date's
_LATEST unless `allow_unpublished`). s3:// URIs use the
credentials, AWS_ENDPOINT_URL and AWS_REGION of the environment unless a Storage is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as pads

from pipeline import runs
from pipeline import storage as S
from pipeline.config import env_storage
from pipeline.storage import Storage


@dataclass(frozen=True)
class PublishedRun:
    """A complete, published run: its folder, its manifest, and how to reach its store."""

    uri: str  # the run folder: <output>/run_date=D/run_id=R
    manifest: dict
    storage: Storage
    published: bool = True  # False: a run folder opened with allow_unpublished that _LATEST does not name

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def run_date(self) -> str:
        return self.manifest["run_date"]

    def files(self, table: str) -> list[str]:
        """The URIs of a table's files, as the manifest lists them."""
        return [S.join(runs.table_dir(self.uri, table), name) for name in self.manifest["files"].get(table, [])]

    def dataset(self, table: str) -> pads.Dataset:
        """One of the run's tables (recommendations, rejects, metrics) as a pyarrow dataset of the manifest's files:
        lazy, scanned file by file (`.to_table(columns=..., filter=...)`, `.to_batches()`, DuckDB, Polars)."""
        runs.table_dir(self.uri, table)  # refuses an unknown table
        fs, root = S.filesystem(self.uri, self.storage)  # root: the run folder as the filesystem names it
        paths = [f"{root}/{table}/{name}" for name in self.manifest["files"].get(table, [])]
        schema = None
        if not paths:  # a run without a shard lists no metrics file: the table is empty, its schema known
            from pipeline.shards import METRIC_SCHEMA

            schema = METRIC_SCHEMA
        return pads.dataset(paths, schema=schema, format="parquet", filesystem=fs)

    def table(self, table: str, columns=None) -> pa.Table:
        """A whole table in memory (`columns`: only those)."""
        return self.dataset(table).to_table(columns=columns)


def open_run(uri: str, storage: Storage | None = None, allow_unpublished: bool = False) -> PublishedRun:
    """The published run that `uri` resolves to (see the module docstring) -> a PublishedRun; FileNotFoundError when
    there is none, ValueError when the run is incomplete, its manifest lists no files, or a run folder given is not
    its date's published run (`allow_unpublished`: read it anyway, labelled `published=False`)."""
    storage = storage or env_storage()
    run = runs.resolve(uri, storage, allow_unpublished)
    published = not allow_unpublished or runs.unpublished(run, storage) is None
    manifest = json.loads(S.read_bytes(S.join(run, "manifest.json"), storage))
    if not manifest.get("files"):
        raise ValueError(f"run {run}: its manifest lists no files (a run written before manifests listed them)")
    return PublishedRun(run, manifest, storage, published)


def describe(run: PublishedRun) -> str:
    """What `genrec-batch show` prints: the run's summary (date, id, status, mode, models, counts, time) and every
    file of its tables."""
    m, counts = run.manifest, run.manifest.get("counts", {})
    lines = [
        f"run       {run.uri}" + ("" if run.published else "   UNPUBLISHED: _LATEST of its date does not name it"),
        f"date      {m['run_date']}   run_id {m['run_id']}   status {m['status']}",
        f"mode      {m['config']['decoding']['mode']}   k {m['config']['decoding']['k']}   "
        f"engine {m.get('engine', {}).get('name', '?')}",
        *(f"{role:<9} {info['uri']}  sha256 {info['sha256'][:12]}" for role, info in m.get("models", {}).items()),
        *items_lines(m.get("catalog", {})),
        "counts    " + "   ".join(f"{k} {v:,}" for k, v in counts.items() if isinstance(v, int)),
        f"time      {m.get('timings', {}).get('total_s', float('nan')):.1f} s",
    ]
    for table in runs.TABLES:
        files = run.files(table)
        lines += [f"{table} ({len(files)} files)", *(f"  {f}" for f in files)]
    return "\n".join(lines)


def items_lines(info: dict) -> list[str]:
    """`describe`'s lines on the items a run served from (the manifest's `catalog`): the index, the recommendable set
    and the block list, their sizes and content hashes, the index's partition."""
    if "recommendable" not in info:  # a run that recorded only the catalog's size
        return [f"items     {info['items']:,} in the catalog"] if "items" in info else []
    rec, block = info["recommendable_set"], info["block_list"]
    return [
        f"items     {info['items']:,} in the index {info['uri']}  sha256 {info['sha256'][:12]}",
        f"          {info['recommendable']:,} recommendable, {info['blocked']:,} blocked, "
        f"{info['not_recommendable']:,} not recommendable; {info.get('indexed', 0):,} in the constraint index",
        f"          recommendable set {rec['source']}: {rec['items']:,} items  sha256 {rec['sha256'][:12]}"
        + (f"  ({rec['unknown_ids']:,} ids not in the index)" if rec["unknown_ids"] else ""),
        f"          block list {block['source']}: {block['ids']:,} ids  sha256 {block['sha256'][:12]}"
        + (f"  ({block['unknown_ids']:,} ids not in the index)" if block["unknown_ids"] else ""),
    ]
