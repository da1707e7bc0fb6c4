"""The nightly dataset graph: read histories, validate, recommend over an actor pool, write the tables, then the
manifest, then _SUCCESS, then publish the run (runs.py has the layout).

read_parquet -> (duplicate user ids: first kept, the rest rejected) -> map_batches(Recommender, actor pool, GPUs per
actor from the config, CPU otherwise) -> materialize -> recommendations / rejects / metrics -> manifest -> _SUCCESS
"""
from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import subprocess
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from decoding.templates import TEMPLATE_FILE, PromptTemplate, get_template, read_template
from operators.recommender import TABLES, Recommender, output_schema, prepare
from operators.spec import ActorSpec
from operators.validate import duplicates, reject_schema
from pipeline import runs
from pipeline import storage as S
from pipeline.config import Config

log = logging.getLogger("genrec.nightly")


def read_catalog(cfg: Config) -> pa.Table:
    """The catalog table, read once per run by the driver (the actors get it in their ActorSpec)."""
    fs, path = S.filesystem(cfg.catalog, cfg.storage)
    try:
        return pq.read_table(path, filesystem=fs)
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"catalog {cfg.catalog}: cannot be read as parquet ({e})") from None


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


def resolve_models(cfg: Config) -> dict:
    """Resolves (and caches) the model directories on the driver: a missing model fails before any work.
    -> {role: {"uri", "sha256", "dir" (local)}} for the target, and the draft in the atspeed modes."""
    models = {}
    for role in ("target", "draft"):
        uri = getattr(cfg.models, role)
        if uri and (role == "target" or cfg.decoding.uses_draft):
            try:
                local = fetch_model(uri, cfg.models.cache_dir, cfg.storage)
                models[role] = {"uri": uri, "sha256": S.fingerprint(local), "dir": local}
            except (FileNotFoundError, ValueError) as e:
                raise FileNotFoundError(f"models.{role}: {e}") from None
    return models


def resolve_template(cfg: Config, models: dict) -> PromptTemplate:
    """The prompt template: models.template (a preset or a JSON file) or the target directory's; a draft that carries
    a template must carry the same one (it reads the target's prompts)."""
    try:
        template = get_template(cfg.models.template) if cfg.models.template else read_template(models["target"]["dir"])
    except ValueError as e:
        raise ValueError(f"models.template: {e}" if cfg.models.template else f"models.target: {e}") from None
    draft = models.get("draft", {}).get("dir")
    if draft and (Path(draft) / TEMPLATE_FILE).is_file() and read_template(draft) != template:
        raise ValueError(f"models.draft {cfg.models.draft}: its {TEMPLATE_FILE} differs from the target's prompt "
                         "template; a draft must read the prompts its target reads")
    return template


def fetch_model(uri: str, cache_dir: str, storage) -> str:
    """A model URI -> a local directory on this node (s3:// copied once per node, verified)."""
    return str(S.local_model_dir(uri, cache_dir, storage))


def actor_spec(cfg: Config, run_id: str, catalog: pa.Table, template: PromptTemplate) -> ActorSpec:
    """What every actor gets: the model URIs and how to fetch them on its node, the catalog read once, the prompt
    template, the decoding settings."""
    m = cfg.models
    return ActorSpec(run_id=run_id, target=m.target, catalog=catalog, catalog_name=cfg.catalog,
                     decoding=cfg.decoding, template=template, on_duplicate=cfg.duplicate_items,
                     draft=m.draft if cfg.decoding.uses_draft else None,
                     fetch=functools.partial(fetch_model, cache_dir=m.cache_dir, storage=cfg.storage),
                     gpu=cfg.compute.gpus_per_actor > 0, dtype=cfg.compute.dtype,
                     threads=cfg.compute.threads_per_actor)


def auto_decisions(metric_rows: list[dict]) -> dict | None:
    """decoding.mode = auto: each actor's choice and the trial timings behind it (its last metric row's state)."""
    states = {r["actor"]: r["auto"] for r in sorted(metric_rows, key=lambda r: (r["actor"], r["batch"]))
              if r.get("auto")}
    return states or None


