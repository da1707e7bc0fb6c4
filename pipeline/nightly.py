"""The nightly dataset graph: read histories, validate, recommend over an actor pool, write the tables, then the
manifest, then _SUCCESS, then publish the run (storage.py has the layout).

read_parquet -> (duplicate user ids: first kept, the rest rejected) -> map_batches(Recommender, actor pool, GPUs per
actor from the config, CPU otherwise) -> materialize -> recommendations / rejects / metrics -> manifest -> _SUCCESS
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import subprocess
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from decoding.models import fingerprint
from operators.recommender import Recommender, output_schema, read_catalog_table
from operators.validate import duplicates
from pipeline import storage as S
from pipeline.config import Config

log = logging.getLogger("genrec.nightly")
REC_COLUMNS = ["user_id", "rank", "item_id", "score", "mode"]
REJECT_COLUMNS = ["user_id", "reason", "detail"]


def open_input(cfg: Config) -> tuple[pads.Dataset, object, str]:
    """The histories as a pyarrow dataset; every file's footer is read here, so a corrupt file fails fast, named."""
    fs, path = S.filesystem(cfg.input, cfg.storage)
    try:
        info = fs.get_file_info(path)
    except OSError as e:
        if "ACCESS_DENIED" in str(e) or "AccessDenied" in str(e):
            raise PermissionError(f"input {cfg.input}: the object store refused access; check the credentials in "
                                  "the environment and storage.endpoint") from None
        raise
    if info.type == pa.fs.FileType.NotFound:
        raise FileNotFoundError(f"input {cfg.input} not found")
    try:
        data = pads.dataset(path, filesystem=fs, format="parquet")
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"input {cfg.input}: not readable as parquet ({e})") from None
    for fragment in data.get_fragments():
        try:
            fragment.ensure_complete_metadata()
        except (OSError, pa.ArrowInvalid) as e:
            raise ValueError(f"input file {fragment.path}: corrupt or not parquet ({e})") from None
    missing = {"user_id", "history"} - set(data.schema.names)
    if missing:
        raise ValueError(f"input {cfg.input}: missing column(s) {sorted(missing)} (has {data.schema.names})")
    return data, fs, path


def split_duplicates(data: pads.Dataset) -> tuple[pa.Array, pa.Table, list[tuple]]:
    """Duplicate user ids: (the ids, their first rows in scan order, rejects for the later rows)."""
    dup = duplicates(data.to_table(columns=["user_id"]).column("user_id").combine_chunks())
    if len(dup) == 0:
        return dup, None, []
    rows = data.to_table(columns=["user_id", "history"], filter=pc.field("user_id").isin(dup))
    ids = rows.column("user_id").to_pylist()
    seen, first, rejects = set(), [], []
    for i, user in enumerate(ids):
        if user in seen:
            rejects.append((user, "duplicate_user", "user_id appears more than once; the first row is kept"))
        else:
            seen.add(user)
            first.append(i)
    return dup, rows.take(pa.array(first, pa.int64())), rejects


def code_version() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        from importlib.metadata import version

        return f"genrec-batch {version('genrec-batch')}"


def check_models(cfg: Config) -> dict:
    """Resolves (and caches) the model directories on the driver: a missing model fails before any work."""
    prints = {}
    for role in ("target", "draft"):
        uri = getattr(cfg.models, role)
        if uri and (role == "target" or cfg.decoding.mode.startswith("atspeed")):
            try:
                prints[role] = {"uri": uri, "sha256": fingerprint(S.local_model_dir(uri, cfg.models.cache_dir,
                                                                                     cfg.storage))}
            except (FileNotFoundError, ValueError) as e:
                raise FileNotFoundError(f"models.{role}: {e}") from None
    return prints


