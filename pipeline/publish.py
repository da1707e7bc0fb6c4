"""A decoded run published: the shards it keeps tallied (they must cover every input user), its manifest, then
_SUCCESS and _LATEST, the lease checked before each."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import pyarrow as pa

from operators.outputs import table_schema
from pipeline import runs, shards, signals
from pipeline import storage as S
from pipeline.attempt import Attempt, actor_resources
from pipeline.carry import check_decoded_on, full_decode_estimate
from pipeline.config import Config
from pipeline.lease import Lease
from pipeline.lineage import NOT_PARTS, decoded_on, sha256_of
from pipeline.plan import Clock, Plan, code_version
from pipeline.signals import hold_for_test

log = logging.getLogger("genrec.nightly")


def tally_shards(plan: Plan, a: Attempt, since: float) -> tuple[dict, dict]:
    """The shards this run publishes (those its attempt trusted and those it committed, nothing else) -> (every
    table's files, `shards.tally` of them); with no shard at all, empty typed recommendations and rejects tables.
    The shards must cover every input user."""
    cfg = plan.cfg
    stems = shards.attempt_shards(a.run, cfg.storage, a.trusted, a.id)
    files = {name: [f"{stem}.parquet" for stem in stems] for name in runs.TABLES}
    users = set(S.list_files(runs.table_dir(a.run, "users"), cfg.storage))  # shards resumed from an older version
    files["users"] = [f for f in files["users"] if f in users]  # have none: their users are never carried
    if not stems:
        files |= write_empty_tables(plan, a.run)
    sums = shards.tally(a.run, cfg.storage, stems, since=since)
    if sums["users_in"] != a.total:
        raise RuntimeError(
            f"run {a.run_id}: the committed shards cover {sums['users_in']} users, the input has {a.total}"
        )
    return files, sums


def write_empty_tables(plan: Plan, run: str) -> dict:
    """Empty, typed recommendations, rejects and users tables (a run without a shard) -> their files."""
    user_type = plan.user_type
    empty = {
        "recommendations": table_schema("rec", user_type).empty_table(),
        "rejects": table_schema("reject", user_type).empty_table(),
        "users": shards.users_schema(user_type).empty_table(),
    }
    for name, table in empty.items():
        runs.write_table(run, name, table, plan.cfg.storage)
    return {name: [f"{name}.parquet"] for name in empty}


def manifest_of(plan: Plan, a: Attempt, files: dict, sums: dict, timings: dict) -> dict:
    """The run's manifest: what it read and how (config, code, models, template, catalog), what it wrote (counts,
    every table's files: readers read these, never a listing) and how it went (resume, duplicates, precision audit,
    engine, exclusions, timings)."""
    cfg, renderer = plan.cfg, plan.inputs.renderer
    return {
        "run_id": a.run_id,
        "run_date": cfg.run_date,
        "status": "succeeded",
        "config": cfg.to_dict(),
        "input": {"uri": cfg.input, "version": plan.input_version, "files": len(plan.data.files)},
        "actors": {
            "count": len(sums["compute_actors"]) or a.pool.initial,
            "pool": asdict(a.pool),
            **actor_resources(cfg.compute),
        },
        "cluster": a.watch.faults() if a.watch else {"nodes_lost": [], "nodes_joined": [], "tasks_retried": 0},
        "code_version": code_version(),
        "models": {role: {"uri": m["uri"], "sha256": m["sha256"]} for role, m in plan.models.items()},
        "template": renderer.template.to_dict(),
        "max_prompt_tokens": renderer.max_len,
        "prefix_tokens": len(renderer.prefix_ids),
        "auto": sums["auto"],
        "catalog": catalog_info(plan),
        "counts": counts(plan, a, sums),
        "lineage": lineage_info(plan, sums),
        "incremental": incremental_info(plan, sums, timings),
        "resume": resume_info(a),
        "duplicates": {"users": 0 if a.duplicates is None else a.duplicates.num_rows, "checked_on": a.checked_on},
        "precision_audit": sums["precision_audit"],
        "engine": engine_info(plan, a, sums),
        "exclusions": exclusions_summary(cfg, plan.data.schema, sums["exclusions"]),
        "timings": timings,
        "outputs": {name: runs.table_dir(a.run, name) for name in runs.TABLES},
        "files": files,
    }


def engine_info(plan: Plan, a: Attempt, sums: dict) -> dict:
    """The manifest's `engine`: beam search's engine, its compile totals and store, compute.engine auto's decision."""
    c = plan.cfg.compute
    return {
        "name": c.engine,
        "graphs_compiled": sums["graphs_compiled"],
        "graphs_cold": sums["graphs_cold"],
        "compile_store": plan.spec.compile_store.root if plan.spec.compile_store else None,
        "decision": runs.EngineRecord(a.run, plan.cfg.storage).read() if c.engine == "auto" else None,
    }


def lineage_info(plan: Plan, sums: dict) -> dict:
    """The manifest's `lineage`: the run's fingerprint part by part and its sha256, what its lists were decoded in
    and on (its decoded users', and where it carried users its base's: a carried list is the base's), and the
    settings left out of the fingerprint, with why."""
    on, base = sums["decoded_on"], plan.base.decoded_on if plan.base and sums["users_carried"] else {}
    on = decoded_on(*([*on.get(k, []), *base.get(k, [])] for k in ("dtypes", "devices", "engines")))
    return {"fingerprint": plan.lineage, "sha256": sha256_of(plan.lineage), "decoded_on": on, "not_in_it": NOT_PARTS}


