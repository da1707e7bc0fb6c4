"""The nightly job's plan: everything checked on the driver before Ray does any work (credentials, the input and its
user id kinds, the items, the models and their checksums, the template, an actor's own checks, the output store's
conditional writes), the run's content identity and which run a resume continues."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.dataset as pads

from decoding.stats import timed
from decoding.templates import TEMPLATE_FILE, PromptTemplate, get_template, read_template
from operators.prompts import is_text
from operators.recommender import Inputs, prepare
from operators.spec import ActorSpec
from pipeline import runs, stores, units
from pipeline import storage as S
from pipeline.carry import Base, choose_base
from pipeline.config import ROW_COLUMNS, Config
from pipeline.items import Items, Sources, read_items
from pipeline.lineage import catalog_texts_sha256, code_identity, describe_code, fingerprint, software
from pipeline.models import compile_store
from pipeline.stores.base import Input

log = logging.getLogger("genrec.nightly")


RESUME_FREE_COMPUTE = ("num_actors", "cpus_per_actor", "threads_per_actor", "batches_per_task", "order_by_length")
# ^ not in the rows: how the users are cut into shards and slices, never what a user gets


def open_input(cfg: Config, version: int | None = None) -> tuple[Input, str]:
    """The histories opened by their source (pipeline/stores: parquet, a Delta or an Iceberg table) at `version`
    (None: the newest; a table's version read is the Input's), every file's footer read (a corrupt file fails fast,
    named), and the kind of user id (`id_kind`). Every file must hold the user id and history columns, with one kind
    of id; the schema is the source's (a table's, or every parquet file's unified)."""
    inp = stores.source(cfg.input).open(cfg, version)
    kinds = {}  # each file's user_id type
    user, history = cfg.columns.user_id, cfg.columns.history
    for fragment in inp.data.get_fragments():
        names = inp.names.get(fragment.path, {})
        held = {c: names.get(c, c) for c in (user, history)}  # the file's names for them (None: it lacks one)
        physical = fragment.physical_schema
        missing = [c for c, name in held.items() if name is None or name not in physical.names]
        if missing:
            raise ValueError(
                f"input file {fragment.path}: missing column(s) {missing} (has {physical.names}){mapped(cfg)}"
            )
        kinds[fragment.path] = id_kind(physical.field(held[user]).type, fragment.path)
    if len(set(kinds.values())) > 1:
        shown = "; ".join(f"{kind} in {path}" for path, kind in sorted(kinds.items(), key=lambda x: x[1])[:4])
        raise ValueError(f"input {cfg.input}: {user} is {shown}: one kind of id in every file (an id is one user)")
    if not kinds and user in inp.data.schema.names:  # a table without a file: its schema's
        kinds[""] = id_kind(inp.data.schema.field(user).type, cfg.input)
    if kinds and user not in inp.data.schema.names:  # files of one kind of id in two types no read casts between
        S.unified_schema(list(inp.data.get_fragments()), f"input {cfg.input}", [user])  # (uint64, int64): named
    return inp, next(iter(kinds.values()), "integer")


def mapped(cfg: Config) -> str:
    """What an error on the input's columns adds when the config renames them."""
    c = cfg.columns
    renamed = (c.user_id, c.history) != ("user_id", "history")
    return f" (columns.user_id {c.user_id}, columns.history {c.history})" if renamed else ""


def id_kind(kind: pa.DataType, uri: str) -> str:
    """A file's user_id type -> its kind of id: integer, string or binary, what every mode keys a user by (its list,
    its duplicates, and in the sampling modes its draws: decoding/draws.py). Anything else (a float id from pandas'
    NaN, a decimal, a date, dictionary-encoded strings) is refused here, naming the type and the cast to make."""
    t = pa.types
    if t.is_integer(kind):
        return "integer"
    if t.is_string(kind) or t.is_large_string(kind):
        return "string"
    if t.is_binary(kind) or t.is_large_binary(kind) or t.is_fixed_size_binary(kind):
        return "binary"
    raise ValueError(
        f"input {uri}: column user_id is {kind}; user ids must be integers, strings or binary. Cast it where the "
        "input is written: integral floats to int64 (pandas: df.user_id.astype('int64'), after dropping the rows "
        "with no id), a decimal or date to string (df.user_id.astype(str))"
    )