def run_nightly(cfg: Config) -> dict:
    """Runs one nightly job on the current Ray cluster (ray.init() must have been called) -> the manifest."""
    import ray

    t0 = time.perf_counter()
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    run = S.run_dir(cfg.output, cfg.run_date, run_id)
    for uri in (cfg.output, cfg.input, cfg.catalog):
        S.check_access(uri, cfg.storage)
    data, in_fs, in_path = open_input(cfg)
    read_catalog_table(cfg)
    models = check_models(cfg)
    dup, kept, dup_rejects = split_duplicates(data)
    log.info("run %s: input %s (%d files), %d duplicate user ids", run_id, cfg.input, len(data.files), len(dup))
    try:
        ds = ray.data.read_parquet(in_path, filesystem=in_fs).select_columns(["user_id", "history"])
        if len(dup):
            ds = ds.map_batches(lambda t: t.filter(pc.invert(pc.is_in(t["user_id"], dup))), batch_format="pyarrow")
            ds = ds.union(ray.data.from_arrow(kept.cast(ds.schema().base_schema)))
        c = cfg.compute
        # blocks of one batch each (streaming): a single large input file still feeds every actor of the pool
        ds = ds.repartition(target_num_rows_per_block=c.batch_size)
        out = ds.map_batches(Recommender, fn_constructor_kwargs={"config": cfg, "run_id": run_id},
                             batch_size=c.batch_size, batch_format="pyarrow",
                             compute=ray.data.ActorPoolStrategy(size=c.num_actors),
                             num_gpus=c.gpus_per_actor or None, num_cpus=c.cpus_per_actor).materialize()
        t_decode = time.perf_counter() - t0
        log.info("ray data stats:\n%s", out.stats())
        out_fs, out_root = S.filesystem(run, cfg.storage)
        kinds = lambda kind, cols: out.map_batches(  # noqa: E731
            lambda t: t.filter(pc.equal(t["kind"], kind)).select(cols), batch_format="pyarrow")
        kinds("rec", REC_COLUMNS).write_parquet(f"{out_root}/recommendations", filesystem=out_fs)
        user_type = data.schema.field("user_id").type
        rejects = kinds("reject", REJECT_COLUMNS).to_arrow_refs()
        reject_table = pa.concat_tables([ray.get(r) for r in rejects] + [pa.Table.from_pydict(
            {"user_id": [r[0] for r in dup_rejects], "reason": [r[1] for r in dup_rejects],
             "detail": [r[2] for r in dup_rejects]},
            schema=pa.schema([output_schema(user_type).field(n) for n in REJECT_COLUMNS]))])
        out_fs.create_dir(f"{out_root}/rejects")
        pq.write_table(reject_table, f"{out_root}/rejects/rejects.parquet", filesystem=out_fs)
        metric_rows = [json.loads(m) for r in kinds("metric", ["metrics"]).to_arrow_refs()
                       for m in ray.get(r).column("metrics").to_pylist()]
        metrics = pa.Table.from_pylist(metric_rows)
        out_fs.create_dir(f"{out_root}/metrics")
        pq.write_table(metrics, f"{out_root}/metrics/metrics.parquet", filesystem=out_fs)
        counts = {"input_rows": data.count_rows(), "users_ok": int(pc.sum(metrics["users_ok"]).as_py() or 0),
                  "users_rejected": reject_table.num_rows,
                  "recommendations": int(pc.sum(metrics["recommendations"]).as_py() or 0),
                  "batches": metrics.num_rows}
        manifest = {"run_id": run_id, "run_date": cfg.run_date, "status": "succeeded", "config": cfg.to_dict(),
                    "code_version": code_version(), "models": models, "counts": counts,
                    "timings": {"decode_s": t_decode, "total_s": time.perf_counter() - t0},
                    "outputs": {name: S.join(run, name) for name in ("recommendations", "rejects", "metrics")}}
        S.write_bytes(S.join(run, "manifest.json"), json.dumps(manifest, indent=2, default=str).encode(), cfg.storage)
        S.write_bytes(S.join(run, "_SUCCESS"), b"", cfg.storage)  # last: a reader only trusts a run that has it
        S.publish(cfg.output, cfg.run_date, run_id, cfg.storage)
        log.info("run %s published: %s", run_id, json.dumps(counts))
        return manifest
    except BaseException:
        S.delete_tree(run, cfg.storage)  # a failed run leaves nothing a reader could mistake for output
        raise