def counts(plan: Plan, a: Attempt, sums: dict) -> dict:
    """The manifest's `counts`: the input's rows, the shards' COUNTS, and users by what became of them: `users`
    (the input's rows less repeated ids; the users table leaves rows without an id out too), decoded (by the actors,
    rejects included), carried (copied from the base), and of the base's users with a list, those absent from
    tonight's input (`users_dropped`; 0 without a base)."""
    users = sums["users_in"] - sums["users_duplicate"]
    carried = sums["users_carried"]
    base = plan.base.users if plan.base else 0
    return {
        "input_rows": a.total,
        **{key: sums[key] for key in COUNTS},
        "users": users,
        "users_decoded": users - carried,
        "users_carried": carried,
        "users_dropped": max(base - carried - sums["users_changed"], 0) if plan.base else 0,
    }


def incremental_info(plan: Plan, sums: dict, timings: dict) -> dict:
    """The manifest's `incremental`: whether the run carried users from a base (`mode`: carry, full) and which, why a
    night was full, and the decode seconds against a full night's, estimated from the decoded users' rate."""
    decoded = sums["users_in"] - sums["users_duplicate"] - sums["users_carried"]
    estimate = full_decode_estimate(timings, decoded, sums["users_carried"])
    return {**plan.incremental, "decode_s": timings["decode_s"], "full_decode_s_estimate": estimate}


COUNTS = ("users_ok", "users_short", "users_rejected", "users_non_finite", "recommendations", "batches", "decode_batch")
COUNTS += ("users_truncated", "users_too_long")  # prompts past decoding.max_prompt_tokens: cut to fit, rejected


def catalog_info(plan: Plan) -> dict:
    """The manifest's `catalog`: the item index, the recommendable set and the block list (`items.describe`: sources,
    sizes, content hashes, the index's partition into recommendable, blocked and not recommendable items), the items
    the constraint index holds, and the duplicate-semantic-ID policy: the semantic IDs that name more than one item
    a list may hold, the items behind them, and those it dropped (`first`)."""
    catalog = plan.inputs.catalog
    return {
        **{key: value for key, value in plan.items.info.items() if key != "sets"},
        "indexed": len(catalog),
        "duplicates": {
            "policy": plan.cfg.duplicate_items,
            "shared_semantic_ids": catalog.collisions[0],  # semantic IDs of more than one item a list may hold
            "items_sharing": catalog.collisions[1],  # the items behind them
            "dropped": len(catalog.duplicates),
            "items": [{"item_id": d, "kept": k} for d, k in catalog.duplicates],
        },
    }


def resume_info(a: Attempt) -> dict:
    """The manifest's `resume`: whether the run was resumed, the shards committed before this attempt and after."""
    return {
        "resumed": a.resumed,
        "shards_committed_before": len(a.trusted),
        "shards_decoded": a.shards_decoded,
        "users_decoded": a.left,
        "interruptions": a.interruptions,  # earlier attempts stopped by SIGTERM / SIGINT
    }


def timings(plan: Plan, clock: Clock, sums: dict) -> dict:
    """The manifest's `timings` in seconds: the driver's phases (`clock`, `plan_run`'s) and the actors' (from the
    shards' metrics, since `clock.started`)."""
    return {
        "input_identity_s": plan.identity_s,  # the input files' content identities (plan_run)
        "attempt_s": clock.seconds["attempt_s"],  # this attempt recorded, the trusted shards' ranges read
        "duplicates_s": clock.seconds["duplicates_s"],  # the duplicate user ids found
        "actor_ready_s": sums["actor_ready_s"],  # models loaded
        "first_shard_s": sums["first_commit_s"],
        "compile_s": sums["compile_s"],  # per actor: the compiled engine's warm-up and compiles
        "decode_s": clock.seconds["decode_s"],  # from the start until the last shard committed
        "total_s": clock.seconds["total_s"],  # until the manifest
    }


def exclusions_summary(cfg: Config, schema: pa.Schema, sums: dict) -> dict:
    """The manifest's `exclusions`: the mode, the exclusion column (None: not in the input), the users they were built
    for, the excluded items per user (distinct items the index holds: mean and max) and the ignored unknown ids."""
    users = sums["exclude_users"]
    return {
        "mode": cfg.decoding.exclude,
        "column": cfg.decoding.exclude_column if cfg.decoding.exclude_column in schema.names else None,
        "users": users,
        "excluded_per_user_mean": sums["excluded_items"] / users if users else 0.0,
        "excluded_per_user_max": sums["excluded_max"],
        "unknown_ids_ignored": sums["exclude_unknown_ids"],
    }


def publish_run(plan: Plan, a: Attempt, manifest: dict, lease: Lease, latest: str | None) -> None:
    """Checks the date's lease, writes the manifest and _SUCCESS (each created only if absent: no second writer
    replaces them), checks the lease again and publishes the run, deleting the runs it superseded past their grace.
    A run that lost the date never writes its manifest over another's, nor publishes."""
    cfg = plan.cfg
    if plan.base is not None:
        check_decoded_on(plan.base, manifest["lineage"]["decoded_on"])
    hold_for_test("BEFORE_PUBLISH")
    lease.check()
    runs.finish(a.run, manifest, cfg.storage, lease.check)
    lease.check()
    with signals.STOP.deferred("publishing"):  # published, then stopped: the run is done, exit 0
        deleted = runs.publish(cfg.output, cfg.run_date, a.run_id, cfg.storage, cfg.runs.grace_s, latest)
    log.info(
        "run %s published: %s; deleted superseded runs %s", a.run_id, json.dumps(manifest["counts"]), deleted or "none"
    )