def code_version() -> str:
    """The manifest's `code_version`: the git commit of the checkout genrec-batch runs from, when its source tree is
    that checkout (never a repository a wheel install happens to lie in), else `genrec-batch <version>`. What the
    code is, edits included, is `lineage.code_identity` (the fingerprint's `code`)."""
    root = Path(__file__).resolve().parents[1]
    try:
        run = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True, cwd=root)
        top, head = run.stdout.split() if run.returncode == 0 else ("", "")
    except (OSError, ValueError):
        top, head = "", ""
    return head if top and Path(top).resolve() == root else f"genrec-batch {code_identity()['version']}"


def resolve_models(cfg: Config) -> dict:
    """The models as the driver checks them, before any work -> {role: {"uri", "sha256", "dir"}} for the target, and
    the draft in the atspeed modes. A local folder is hashed; an s3:// model is checked without its weights
    (`S.model_head`: its sha256sums.json, its small files downloaded into a temporary folder, "dir", and its
    weights' sizes against their headers): the driver's node needs no room for them, and the sha256 is the same
    either way (`S.weights_fingerprint`). The actors download and verify the weights on their own nodes."""
    models = {}
    for role in ("target", "draft"):
        uri = getattr(cfg.models, role)
        if uri and (role == "target" or cfg.decoding.uses_draft):
            try:
                models[role] = model_of(uri, cfg.storage)
            except (FileNotFoundError, ValueError) as e:
                raise FileNotFoundError(f"models.{role}: {e}") from None
    return models


def model_of(uri: str, storage) -> dict:
    """One model as the driver checks it: {"uri", "sha256", "dir"} (an s3:// model's small files in a temporary
    folder, removed when the process ends; "head": that folder)."""
    if not S.is_s3(uri):
        local = S.local_model_dir(uri, "", storage)
        files = S.local_files_fingerprint(local)
        return {"uri": uri, "sha256": S.fingerprint(local), "dir": str(local), "files": files}
    head = tempfile.TemporaryDirectory(prefix="genrec-model-head-")
    sums = S.model_head(uri, storage, Path(head.name))
    files = S.files_fingerprint(sums)
    return {"uri": uri, "sha256": S.weights_fingerprint(sums), "dir": head.name, "head": head, "files": files}


def resolve_template(cfg: Config, models: dict) -> PromptTemplate:
    """The prompt template: models.template (a preset or a JSON file) or the target directory's; a draft that carries
    a template must carry the same one (it reads the target's prompts)."""
    try:
        template = get_template(cfg.models.template) if cfg.models.template else read_template(models["target"]["dir"])
    except ValueError as e:
        raise ValueError(f"models.template: {e}" if cfg.models.template else f"models.target: {e}") from None
    draft = models.get("draft", {}).get("dir")
    if draft and (Path(draft) / TEMPLATE_FILE).is_file() and read_template(draft) != template:
        raise ValueError(
            f"models.draft {cfg.models.draft}: its {TEMPLATE_FILE} differs from the target's prompt "
            "template; a draft must read the prompts its target reads"
        )
    return template


def fetch_model(uri: str, sha256: str, files: str, cache_dir: str, storage) -> str:
    """A model URI and what the plan fingerprinted of it (its weights' sha256, its other files') -> a local directory
    on this node holding that model (s3:// copied once per node, verified; `S.local_model_dir`), else ModelChanged or
    NodeDenied."""
    return str(S.local_model_dir(uri, cache_dir, storage, sha256, files))


