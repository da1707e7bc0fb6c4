"""The processor: genrec-batch's decode as one step of a user's own Ray Data pipeline, in Ray Data LLM's shape
(`build_processor(config, preprocess, postprocess)`; `processor(ds)` -> a dataset):

    ds -> preprocess (a row -> columns merged into it) -> RowRecommender actor pool (each row with item_ids, scores and
    reject_reason beside it: one row out per row in) -> postprocess (a row -> the row kept)

Built on the driver, it makes the nightly's checks (`plan.resolve_decoder`: the items, the models and their sha256,
the template, an actor's own checks); applied to a dataset, it only adds operators to it: nothing runs until the user's
pipeline does, and nothing per user reaches the driver. Its actors are the nightly's: the same Recommender
(operators/recommender.py `recommend`: validation, exclusions, engines, decoders), over the items each reads itself
(`ItemsRef`, refused if they changed since the driver read them). What the nightly adds around them (the date's lease,
shards committed exactly once, resume, incremental carry, lineage, publication) the processor does not give: its rows
are the user's to write.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from operators.prompts import is_text
from operators.recommender import Recommended
from pipeline import cluster, units
from pipeline import storage as S
from pipeline.attempt import actor_resources
from pipeline.config import Compute, Config, ProcessorConfig, processor_config
from pipeline.items import ItemsRef, Sources
from pipeline.plan import Decoder, id_kind, input_columns, resolve_decoder
from pipeline.shards import recommender_of

log = logging.getLogger("genrec.processor")

OUTPUT_COLUMNS = ("item_ids", "scores", "reject_reason")  # what the processor adds to every row


class Processor:
    """`processor(ds)`: the dataset with every row's list (Ray Data LLM's Processor). `preprocess(row)` returns
    columns merged into the row (added, or replacing those of the same name); `postprocess(row)` returns the row kept
    (every column, item_ids, scores and reject_reason included: the user chooses). `*_map_kwargs`: Dataset.map's
    arguments for them (num_cpus, concurrency, ...)."""

    def __init__(
        self,
        config: ProcessorConfig | Config,
        preprocess=None,
        postprocess=None,
        preprocess_map_kwargs: dict | None = None,
        postprocess_map_kwargs: dict | None = None,
    ):
        self.config = processor_config(config)
        self.preprocess, self.postprocess = preprocess, postprocess
        self.preprocess_map_kwargs = preprocess_map_kwargs or {}
        self.postprocess_map_kwargs = postprocess_map_kwargs or {}
        self.decoder = check(self.config)

    def __call__(self, ds):
        """A Ray Data dataset holding a user id and a history column (`columns`) -> the dataset of its rows, each
        with item_ids list<int64> (the top-k, best first; null for a rejected row), scores list<float32> (the target's
        log-probabilities) and reject_reason (null, or the nightly's reject reason: docs/output.md); lazy."""
        if self.preprocess is not None:
            ds = ds.map(merged, fn_kwargs={"fn": self.preprocess}, **self.preprocess_map_kwargs)
        ds = self.recommend(ds)
        if self.postprocess is not None:
            ds = ds.map(self.postprocess, **self.postprocess_map_kwargs)
        return ds

    def recommend(self, ds):
        """The recommender actor pool over the dataset: compute.num_actors as the nightly reads it
        (cluster.actor_pool), each actor's CPUs and GPUs as the nightly's. Each call takes compute.batches_per_task
        batches of compute.batch_size rows, as a nightly task does, and orders their users by history length before
        it cuts them into decodes (compute.order_by_length; `actor_args`), as a nightly read task orders its row
        group's: users of like lengths share a decode and its padding."""
        import ray

        if not ray.is_initialized():
            ray.init()  # what the dataset's execution would do: the pool's size needs the cluster's resources
        c, resources = self.config.compute, ray.cluster_resources()
        warn_unplaceable(c, resources)
        return ds.map_batches(
            RowRecommender,
            batch_size=c.batch_size * c.batches_per_task,
            batch_format="pyarrow",
            fn_constructor_kwargs=actor_args(self.config, self.decoder),
            compute=cluster.actor_pool(c, resources).strategy(),
            **actor_resources(c),
        )


def warn_unplaceable(c: Compute, resources: dict) -> None:
    """A pool whose actor the cluster (`resources`: ray.cluster_resources()) cannot hold now, GPUs or CPUs (GPU
    actors on a CPU-only cluster, say), waits for a node that can, as long as the pipeline runs: said once, on the
    driver, with the setting, the cluster and how to bound the wait, before it starts waiting."""
    gpus, cpus = resources.get("GPU", 0.0), resources.get("CPU", 0.0)
    if gpus >= c.gpus_per_actor and cpus >= c.cpus_per_actor:
        return
    log.warning(
        "processor: an actor needs compute.gpus_per_actor %g GPU and compute.cpus_per_actor %g CPU, and this Ray "
        "cluster has %s now: its actors wait until a node that holds one joins (an autoscaling cluster's), which a "
        "fixed cluster never gives. Set compute.gpus_per_actor: 0 for CPU actors, or bound the wait with Ray Data's "
        "DataContext.get_current().wait_for_min_actors_s",
        c.gpus_per_actor,
        c.cpus_per_actor,
        cluster.short(resources),
    )


def build_processor(
    config: ProcessorConfig | Config,
    preprocess=None,
    postprocess=None,
    preprocess_map_kwargs: dict | None = None,
    postprocess_map_kwargs: dict | None = None,
) -> Processor:
    """Ray Data LLM's `build_processor` for genrec-batch: the config (a ProcessorConfig, or a nightly Config whose
    processor fields are used) checked on the driver as the nightly's plan checks it -> a Processor."""
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs)