def run_nightly(cfg: Config) -> dict:
    """Runs one nightly job on the current Ray cluster (ray.init() must have been called) -> the manifest."""
    import ray

    t0 = time.perf_counter()
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    run = runs.run_dir(cfg.output, cfg.run_date, run_id)
    for uri in (cfg.output, cfg.input, cfg.catalog):
        S.check_access(uri, cfg.storage)
    data, in_fs, in_path = open_input(cfg)
    catalog = read_catalog(cfg)
    models = resolve_models(cfg)
    spec = actor_spec(cfg, run_id, catalog, resolve_template(cfg, models))
    inputs = prepare(spec)  # on the driver: every check an actor would make fails here, before any work
    catalog_info = {"items": catalog.num_rows, "indexed": len(inputs.catalog),
                    "duplicates": {"policy": cfg.duplicate_items, "dropped": len(inputs.catalog.duplicates),
                                   "items": [{"item_id": d, "kept": k} for d, k in inputs.catalog.duplicates]}}
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
        out = ds.map_batches(Recommender, fn_constructor_kwargs={"spec": spec},
                             batch_size=c.batch_size, batch_format="pyarrow",
                             compute=ray.data.ActorPoolStrategy(size=c.num_actors),
                             num_gpus=c.gpus_per_actor or None, num_cpus=c.cpus_per_actor).materialize()
        t_decode = time.perf_counter() - t0
        log.info("ray data stats:\n%s", out.stats())
        kinds = lambda kind: out.map_batches(  # noqa: E731
            lambda t: t.filter(pc.equal(t["kind"], kind)).select(TABLES[kind]), batch_format="pyarrow")
        rec_fs, rec_path = S.filesystem(runs.table_dir(run, "recommendations"), cfg.storage)
        kinds("rec").write_parquet(rec_path, filesystem=rec_fs)
        user_type = data.schema.field("user_id").type
        if not rec_fs.get_file_info(pafs.FileSelector(rec_path, allow_not_found=True)):  # every user rejected
            rec_schema = pa.schema([output_schema(user_type).field(n) for n in TABLES["rec"]])
            runs.write_table(run, "recommendations", rec_schema.empty_table(), cfg.storage)
        reject_table = pa.concat_tables([ray.get(r) for r in kinds("reject").to_arrow_refs()] + [pa.Table.from_pydict(
            {"user_id": [r[0] for r in dup_rejects], "reason": [r[1] for r in dup_rejects],
             "detail": [r[2] for r in dup_rejects]}, schema=reject_schema(user_type))])
        runs.write_table(run, "rejects", reject_table, cfg.storage)
        metric_rows = [json.loads(m) for r in kinds("metric").to_arrow_refs()
                       for m in ray.get(r).column("metrics").to_pylist()]
        metrics = pa.Table.from_pylist(metric_rows)
        runs.write_table(run, "metrics", metrics, cfg.storage)
        counts = {"input_rows": data.count_rows(), "users_ok": int(pc.sum(metrics["users_ok"]).as_py() or 0),
                  "users_rejected": reject_table.num_rows,
                  "users_non_finite": int(pc.sum(metrics["users_non_finite"]).as_py() or 0),
                  "recommendations": int(pc.sum(metrics["recommendations"]).as_py() or 0),
                  "batches": metrics.num_rows}
        manifest = {"run_id": run_id, "run_date": cfg.run_date, "status": "succeeded", "config": cfg.to_dict(),
                    "code_version": code_version(),
                    "models": {role: {"uri": m["uri"], "sha256": m["sha256"]} for role, m in models.items()},
                    "template": inputs.renderer.template.to_dict(), "max_prompt_tokens": inputs.renderer.max_len,
                    "prefix_tokens": len(inputs.renderer.prefix_ids), "auto": auto_decisions(metric_rows),
                    "catalog": catalog_info,
                    "counts": counts, "timings": {"decode_s": t_decode, "total_s": time.perf_counter() - t0},
                    "outputs": {name: runs.table_dir(run, name) for name in runs.TABLES}}
        runs.finish(run, manifest, cfg.storage)
        runs.publish(cfg.output, cfg.run_date, run_id, cfg.storage)
        log.info("run %s published: %s", run_id, json.dumps(counts))
        return manifest
    except BaseException:
        S.delete_tree(run, cfg.storage)  # a failed run leaves nothing a reader could mistake for output
        raise