def actor_spec(cfg: Config, run_id: str, items: Items, template: PromptTemplate) -> ActorSpec:
    """What every actor gets: the model URIs and how to fetch them on its node, the items read once (the index and
    which of its items a list may hold), the prompt template, the decoding settings."""
    m = cfg.models
    return ActorSpec(
        run_id=run_id,
        target=m.target,
        catalog=items.table,
        catalog_name=cfg.catalog,
        recommendable=items.served,
        decoding=cfg.decoding,
        template=template,
        on_duplicate=cfg.duplicate_items,
        draft=m.draft if cfg.decoding.uses_draft else None,
        fetch=functools.partial(fetch_model, cache_dir=m.cache_dir, storage=cfg.storage),
        gpu=cfg.compute.gpus_per_actor > 0,
        dtype=cfg.compute.dtype,
        audit_users=cfg.compute.batch_size if cfg.compute.audit_users is None else cfg.compute.audit_users,
        decode_batch=cfg.compute.decode_batch,
        order_by_length=cfg.compute.order_by_length,
        threads=cfg.compute.threads_per_actor,
        engine=cfg.compute.engine,
        engine_trials=cfg.compute.engine_trials,
        engine_short_run_s=cfg.compute.engine_short_run_s,
        engine_trial_max=cfg.compute.engine_trial_max,
        engine_clear_users=cfg.compute.engine_clear_users,
        compile_cache=cfg.compute.compile_cache,
        compile_store=compile_store(cfg),
        warm_users=cfg.compute.decode_batch or cfg.compute.batch_size,
    )


def direct_spec(cfg: Config) -> ActorSpec:
    """The spec of the config's actor for a recommender built in this process (the benchmarks' direct calls)."""
    template = resolve_template(cfg, resolve_models(cfg))
    items = read_items(Sources.of(cfg, template.item_columns), cfg.storage, record=False)
    return actor_spec(cfg, "direct", items, template)


class Clock:
    """The driver's phase timings of one run, for the manifest's `timings` (`decoding.stats.timed`, as `Meter.phase`
    times a decoder's phases): `with clock.phase("attempt"):` adds the block's seconds to `seconds["attempt_s"]`.
    `started` is the wall clock when it was made (the shards' commit times are measured from it)."""

    def __init__(self):
        self.started = time.time()
        self.seconds: dict[str, float] = {}

    def phase(self, name: str):
        return timed(self.seconds, f"{name}_s")


@dataclass
class Plan:
    """A run checked on the driver, before Ray starts any work."""

    cfg: Config
    data: pads.Dataset
    fs: object  # the input's filesystem
    units: list[units.Unit]
    items: Items  # the item index, the recommendable set and the block list
    models: dict
    spec: ActorSpec  # run_id set when the run starts
    inputs: Inputs
    identity: dict  # what the decoded rows depend on, by content (`content_identity`)
    identity_s: float  # what computing it took
    lineage: dict  # the run's fingerprint: every input of a list but the user's own (pipeline/lineage.py)
    base: Base | None  # incremental: the run it carries users from (None: a full run)
    incremental: dict  # the manifest's `incremental` record (carry.choose_base)
    input_version: int | None = None  # a table input: the version (Delta) or snapshot id (Iceberg) read
    names: dict = field(default_factory=dict)  # the files that name the input's columns otherwise (`stores.Input`)

    @property
    def user_type(self) -> pa.DataType:
        """The input's user id type."""
        return self.data.schema.field(self.cfg.columns.user_id).type

    @property
    def fingerprint(self) -> str:
        """What a resume must find unchanged: the config (but `runs`), the input's row groups and the content of the
        input files, the catalog, the recommendable set, the block list, the models (weights and files), the code and
        the software."""
        return hashlib.sha256(json.dumps([self.config, self.identity], default=str).encode()).hexdigest()

    @property
    def config(self) -> dict:
        """The config a resume must find unchanged, as _RUN.json records it (`resume_config`)."""
        return resume_config(self.cfg.to_dict())

    def changed_models(self, old: dict) -> list[str]:
        """The models whose weights or other files (config, tokenizer, ...) differ from a recorded start's identity
        (`old`), named; a model's sha256 compares only within one way of computing it (`MODEL_SHA256`)."""
        new, named = self.identity, lambda r: f"models.{r} {getattr(self.cfg.models, r)}"
        out = [
            named(r)
            for r in sorted(set(old.get("models", {})) | set(new["models"]))
            if old.get("model_sha256") == MODEL_SHA256 and old.get("models", {}).get(r) != new["models"].get(r)
        ]
        return out + [
            f"{named(r)} (its files but the weights: config, tokenizer, ...)"
            for r in sorted(set(old.get("model_files", {})) | set(new["model_files"]))
            if "model_files" in old and old["model_files"].get(r) != new["model_files"].get(r)
        ]

    def changes(self, state: dict) -> list[str]:
        """What differs between a run's recorded start (_RUN.json) and this plan, named; [] when it can resume."""
        if state.get("fingerprint") == self.fingerprint:
            return []
        old, new = state.get("identity") or {}, self.identity
        out = [
            f"input file {f}"
            for f in sorted(set(old.get("input", {})) | set(new["input"]))
            if old.get("input", {}).get(f) != new["input"].get(f)
        ]
        out += ["the input's row groups"] * (old.get("row_groups") != new["row_groups"])
        was, now = old.get("input_version"), new.get("input_version")
        out += [f"the input table's version ({was} then, {now} now)"] * (was != now)
        out += [f"the catalog {self.cfg.catalog}"] * (old.get("catalog") != new["catalog"])
        sources = Sources.of(self.cfg)
        out += [
            f"the {what} items ({sources.named(what)})"
            for what in ("recommendable", "blocked")
            if "items" in old and old["items"].get(what) != new["items"][what]  # a run of an older version: below
        ]
        out += self.changed_models(old)
        out += ["the incremental base"] * (old.get("base") != new.get("base") and "base" in old)
        was, now = old.get("code"), new["code"]
        out += [f"the code (genrec-batch {describe_code(was)} then, {describe_code(now)} now)"] * (was != now)
        was, now = old.get("software") or {}, new["software"]
        out += [
            f"the software ({name} {was.get(name)} then, {now.get(name)} now)"
            for name in sorted(set(was) | set(now))
            if "software" in old and was.get(name) != now.get(name)
        ]
        was = {**DEFAULTS, **resume_config(state.get("config") or {})}  # a field it predates: as if at its default
        keys = sorted(k for k in set(was) | set(self.config) if was.get(k) != self.config.get(k))
        out += [f"the config ({', '.join(keys)})"] * bool(keys)
        return out or ["its recorded fingerprint (started by another version of genrec-batch)"]