def check(cfg: ProcessorConfig) -> Decoder:
    """The processor's driver checks: the item sources' credentials, then the nightly's (`resolve_decoder`)."""
    for uri in (cfg.catalog, cfg.recommendable, cfg.blocked):
        if uri:
            S.check_access(uri, cfg.storage)
    return resolve_decoder(cfg)


def actor_args(cfg: ProcessorConfig, decoder: Decoder) -> dict:
    """What each actor is built from: small, inline values (the items are read by each actor, as the nightly's)."""
    fs, path = S.filesystem(cfg.catalog, cfg.storage)
    c = cfg.compute
    spec = replace(
        decoder.spec,
        run_id="processor",
        catalog=None,
        recommendable=None,
        audit_users=0,  # no metrics table to report it in
        target_sha256=decoder.models["target"]["sha256"],
        draft_sha256=decoder.models.get("draft", {}).get("sha256", ""),
        target_files=decoder.models["target"]["files"],
        draft_files=decoder.models.get("draft", {}).get("files", ""),
        decode_batch=c.decode_batch or (None if c.gpus_per_actor else c.batch_size),  # a nightly shard's on a CPU
    )
    items = ItemsRef(
        Sources.of(cfg, spec.template.item_columns), S.content_id(path, fs, cfg.storage), decoder.items.identity
    )
    return {"spec": spec, "items": items, "storage": cfg.storage, "config": cfg}


def merged(row: dict, fn) -> dict:
    """Ray Data LLM's preprocess: the row with the columns `fn(row)` returns merged in; anything but a mapping of
    columns refused, naming the preprocess and what it returned."""
    columns = fn(row)
    if not isinstance(columns, Mapping):
        raise TypeError(
            f"processor: preprocess {getattr(fn, '__name__', fn)!r} must return a dict of the columns to add or "
            f"replace, got {type(columns).__name__}: {str(columns)[:80]}"
        )
    return {**row, **columns}