def resume_config(config: dict) -> dict:
    """The part of a config (`Config.to_dict()`) that the decoded rows depend on: all but how the job runs (`runs`,
    `serving` and `table`: where the published run is exported; `input_version`: the identity's own,
    `storage.retry_s`: a run that gave up on the store resumes with a larger budget; the pool's size and CPUs,
    RESUME_FREE_COMPUTE: a run that stalled resumes on the cluster it has)."""
    out = {k: v for k, v in config.items() if k not in ("runs", "serving", "table", "input_version")}
    if isinstance(out.get("incremental"), dict):
        out["incremental"] = {k: v for k, v in out["incremental"].items() if k != "pin_s"}
    if isinstance(out.get("storage"), dict):
        out["storage"] = {k: v for k, v in out["storage"].items() if k != "retry_s"}
    if isinstance(out.get("compute"), dict):
        out["compute"] = {k: v for k, v in out["compute"].items() if k not in RESUME_FREE_COMPUTE}
    return json.loads(json.dumps(out, default=str))


DEFAULTS = resume_config(Config().to_dict())  # top-level fields a run's recorded config may predate


MODEL_SHA256 = "weights-sha256-v2"  # how a model's sha256 is computed (S.weights_fingerprint): runs recorded otherwise
# are another version's, whose models are not compared


def content_identity(
    cfg: Config, data: pads.Dataset, fs, plan_units: list, models: dict, items: Items, version: int | None
) -> dict:
    """Each input file's content identity (S3: ETag and size; locally the sha256 of its bytes), a table input's
    version (`input_version`: a Delta version, an Iceberg snapshot id; None for parquet), the input's row groups, the
    catalog's identity, the recommendable set's and the block list's (sha256 of their ids), every model's sha256 and
    its other files' (config, tokenizer: `S.files_fingerprint`), the code's (`lineage.code_identity`: a run's shards
    are all decoded by one code) and the software's versions (torch, transformers: `lineage.software`)."""
    cat_fs, cat_path = S.filesystem(cfg.catalog, cfg.storage)
    rows = [(u.path, u.row_group, u.rows) for u in plan_units]
    return {
        "input": {f: S.content_id(f, fs, cfg.storage) for f in sorted(data.files)},
        "input_version": version,
        "row_groups": hashlib.sha256(json.dumps(rows).encode()).hexdigest(),
        "catalog": S.content_id(cat_path, cat_fs, cfg.storage),
        "items": items.identity,
        "models": {role: m["sha256"] for role, m in models.items()},
        "model_files": {role: m["files"] for role, m in models.items()},  # config, tokenizer, ... (`files_fingerprint`)
        "model_sha256": MODEL_SHA256,
        "code": code_identity(),
        "software": software(),
    }


def plan_run(cfg: Config, resume: str | None = None) -> Plan:
    """Every check that needs no Ray (`plan_at`). A table input without input_version is read at the version of the
    run `resume` continues, if that run can continue (`pinned_versions`); else at its newest version."""
    for run_id, version in pinned_versions(cfg, resume):
        plan = plan_at(cfg, version, run_id)
        state = runs.state_of(runs.run_dir(cfg.output, cfg.run_date, run_id), cfg.storage) or {}
        changed = plan.changes(state)
        if resume != "latest" or not changed:
            return plan  # an explicit --resume RUN_ID that changed is refused by `resume_id`, naming what
        log.warning("--resume latest: run %s (input version %s) cannot continue: %s", run_id, version, changed)
    return plan_at(cfg, cfg.input_version, None)


def plan_at(cfg: Config, version: int | None, pinned_by: str | None) -> Plan:
    """Every check that needs no Ray: credentials, input (a table input at `version`, None: the newest;
    `pinned_by`: the run whose start pinned it), the items (catalog, recommendable set, block list), models,
    template, the actor's own checks, the output store's conditional writes (`S.check_store_once`), each
    sink's own checks (pipeline/stores). A missing input, catalog, item set or model raises FileNotFoundError naming
    it ("... not found")."""
    source = stores.source(cfg.input).location(cfg.input)
    for uri in (cfg.output, source, cfg.catalog, cfg.recommendable, cfg.blocked):
        if uri:
            S.check_access(uri, cfg.storage)
    inp, kind = open_input_pinned(cfg, version, pinned_by)
    data = inp.data
    items, models, spec, inputs = resolve_decoder(cfg, data)
    plan_units, clock = units.plan_units(data), Clock()
    with clock.phase("input_identity"):
        identity = content_identity(cfg, data, inp.fs, plan_units, models, items, inp.version)
    S.check_store_once(cfg.output, cfg.storage)  # what the lease and _LATEST rest on, before the lease
    for target in (cfg.table, cfg.serving):
        if target.uri:
            stores.sink(target.uri).check(target, cfg.storage)
    parts = run_fingerprint(cfg, models, inputs, items, kind, data.schema)
    base, incremental = choose_base(cfg, parts)
    identity["base"] = base.uri if base else None  # a resume carries from the base its run started with
    log_incremental(incremental)
    seconds = clock.seconds["input_identity_s"]
    plan = Plan(cfg, data, inp.fs, plan_units, items, models, spec, inputs, identity, seconds, parts, base, incremental)
    plan.input_version, plan.names = inp.version, inp.names
    return plan


class Decoder(NamedTuple):
    """What every actor decodes with, checked on the driver (`resolve_decoder`)."""

    items: Items  # the item index, the recommendable set and the block list
    models: dict  # role -> {"uri", "sha256", "dir", ...} (`resolve_models`)
    spec: ActorSpec  # run_id unset
    inputs: Inputs  # what an actor builds from the spec before loading weights (`prepare`)


def resolve_decoder(cfg: Config, data: pads.Dataset | None = None) -> Decoder:
    """The items, the models and their sha256, the template and an actor's own checks, on the driver: what an actor
    would refuse fails here, before any work (the nightly's plan and the processor's). `data`: the input, whose
    columns the template's placeholders must name (the processor's dataset is checked batch by batch instead)."""
    models = resolve_models(cfg)
    template = resolve_template(cfg, models)
    if data is not None:
        check_prompt_columns(cfg, template, data)
    items = read_items(Sources.of(cfg, template.item_columns), cfg.storage)
    log_items(items.info)
    spec = actor_spec(cfg, "", items, template)
    heads = {m["uri"]: m["dir"] for m in models.values()}  # the driver's copies: no weights
    return Decoder(items, models, spec, prepare(replace(spec, fetch=lambda uri, *_: heads[uri])))