class RowRecommender:
    """The processor's actor: the nightly's Recommender over the items it reads itself. Each batch -> the batch with
    its rows' lists beside them, one row out per row in."""

    def __init__(self, spec, items: ItemsRef, storage, config: ProcessorConfig):
        self.recommender = recommender_of(spec, items, storage)
        self.config = config

    def __call__(self, batch: pa.Table) -> pa.Table:
        template = self.recommender.spec.template
        return with_lists(batch, self.recommender.recommend(decoder_rows(batch, self.config, template)))


def decoder_rows(batch: pa.Table, cfg: ProcessorConfig, template=None) -> pa.Table:
    """A batch of the user's dataset -> the rows the recommender reads, as the nightly's read tasks give them
    (`plan.input_columns`: the user id and the history by `columns`, the exclusion column where the dataset has
    it, and the columns the prompt template writes), Ray Data's one-dimensional tensor columns as lists. A column
    missing, an output column already there, user ids that are not ids (`plan.id_kind`) or a {user:COLUMN} the
    template writes that is not text or numbers (`is_text`; the nightly's plan checks its input's once) ->
    ValueError naming them."""
    taken = [c for c in OUTPUT_COLUMNS if c in batch.column_names]
    if taken:
        raise ValueError(f"processor: the dataset already has column(s) {taken}, which the processor adds; rename them")
    columns = input_columns(cfg, batch.schema, template)
    missing = [c for c in columns.values() if c not in batch.column_names]
    if missing:
        c = cfg.columns
        raise ValueError(
            f"processor: the dataset has no column(s) {missing} (columns.user_id {c.user_id}, columns.history "
            f"{c.history}); it has {batch.column_names}"
        )
    for c in template.user_columns if template else ():
        kind = batch.schema.field(c).type
        if not is_text(kind):
            raise ValueError(
                f"processor: models.template writes {{user:{c}}}, but the dataset's {c} is {kind}: strings, integers, "
                "floats or booleans are written as text"
            )
    user = batch.schema.field(cfg.columns.user_id).type
    if user != pa.null():  # a batch whose every id is null: each row is rejected (missing_user_id)
        id_kind(user, f"(the processor's dataset, columns.user_id {cfg.columns.user_id})")
    rows = units.renamed(batch, columns)
    return pa.table({name: plain(rows[name]) for name in rows.column_names})


def plain(column: pa.ChunkedArray) -> pa.ChunkedArray | pa.Array:
    """Ray Data's one-dimensional tensor columns (numpy arrays in a pandas column: ArrowTensorType, or
    ArrowVariableShapedTensorType where their lengths differ) -> their lists; any other column as it is."""
    kind = column.type
    if not isinstance(kind, pa.ExtensionType) or getattr(kind, "ndim", len(getattr(kind, "shape", ()))) != 1:
        return column
    storage = column.combine_chunks().storage
    if pa.types.is_struct(storage.type) and storage.type.get_field_index("data") >= 0:
        return pc.struct_field(storage, "data")  # null where the row is null
    return storage


def with_lists(batch: pa.Table, out: Recommended) -> pa.Table:
    """A batch [B] and its decode -> the batch with item_ids list<int64> (best first; fewer than k only where fewer
    items are left to the user; null for a rejected row), scores list<float32> (the same) and reject_reason (null
    for a listed row)."""
    reason = np.full(batch.num_rows, None, object)  # [B]
    reason[out.reject_rows] = out.rejects["reason"].to_numpy(zero_copy_only=False)
    lengths = np.zeros(batch.num_rows, np.int64)  # [B]
    lengths[out.rows] = out.listed
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())  # [B + 1] into the recommendations
    rejected = pa.array(reason != None)  # noqa: E711 (object array: elementwise)
    lists = {
        name: pa.ListArray.from_arrays(offsets, out.recs[column].combine_chunks(), mask=rejected)
        for name, column in (("item_ids", "item_id"), ("scores", "score"))
    }
    lists["reject_reason"] = pa.array(reason.tolist(), pa.string())
    for name, values in lists.items():
        batch = batch.append_column(name, values)
    return batch