def open_input_pinned(cfg: Config, version: int | None, pinned_by: str | None) -> tuple[Input, str]:
    """`open_input` at `version`; one a resumed run pinned (`pinned_by`) that is gone is refused naming it and the
    way on (FileNotFoundError: exit 2)."""
    try:
        return open_input(cfg, version)
    except FileNotFoundError as e:
        if pinned_by is None:
            raise
        raise FileNotFoundError(
            f"--resume: run {pinned_by} started on {cfg.input} version {version}, which cannot be read now: {e}. "
            "Start a new run (without --resume): it reads the table's newest version"
        ) from None


def pinned_versions(cfg: Config, resume: str | None) -> list[tuple[str, int]]:
    """The runs a resume may continue, with the table input's version each started on [(run id, version)], in the
    order the resume tries them: `--resume RUN_ID` that run; `--resume latest` the date's complete, unpublished runs
    (newest first: one that can is published without decoding), then its newest unfinished run. [] for a parquet
    input, with input_version set, or without a resume."""
    if not stores.source(cfg.input).VERSIONED or cfg.input_version is not None or not resume:
        return []
    found = [resume]
    if resume == "latest":
        found = runs.complete_unpublished(cfg.output, cfg.run_date, cfg.storage)
        found += runs.unfinished(cfg.output, cfg.run_date, cfg.storage)[:1]
    out = []
    for run_id in found:
        state = runs.state_of(runs.run_dir(cfg.output, cfg.run_date, run_id), cfg.storage) or {}
        version = (state.get("identity") or {}).get("input_version")
        if version is not None:
            out.append((run_id, version))
    return out


def run_fingerprint(cfg: Config, models: dict, inputs: Inputs, items: Items, kind: str, schema: pa.Schema) -> dict:
    """The run's fingerprint (`lineage.fingerprint`) from what the plan resolved: the template with the chat template
    it renders with, and the catalog columns it writes."""
    column = cfg.decoding.exclude_column if cfg.decoding.exclude_column in schema.names else None
    renderer = inputs.renderer
    template = renderer.template.to_dict()
    if renderer.chat is not None:
        template = {"template": template, "chat_template": renderer.chat}
    texts = catalog_texts_sha256(items.table, renderer.template.item_columns)
    info = {"sha256": items.info.get("sha256"), "sets": items.identity, **({"texts": texts} if texts else {})}
    args = (template, renderer.max_items, info, inputs.catalog.listing_sha256(), kind, column, device_kind(cfg))
    return fingerprint(cfg, models, *args)


def device_kind(cfg: Config) -> str:
    """What the actors decode on, as the config says: cpu or cuda. Which GPU, and the dtype `auto` resolves to
    there, only the actors know: the manifest records them (`lineage.decoded_on`) and an incremental night publishes
    only if its decoded users' are among its base's (`carry.check_decoded_on`)."""
    return "cuda" if cfg.compute.gpus_per_actor else "cpu"


def log_incremental(record: dict) -> None:
    if not record["enabled"]:
        return
    if record["mode"] == "carry":
        log.info("incremental: carrying unchanged users from run %s (%s)", record["base_run_id"], record["base"])
    else:
        log.warning("incremental: a full run (base %s): %s", record.get("base"), ", ".join(record["full_because"]))


def log_items(info: dict) -> None:
    """One line on what the lists are drawn from; a warning for ids of the recommendable set or the block list that
    the item index lacks (counted in the manifest, not fatal)."""
    log.info(
        "items: %d in the index %s; %d recommendable, %d blocked, %d not recommendable",
        info["items"],
        info["uri"],
        info["recommendable"],
        info["blocked"],
        info["not_recommendable"],
    )
    for name in ("recommendable_set", "block_list"):
        part = info[name]
        if part["unknown_ids"]:
            log.warning(
                "%s %s: %d ids the item index lacks (no semantic ID: never recommended); counted in the manifest",
                name.replace("_", " "),
                part["source"],
                part["unknown_ids"],
            )


def resume_id(plan: Plan, resume: str) -> str | None:
    """--resume RUN_ID: that run, which must be unfinished and started on this same config, input, catalog and models
    (else ValueError naming what changed); --resume latest: the date's newest unfinished run if it can resume, else
    None: a new run (which supersedes it when it publishes), so that a retried job always publishes the date."""
    cfg = plan.cfg
    unfinished = runs.unfinished(cfg.output, cfg.run_date, cfg.storage)
    if resume == "latest":
        if not unfinished:
            log.info("--resume latest: no unfinished run of %s; starting a new run", cfg.run_date)
            return None
        changed = plan.changes(runs.state_of(runs.run_dir(cfg.output, cfg.run_date, unfinished[0]), cfg.storage))
        if changed:
            log.warning(
                "--resume latest: run %s cannot be resumed: %s changed since it started; starting a new run "
                "(it supersedes that one when it publishes)",
                unfinished[0],
                "; ".join(changed),
            )
            return None
        return unfinished[0]
    if resume not in unfinished:
        run = runs.run_dir(cfg.output, cfg.run_date, resume)
        why = (
            "it has _SUCCESS (already complete)"
            if runs.complete(run, cfg.storage)
            else "it was superseded by a later run"
            if S.read_bytes(S.join(run, "_SUPERSEDED"), cfg.storage)
            else "not found"
        )
        raise FileNotFoundError(
            f"--resume {resume}: run {run} cannot be resumed: {why}"
            if why != "not found"
            else f"--resume {resume}: run {run} not found"
        )
    check_resumable(plan, resume, runs.state_of(runs.run_dir(cfg.output, cfg.run_date, resume), cfg.storage))
    return resume


def check_resumable(plan: Plan, run_id: str, state: dict) -> None:
    changed = plan.changes(state)
    if changed:
        run = runs.run_dir(plan.cfg.output, plan.cfg.run_date, run_id)
        raise ValueError(
            f"--resume {run_id}: {'; '.join(changed)} changed since the run started (compare "
            f"{S.join(run, '_RUN.json')}); its committed shards would mix two inputs or models. Start a "
            "new run instead (--resume latest does)"
        )


def finished_unpublished(plan: Plan) -> str | None:
    """The date's newest complete run that was never published (its driver stopped between _SUCCESS and _LATEST) and
    was started on this same config, input, catalog and models, or None."""
    cfg = plan.cfg
    for run_id in runs.complete_unpublished(cfg.output, cfg.run_date, cfg.storage):
        if not plan.changes(runs.state_of(runs.run_dir(cfg.output, cfg.run_date, run_id), cfg.storage) or {}):
            return run_id
    return None


def input_columns(cfg: Config, schema: pa.Schema, template: PromptTemplate | None = None) -> dict[str, str]:
    """The input columns the actors read, {name in the rows: the input's column}: user_id and history (named by
    `columns`), the exclusion column when the input has it, and the other columns the prompt template writes
    ({history:COLUMN}, {user:COLUMN})."""
    out = {"user_id": cfg.columns.user_id, "history": cfg.columns.history}
    column = cfg.decoding.exclude_column
    out |= {column: column} if column in schema.names else {}
    return out | {c: c for c in (template.input_columns if template else []) if c not in out}


def check_prompt_columns(cfg: Config, template: PromptTemplate, data: pads.Dataset) -> None:
    """The input columns the template writes, refused before any work when the input lacks one (named; one whose
    files hold two kinds of type, left out of their unified schema, names both files: `S.unified_schema`), when one
    is not of its kind (a {history:...} column not a list, a {user:...} column not text or numbers) or when its name
    is one the job gives the rows it reads."""
    schema = data.schema
    names = schema.names
    missing = [c for c in template.input_columns if c not in names]
    if missing:
        S.unified_schema(list(data.get_fragments()), f"input {cfg.input}", missing)
        raise ValueError(
            f"models.template {template.name!r} writes the input's column(s) {missing}, which input {cfg.input} "
            f"lacks (has {names})"
        )
    taken = [c for c in template.input_columns if c in ROW_COLUMNS]
    if taken:
        raise ValueError(f"models.template {template.name!r}: input column(s) {taken} are names the job gives its rows")
    for c in template.input_columns:
        kind = schema.field(c).type
        history = c in template.histories
        if history and not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            raise ValueError(f"models.template writes {{history:{c}}}, but the input's {c} is {kind}, not a list")
        if not history and not is_text(kind):
            raise ValueError(
                f"models.template writes {{user:{c}}}, but the input's {c} is {kind}: strings, integers, floats or "
                "booleans are written as text"
            )
