"""The nightly job's config: one YAML file plus `--set a.b=value` overrides, validated before anything runs.

Errors name the field (`config: decoding.k must be an integer >= 1, got 0`). Credentials never come from the file:
a key that looks like one is an error; object-store credentials come from the environment (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY) or the cloud's default chain, and are never logged or written to the manifest.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from pathlib import Path

import yaml

from decoding.codes import POLICIES, duplicate_policy
from operators.spec import MODES, TOO_LONG, Decoding
from pipeline import storage as S
from pipeline.storage import Storage

SECRET_WORDS = ("secret", "password", "token", "access_key", "credential")
NOT_SECRETS = ("max_prompt_tokens",)  # fields that hold one of those words and no credential: a count of tokens
DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"  # the embedded default (package data)
DEMO_STEPS = {  # what the demo config reads -> the command that makes it (from any folder, as `make demo` does)
    "input": "genrec-batch prepare --out data/beauty",
    "catalog": "genrec-batch prepare --out data/beauty",
    "target": "genrec-batch train-target --data data/beauty --out models/demo-target --preset demo",
    "draft": "genrec-batch train-draft --data data/beauty --target models/demo-target --out models/demo-draft "
    "--objective atspeed-s --preset demo",
}


@dataclass
class Models:
    target: str = ""  # local directory or s3:// prefix
    draft: str | None = None  # needed by the atspeed modes
    template: str | None = None  # prompt template: a preset (codes, lcrec, minionerec, openonerec) or a JSON file;
    # None: the target's
    cache_dir: str = "~/.cache/genrec-batch/models"  # where s3:// models are copied, once per node


@dataclass
class Compute:
    batch_size: int = 32  # users per shard (one Ray batch: decoded, committed and retried together)
    decode_batch: int | None = None  # users per decode inside a shard; None: on a GPU the largest that fits (from
    # the models' shapes, K, L, the prompt length and free memory; halved on out-of-memory), on a CPU the whole shard
    order_by_length: bool = True  # decode users in order of prompt length: each read task orders its row group's
    # users by history length before they are cut into shards, and each actor its shard's users before cutting decode
    # slices (outputs keep the input order within a shard); false: input order, every prompt left-padded to its
    # shard's longest (docs/engine.md, padding)
    batches_per_task: int = 4  # an actor-pool task decodes this many batches (each its own shard): amortises Ray's
    # per-task cost (~10-20 ms) at the price of a coarser tail; 1 balances best across many actors
    num_actors: int | str | tuple[int, int] = 1  # up to N actors, starting with what fits the cluster; or a range
    # min..max (e.g. 2..16; in Python also a tuple (2, 16), as Ray Data LLM's `concurrency`); or auto: follows the
    # cluster, an actor more where a node joins. Ray Data's autoscaling pool; what fits is every GPU (by
    # gpus_per_actor) and every CPU but one, the read side's (docs/nightly.md, nodes that come and go)
    gpus_per_actor: float = 0.0  # 0: CPU actors
    cpus_per_actor: float = 1.0  # Ray CPUs each actor holds
    threads_per_actor: int | None = None  # torch CPU threads in an actor (None: Ray's OMP_NUM_THREADS = CPUs)
    dtype: str = "auto"  # what the models decode in: float32 is exact (every top-K identical to transformers' float32
    # beam search; on CUDA without TF32); bfloat16 / float16 are fast (half the weight and cache bytes) and keep the
    # logits in float32 (decoding/head.py), but the body's rounding reorders near-ties: their ranking agreement is
    # measured by the precision audit; auto: bfloat16 on a GPU that has it, else float32
    audit_users: int | None = None  # half precision: users each actor re-decodes in float32 per run, to measure the
    # ranking agreement (manifest precision_audit); None: one batch's worth (batch_size); 0: no audit. The float32
    # copies go on the GPU when they fit beside the run, else on the CPU, else the audit is skipped (docs/sizing.md)
    engine: str = "eager"  # eager (the reference) | compiled: beam search on fixed shapes, each actor compiling its
    # bucket at start (decoding/compiled.py; decoding.mode beam, and auto's beam trials; the other modes run eager) |
    # auto: the run's first actor decodes trial users (the input's first) with both engines, and the run keeps the
    # compiled engine only if it agreed (every user clear of a near-tie, the same list; scores within twice what the
    # dtype costs the eager engine against the next wider dtype, measured) on enough clear users and was faster; the
    # decision is recorded in the run (_ENGINE.json) and every actor, restart and resume uses it
    engine_trials: int = 2  # auto: the fewest trial groups (each one decode batch of users) decoded by both engines
    engine_trial_max: int = 8  # auto: the most trial groups; still too few clear users after them: eager
    engine_clear_users: int = 32  # auto: trial users clear of a near-tie needed for a decision (an engine wrong for a
    # share f of users passes unseen with probability (1 - f)^N)
    engine_short_run_s: float = 60.0  # auto: what a cold compile may cost an actor (21-63 s measured on CPUs); a run
    # whose expected eager decode per actor (its share of the users x eager's time per user) is shorter stays eager
    compile_cache: str = "~/.cache/genrec-batch/compile"  # the compiled engine's cache on each node (inductor's
    # TORCHINDUCTOR_CACHE_DIR): kept across actor restarts and runs, so a restarted actor compiles in seconds
    compile_store: str = "none"  # the compiled engine's cache shared through object storage: none (the default);
    # a URI / shared folder; auto: `<models.target>.compile-cache` when the target is on s3://. Archives are signed
    # (HMAC-SHA256, the key in GENREC_COMPILE_STORE_KEY or the file GENREC_COMPILE_STORE_KEY_FILE names): an actor
    # loads only archives signed with its key, and whoever holds the key runs code in every actor (docs/engine.md)


@dataclass
class Runs:
    lease_s: float = 600.0  # S3: the date's lease, renewed every lease_s / 3; a killed run's lease expires after it
    grace_s: float = 7200.0  # superseded runs stay readable this long, then a later publish or --gc deletes them
    progress_s: float = 30.0  # the driver logs users done / total, users/s and an ETA this often
    stall_s: float = 180.0  # no shard committed for this long: the driver logs what it waits for (the pool's actors
    # not alive and their resource demands, the cluster's free resources), again every stall_s
    stall_exit_s: float = 1800.0  # no shard committed for this long: the job stops, exit 5 (lease released); resume
    # it, perhaps with another compute.num_actors
    duplicates_driver_mb: float = 1024.0  # the driver checks user ids for duplicates itself when the id column (with
    # positions and the hash table) takes at most this; above it, a Ray aggregation over the cluster


@dataclass
class Incremental:
    enabled: bool = False  # carry every user whose list's inputs did not change since a base run: its list copied, the
    # rest decoded, the run's fingerprint compared with the base's first (a difference: a full run, the parts named in
    # the manifest). `--incremental` sets it (docs/output.md#incremental-runs)
    base: str | None = None  # the base: a run folder, `<output>/run_date=D` or an output root (its newest published
    # run); None: the newest published run of this output dated on or before run_date
    pin_s: float = 86400.0  # the base is pinned against --gc and the grace deletion while the run reads it; a run
    # that dies keeps the pin this long (a run that ends removes it)
    base_shards_per_task: int = 256  # the base's shards one carry task reads (its index part, then its users that
    # tonight carries, written as one shard): more, fewer and larger tasks


@dataclass
class Serving:
    url: str | None = None  # redis:// or rediss://host:port/db: once a run is published the nightly exports it there
    # behind an atomic version switch (docs/output.md#serving-from-redis); None: no export. The ACL user and password
    # from REDIS_USERNAME and REDIS_PASSWORD, or the URL (the manifest records it without the password)
    namespace: str = "genrec"  # the keys' namespace: readers read {namespace}:current, then the user's key
    keep: int = 2  # previous versions kept for `genrec-batch export --rollback`; older ones are removed
    retry_s: float = 300.0  # transient Redis errors are retried this long, then the export gives up (the nightly: exit
    # 7; `genrec-batch export`: exit 4)
    writers: int = 4  # Ray tasks writing lists at once
    allow_eviction: bool = False  # export into a Redis whose maxmemory-policy may evict keys (else refused)
    allow_no_persistence: bool = False  # export into a Redis with neither RDB snapshots nor appendonly (else refused)
    allow_older: bool = False  # export a run of an earlier date than the one readers are served (else refused)
    grace_s: float = 60.0  # a version removed (beyond `keep`, rolled back, or losing a switch) stays readable this
    # long: its keys expire then, so a reader that read the pointer just before still gets its list. Longer than a
    # reader's two GETs (pointer, then list) with its retries

    @property
    def uri(self) -> str | None:
        """The store, as every sink's section names it (pipeline/stores)."""
        return self.url


@dataclass
class Columns:
    user_id: str = "user_id"  # the input's column holding each user's id (integers, strings or binary)
    history: str = "history"  # the input's column holding each user's history (a list of item ids, oldest first)


@dataclass
class Table:
    uri: str | None = None  # a Delta table (delta+s3://bucket/prefix or delta+/local/path) or an Iceberg table
    # (iceberg+CATALOG/NAMESPACE.TABLE, the catalog as pyiceberg configures it): once a run is published, its
    # recommendations are committed to it, partitioned by run_date, in one commit that replaces the date's rows
    # (docs/output.md#reading-the-lists-as-a-table); None: no table
    rows_per_file: int = 2_000_000  # rows in each data file the commit adds, about (whole shards of the run each):
    # readers open fewer, larger files
    writers: int = 4  # Ray tasks writing the table's files at once


def masked_url(url: str | None) -> str | None:
    """A URL without its secrets (the password, and any query parameter naming one): what logs and manifests show."""
    import urllib.parse

    if not url:
        return url
    u = urllib.parse.urlsplit(url)
    netloc = u.netloc
    if u.password is not None:
        netloc = f"{u.username or ''}:***@{u.hostname}" + (f":{u.port}" if u.port else "")
    secret = re.compile(r"pass|auth|token|secret|key|cred", re.I)
    query = urllib.parse.urlencode(
        [(k, "***" if secret.search(k) else v) for k, v in urllib.parse.parse_qsl(u.query, keep_blank_values=True)],
        safe="*",
    )
    return urllib.parse.urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


@dataclass
class Config:
    input: str = ""  # histories: parquet (file, folder or s3:// URI), a Delta table (delta+s3://bucket/prefix or
    # delta+/local/path) or an Iceberg table (iceberg+CATALOG/NAMESPACE.TABLE, the catalog as pyiceberg configures
    # it), a table read at one version (input_version)
    input_version: int | None = None  # a table input's version (Delta) or snapshot id (Iceberg); None: the newest
    # when the run starts. A resume reads the version its run started on
    columns: Columns = field(default_factory=Columns)  # the input's columns that hold the user id and the history
    catalog: str = ""  # the item index (items.parquet: item_id, semantic_id): every item a history may name,
    # tonight's and every earlier one users still hold; prompts render from it. Only an item it lacks is unknown_item
    recommendable: str | None = None  # the items a list may hold: a parquet of item ids (column item_id; file, folder
    # or s3:// URI), the constraint index's items; ids the catalog lacks are counted. None: every catalog item (or
    # recommendable_column)
    recommendable_column: str | None = None  # or: a boolean column of the catalog, true where a list may hold the item
    # (null: not recommendable)
    blocked: str | None = None  # items no list may hold, for every user and mode: a parquet of item ids (column
    # item_id); ids the catalog lacks are counted, not fatal
    blocked_items: list[int] = field(default_factory=list)  # more item ids no list may hold (with blocked)
    output: str = ""  # output root (local folder or s3://bucket/prefix)
    run_date: str = ""  # exactly YYYY-MM-DD (another spelling of a day, 2026-W48-3 or 20261125, is refused); default:
    # today (UTC). {run_date} in input, catalog, recommendable, blocked and output is filled with it before anything
    # is read
    duplicate_items: str = "first"  # recommendable items sharing a semantic ID: first (the first item in the
    # catalog's order, the rest reported) | error (refuse the catalog) | by:COLUMN (the item with the highest value
    # of a catalog column, e.g. by:popularity; ties: lowest item id) | expand (every item, each its own list entry,
    # lowest item id first; expand:COLUMN: highest value first). Excluded items are skipped per user (docs/data.md)
    models: Models = field(default_factory=Models)
    decoding: Decoding = field(default_factory=Decoding)
    compute: Compute = field(default_factory=Compute)
    storage: Storage = field(default_factory=Storage)
    runs: Runs = field(default_factory=Runs)
    incremental: Incremental = field(default_factory=Incremental)
    serving: Serving = field(default_factory=Serving)
    table: Table = field(default_factory=Table)

    def to_dict(self) -> dict:
        """The config as the manifest and _RUN.json record it: serving.url without its password."""
        out = asdict(self)
        out["serving"]["url"] = masked_url(self.serving.url)
        return out


class Loader(yaml.SafeLoader):
    """YAML as a config is read: safe, and a date or time is its text (run_date is checked as it is written,
    `checked_date`, never as a datetime the parser made of it, or failed to)."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


PROCESSOR_FIELDS = ("columns", "catalog", "recommendable", "recommendable_column", "blocked", "blocked_items")
PROCESSOR_FIELDS += ("duplicate_items", "models", "decoding", "compute", "storage")
# ^ what the processor reads of a config (genrec_batch.build_processor): what to decode, with which models and items,
# and how; where users come from and where their lists go is the user's own pipeline

ProcessorConfig = make_dataclass(
    "ProcessorConfig",
    [
        (f.name, f.type, field(default=f.default, default_factory=f.default_factory))
        for f in fields(Config)
        if f.name in PROCESSOR_FIELDS
    ],
    namespace={
        "__module__": __name__,
        "__doc__": "The processor's config (genrec_batch.build_processor): the nightly config's fields that say what "
        "to decode and how (PROCESSOR_FIELDS), with their names, defaults and meanings (docs/configuration.md).",
    },
)


def processor_config(cfg: Config | ProcessorConfig) -> ProcessorConfig:
    """A processor's config, or a nightly config's processor fields (the rest, the nightly's own, left out) ->
    a validated ProcessorConfig."""
    if isinstance(cfg, Config):
        cfg = ProcessorConfig(**{name: getattr(cfg, name) for name in PROCESSOR_FIELDS})
    if not isinstance(cfg, ProcessorConfig):
        raise TypeError(f"build_processor: config must be a ProcessorConfig (or a nightly Config), got {cfg!r}")
    validate_processor(cfg)
    return cfg


def load_processor_config(path: str | None = None, overrides: list[str] | None = None) -> ProcessorConfig:
    """`load_config`'s YAML file (optional) + overrides -> a validated ProcessorConfig. A nightly config file does:
    the fields the processor does not read (its input, output, runs, ...) are named in a log line and left out."""
    raw = read_raw(path, overrides)
    ignored = sorted(k for k in raw if k not in PROCESSOR_FIELDS and k in {f.name for f in fields(Config)})
    if ignored:
        logging.getLogger("genrec.processor").info(
            "config %s: the processor ignores the nightly's %s", path or "--set", ", ".join(ignored)
        )
    cfg = _build(ProcessorConfig, {k: v for k, v in raw.items() if k not in ignored}, "")
    validate_processor(cfg)
    return cfg


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """YAML file (optional) + `a.b=value` overrides (values parsed as YAML) -> a validated Config."""
    cfg = _build(Config, read_raw(path, overrides), "")
    if not cfg.run_date:
        cfg.run_date = dt.datetime.now(dt.UTC).date().isoformat()
    validate(cfg)
    return fill_dates(cfg)


def read_raw(path: str | None, overrides: list[str] | None) -> dict:
    """A YAML config file (optional) with the `a.b=value` overrides applied (values parsed as YAML) -> its mapping."""
    raw: dict = {}
    if path:
        try:
            raw = yaml.load(read_text(path, overrides or []), Loader=Loader) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {path}: expected a mapping at the top level")
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. decoding.k=20")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {part} is not a section")
        node[parts[-1]] = yaml.load(value, Loader=Loader) if value.strip() else None
    return raw


DATED = ("input", "catalog", "recommendable", "blocked", "output")  # the paths {run_date} is filled in
UNDATED = ("models.target", "models.draft", "models.template", "models.cache_dir", "compute.compile_cache")
UNDATED += ("incremental.base", "table.uri")


def fill_dates(cfg: Config) -> Config:
    """The paths of DATED with {run_date} filled from cfg.run_date. A brace left in one of them after that (another
    placeholder, a lone brace) or any brace in the other paths (UNDATED: nothing is filled there) is an error naming
    it: a path that would be read literally."""
    for name in DATED:
        uri = getattr(cfg, name)
        if uri:
            filled = uri.replace("{run_date}", cfg.run_date)
            _need("{" not in filled and "}" not in filled, name, "may hold the placeholder {run_date} only", uri)
            setattr(cfg, name, filled)
    for name in UNDATED:
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key) or ""
        _need(
            "{" not in value and "}" not in value,
            name,
            f"holds a brace; {{run_date}} is filled only in {', '.join(DATED)}",
            value,
        )
    return cfg


def scheduled_date(job_id: str) -> str:
    """The day a RayCronJob scheduled its RayJob, from the job's submission id (RAY_JOB_SUBMISSION_ID in KubeRay's
    submitter): KubeRay (>= 1.7) names the RayJob `<cron name>-<minutes since the epoch>` and its submission id
    `<RayJob name>-<5 characters>` -> YYYY-MM-DD (UTC). The same for every retry of that RayJob, and for a tick
    caught up after an operator outage."""
    m = re.fullmatch(r".+-(\d{1,12})-[a-z0-9]+", job_id or "")
    when = dt.datetime.fromtimestamp(int(m[1]) * 60, dt.UTC) if m else None
    if when is None or not dt.datetime(2000, 1, 1, tzinfo=dt.UTC) <= when <= dt.datetime.now(dt.UTC) + dt.timedelta(
        days=1
    ):
        raise ValueError(
            f"--run-date-of {job_id!r}: not a RayCronJob's RayJob submission id (<name>-<minutes since the epoch>-"
            "<suffix>, KubeRay >= 1.7, a minute since 2000 and not past tomorrow)"
        )
    return when.date().isoformat()


def checked_date(value: str, what: str) -> str:
    """A run date, exactly YYYY-MM-DD (a day of the calendar) -> itself; any other spelling of a day (ISO's week date
    2026-W48-3 and basic form 20261125, which Python's date.fromisoformat reads too; a time) is refused, ValueError
    naming `what`, the value and that day as it is written: a day names one folder `run_date=D`, one lease, one
    Delta partition and one place in the order of the dates (compared as strings), so it has one spelling."""
    try:
        day = dt.date.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        day = None
    if day is not None and day.isoformat() == value:
        return value
    spelled = f" (that day is written {day.isoformat()})" if day else ""
    raise ValueError(f"{what} must be a date YYYY-MM-DD, got {value!r}{spelled}")


def env_storage() -> Storage:
    """The object store as the environment names it: AWS_ENDPOINT_URL (none: AWS S3) and AWS_REGION."""
    return Storage(
        endpoint=os.environ.get("AWS_ENDPOINT_URL") or None, region=os.environ.get("AWS_REGION", "us-east-1")
    )


def read_text(path: str, overrides: list[str]) -> str:
    """A config file's text: a local path, or an s3:// URI read with the credentials, AWS_ENDPOINT_URL and AWS_REGION
    of the environment (or storage.endpoint / storage.region given with --set) -> its text."""
    if not path.startswith("s3://"):
        if not Path(path).is_file():
            raise ValueError(f"config file {path} not found")
        return Path(path).read_text()
    given = dict(item.split("=", 1) for item in overrides if item.startswith("storage.") and "=" in item)
    env = env_storage()
    storage = Storage(given.get("storage.endpoint") or env.endpoint, given.get("storage.region") or env.region)
    try:
        data = S.read_bytes(path, storage)
    except S.StoreUnavailable:
        raise  # the store is down (the job's exit 4), not the file wrong
    except Exception as e:  # noqa: BLE001 -- credentials refused, no such bucket: the config's error (exit 2)
        raise ValueError(f"config file {path} could not be read from {S.store_name(storage)}: {e}") from None
    if data is None:
        raise ValueError(f"config file {path} not found")
    return data.decode()


def demo_missing(cfg: Config) -> str | None:
    """The first local file or folder of the demo config's own that this run reads and that is missing, with the
    command that makes it; None when all are there. One line, for a user who ran `genrec-batch nightly` with no
    --config. A path changed with --set is left to the run's own checks (they name it)."""
    demo = _build(Config, yaml.load(DEMO_CONFIG.read_text(), Loader=Loader), "")
    reads = {"input": True, "catalog": True, "target": True, "draft": cfg.decoding.uses_draft}
    for name, read in reads.items():
        path = getattr(cfg.models if name in ("target", "draft") else cfg, name)
        own = path == getattr(demo.models if name in ("target", "draft") else demo, name)
        if read and path and own and not Path(path).expanduser().exists():
            return f"the demo config reads {name} {path}, which is missing: run `{DEMO_STEPS[name]}` (or `make demo`)"
    return None


SECTIONS = {
    "models": Models,
    "decoding": Decoding,
    "compute": Compute,
    "storage": Storage,
    "runs": Runs,
    "incremental": Incremental,
    "serving": Serving,
    "columns": Columns,
    "table": Table,
}  # the config's sections, by name


def _build(cls, raw: dict, prefix: str):
    known = {f.name: f for f in fields(cls)}
    for key in raw:
        name = f"{prefix}{key}"
        if key not in NOT_SECRETS and any(w in str(key).lower() for w in SECRET_WORDS):
            raise ValueError(
                f"config: {name} looks like a credential; credentials come from the environment "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or the cloud's default chain, never the file"
            )
        if key not in known:
            raise ValueError(f"config: unknown field {name} (known: {', '.join(sorted(known))})")
    values = {}
    for name, f in known.items():
        if name not in raw:
            continue
        value = raw[name]
        sub = SECTIONS.get(name) if cls in (Config, ProcessorConfig) else None
        if sub is not None:
            if not isinstance(value, dict):
                raise ValueError(f"config: {prefix}{name} must be a section (mapping), got {value!r}")
            values[name] = _build(sub, value, f"{prefix}{name}.")
        else:
            values[name] = _typed(value, f.type, f"{prefix}{name}")
    return cls(**values)


def _typed(value, kind: str, name: str):
    optional = "None" in kind
    if value is None:
        if optional:
            return None
        raise ValueError(f"config: {name} must be set")
    kinds = [k.strip() for k in kind.split("|") if k.strip() != "None"]
    base = "str" if isinstance(value, str) and "str" in kinds else kinds[0]
    if base == "list[int]":
        integers = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        _need(integers, name, "must be a list of integers", value)
        _need(all(-(2**63) <= v < 2**63 for v in value), name, "must hold int64 item ids", value)
        return value
    if isinstance(value, int) and not isinstance(value, bool) and name == "run_date":
        return str(value)  # YAML reads 20261125 as a number: checked as the date spelling it is (`checked_date`)
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
    }[base]
    if not ok:
        kinds = {"float": "a number", "int": "an int", "bool": "true or false", "str": "a string"}
        kind = kinds[base]
        raise ValueError(f"config: {name} must be {kind}, got {value!r}")
    return float(value) if base == "float" else value


def validate(cfg: Config) -> None:
    """Every field checked; the first that is wrong raises ValueError naming it (`config: NAME ..., got VALUE`)."""
    _check_sources(cfg)
    _check_decoding(cfg)
    _check_compute(cfg.compute, cfg.decoding)
    _check_runs(cfg.runs)
    _check_storage(cfg.storage)
    _check_incremental(cfg.incremental)
    check_serving(cfg.serving)
    _check_tables(cfg)


def validate_processor(cfg: ProcessorConfig) -> None:
    """A processor's config checked as the nightly's fields are, and what the processor cannot give refused: the
    precision audit (it has no metrics table to report one in); the first that is wrong raises ValueError naming it."""
    _check_items(cfg)
    _check_decoding(cfg)
    _check_compute(cfg.compute, cfg.decoding)
    _check_storage(cfg.storage)
    _check_columns(cfg)
    audit = cfg.compute.audit_users
    why = "is the nightly's precision audit, which the processor has no metrics table to report: leave it unset"
    _need(not audit, "compute.audit_users", why, audit)


def _need(cond: bool, name: str, what: str, value) -> None:
    if not cond:
        raise ValueError(f"config: {name} {what}, got {value!r}")


def _check_sources(cfg: Config) -> None:
    """What the run reads and writes: the input, catalog and output URIs, the run date, the models."""
    checked_date(cfg.run_date, "config: run_date")
    for name in ("input", "output"):
        uri = getattr(cfg, name)
        _need(bool(uri), name, "must be set (a local path or an s3:// URI)", uri)
        if name == "input":  # parquet, or a table whose source checks its URI (pipeline/stores)
            from pipeline import stores

            why = stores.source(uri).check_uri(uri)
            _need(why is None, name, why, uri)
        else:
            _need("://" not in uri or uri.startswith("s3://"), name, "must be a local path or an s3:// URI", uri)
    _check_items(cfg)


def _check_items(cfg: Config | ProcessorConfig) -> None:
    """What the lists are drawn from and by which model: the catalog, the recommendable set, the block list,
    models.target."""
    for name in ("catalog", "recommendable", "blocked"):
        uri = getattr(cfg, name)
        if uri is None:
            continue
        _need(bool(uri), name, "must be set (a local path or an s3:// URI)", uri)
        _need("://" not in uri or uri.startswith("s3://"), name, "must be a local path or an s3:// URI", uri)
    _need(
        not (cfg.recommendable and cfg.recommendable_column),
        "recommendable_column",
        f"names the recommendable set in the catalog, and recommendable ({cfg.recommendable}) names a file: set one",
        cfg.recommendable_column,
    )
    column = cfg.recommendable_column
    _need(
        column is None or column not in ("", "item_id", "semantic_id"),
        "recommendable_column",
        "must name a boolean column of the catalog",
        column,
    )
    target = cfg.models.target
    _need(bool(target), "models.target", "must be set (a local model directory or s3:// prefix)", target)


ROW_COLUMNS = ("pos", "duplicate", "input_hash", "in_base", "key", "carried", "base_hash", "base_items", "base_scores")
# ^ what the nightly adds to the input rows it reads (pipeline/units.py, pipeline/carry.py)


def _check_decoding(cfg: Config) -> None:
    """decoding.*, the duplicate-item policy and the draft the mode needs."""
    d = cfg.decoding
    _need(d.mode in MODES, "decoding.mode", f"must be one of {', '.join(MODES)}", d.mode)
    try:
        duplicate_policy(cfg.duplicate_items)
    except ValueError:
        _need(False, "duplicate_items", f"must be one of {POLICIES}", cfg.duplicate_items)
    if d.uses_draft:
        _need(bool(cfg.models.draft), "models.draft", f"must be set for decoding.mode {d.mode}", cfg.models.draft)
    for name, value in (
        ("decoding.k", d.k),
        ("decoding.rounds", d.rounds),
        ("decoding.auto_trials", d.auto_trials),
        ("compute.batch_size", cfg.compute.batch_size),
    ):
        _need(value >= 1, name, "must be an integer >= 1", value)
    _check_draft_beams(d)
    _need(d.gamma is None or d.gamma >= 1, "decoding.gamma", "must be >= 1 or null", d.gamma)
    _need(d.history_len is None or d.history_len >= 1, "decoding.history_len", "must be >= 1 or null", d.history_len)
    _need(d.top_m is None or d.top_m >= 1, "decoding.top_m", "must be >= 1 or null", d.top_m)
    _need(d.temperature > 0, "decoding.temperature", "must be > 0", d.temperature)
    _need(d.exclude in ("none", "history"), "decoding.exclude", "must be none or history", d.exclude)
    _need(
        d.max_prompt_tokens is None or d.max_prompt_tokens >= 1,
        "decoding.max_prompt_tokens",
        "must be >= 1 or null",
        d.max_prompt_tokens,
    )
    _need(d.too_long in TOO_LONG, "decoding.too_long", f"must be {' or '.join(TOO_LONG)}", d.too_long)
    _need(
        bool(d.exclude_column) and d.exclude_column not in ("user_id", "history", "target_items", *ROW_COLUMNS),
        "decoding.exclude_column",
        f"must name an input column other than user_id, history, target_items and {', '.join(ROW_COLUMNS)} (the "
        "columns the job adds to the rows it reads)",
        d.exclude_column,
    )


def _check_draft_beams(d: Decoding) -> None:
    _need(
        d.draft_beams is None or d.draft_beams >= d.k,
        "decoding.draft_beams",
        f"must be >= decoding.k ({d.k}) or null",
        d.draft_beams,
    )
    _need(
        d.draft_beams in (None, d.k) or d.mode != "atspeed-relaxed",
        "decoding.draft_beams",
        f"is k ({d.k}) in atspeed-relaxed (each drafted sequence is verified by one of the k draws): leave it unset",
        d.draft_beams,
    )


def actor_range(value) -> tuple[int, int] | None:
    """compute.num_actors as a range with 1 <= min <= max: `min..max` (the config file) or (min, max) (in Python, as
    Ray Data LLM's `concurrency`) -> (min, max); None when it is not one."""
    if isinstance(value, tuple | list) and len(value) == 2:
        integers = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        lo, hi = value if integers else (0, 0)
    else:
        m = re.fullmatch(r"(\d+)\.\.(\d+)", value) if isinstance(value, str) else None
        lo, hi = (int(m[1]), int(m[2])) if m else (0, 0)
    return (lo, hi) if 1 <= lo <= hi else None


def _check_compute(c: Compute, d: Decoding) -> None:
    """compute.* (batch_size is checked with the decoding integers): the actors, their resources, dtype, engine."""
    _need(c.decode_batch is None or c.decode_batch >= 1, "compute.decode_batch", "must be >= 1 or null", c.decode_batch)
    _need(c.batches_per_task >= 1, "compute.batches_per_task", "must be >= 1", c.batches_per_task)
    _need(
        c.num_actors == "auto" or (isinstance(c.num_actors, int) and c.num_actors >= 1) or actor_range(c.num_actors),
        "compute.num_actors",
        "must be an integer >= 1, a range min..max (1 <= min <= max) or auto",
        c.num_actors,
    )
    _need(
        c.gpus_per_actor >= 0 and (c.gpus_per_actor <= 1 or float(c.gpus_per_actor).is_integer()),
        "compute.gpus_per_actor",
        "must be >= 0, a fraction of one GPU (0.25: four actors share a GPU) or a whole number",
        c.gpus_per_actor,
    )
    _need(c.cpus_per_actor > 0, "compute.cpus_per_actor", "must be > 0", c.cpus_per_actor)
    threads = c.threads_per_actor
    _need(threads is None or threads >= 1, "compute.threads_per_actor", "must be >= 1 or null", threads)
    _check_precision(c)
    _check_engine(c, d)


def _check_engine(c: Compute, d: Decoding) -> None:
    """compute.engine and its trials' settings (engine auto)."""
    _need(c.engine in ("eager", "compiled", "auto"), "compute.engine", "must be eager, compiled or auto", c.engine)
    _need(
        isinstance(c.engine_trials, int) and c.engine_trials >= 1,
        "compute.engine_trials",
        "must be >= 1",
        c.engine_trials,
    )
    _need(
        isinstance(c.engine_trial_max, int) and c.engine_trial_max >= c.engine_trials,
        "compute.engine_trial_max",
        f"must be an integer >= compute.engine_trials ({c.engine_trials})",
        c.engine_trial_max,
    )
    _need(
        isinstance(c.engine_clear_users, int) and c.engine_clear_users >= 1,
        "compute.engine_clear_users",
        "must be >= 1",
        c.engine_clear_users,
    )
    _need(
        c.engine != "compiled" or d.mode in ("beam", "auto"),
        "compute.engine",
        f"compiled runs decoding.mode beam (and auto's beam trials); {d.mode} runs eager: set compute.engine=eager",
        c.engine,
    )


def _check_precision(c: Compute) -> None:
    """compute.dtype and the float32 audit of half precision."""
    dtypes = ("auto", "float32", "bfloat16", "float16")
    _need(c.dtype in dtypes, "compute.dtype", "must be auto, float32, bfloat16 or float16", c.dtype)
    _need(
        c.audit_users is None or (isinstance(c.audit_users, int) and c.audit_users >= 0),
        "compute.audit_users",
        "must be an integer >= 0 (0: no audit) or null (one batch's worth)",
        c.audit_users,
    )


def _check_runs(r: Runs) -> None:
    _need(r.lease_s >= 10, "runs.lease_s", "must be >= 10 seconds", r.lease_s)
    _need(r.grace_s >= 0, "runs.grace_s", "must be >= 0 seconds", r.grace_s)
    _need(r.progress_s > 0, "runs.progress_s", "must be > 0 seconds", r.progress_s)
    _need(r.stall_s > 0, "runs.stall_s", "must be > 0 seconds", r.stall_s)
    _need(r.stall_exit_s >= r.stall_s, "runs.stall_exit_s", f"must be >= runs.stall_s ({r.stall_s:g})", r.stall_exit_s)
    _need(
        r.duplicates_driver_mb >= 0,
        "runs.duplicates_driver_mb",
        "must be >= 0 (0: always the Ray aggregation)",
        r.duplicates_driver_mb,
    )


def check_serving(v: Serving) -> None:
    """A serving section that cannot be exported to -> ValueError naming the setting."""
    if v.url is None:
        return
    _check_sink("serving.url", v.url, "serving")
    named = re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", v.namespace) is not None
    _need(named, "serving.namespace", "must be 1 to 64 of A-Z a-z 0-9 _ . -", v.namespace)
    _need(v.keep >= 0, "serving.keep", "must be >= 0", v.keep)
    _need(v.grace_s > 0, "serving.grace_s", "must be > 0 seconds (longer than a reader's two GETs)", v.grace_s)
    _need(v.retry_s >= 0, "serving.retry_s", "must be >= 0 seconds", v.retry_s)
    _need(v.writers >= 1, "serving.writers", "must be >= 1", v.writers)


def _check_sink(name: str, uri: str, section: str) -> None:
    """A URI a config section names a sink by (pipeline/stores SINKS): one of the section's, well formed."""
    from pipeline import stores

    sink = stores.sink(uri)
    if sink is None or sink.SECTION != section:
        kinds = " or ".join(f"{p}..." for p in stores.sinks_of(section))
        _need(False, name, f"must name a store: {kinds}", masked_url(uri))
    why = sink.check_uri(uri)
    _need(why is None, name, why, masked_url(uri))


def _check_tables(cfg: Config) -> None:
    """input_version, columns and table: a version needs a table input, the columns two distinct names, the output
    table a table sink's URI (`check_table`)."""
    from pipeline import stores

    v = cfg.input_version
    versioned = bool(cfg.input) and stores.source(cfg.input).VERSIONED
    _need(v is None or versioned, "input_version", "needs a table input (delta+..., iceberg+...)", v)
    _need(v is None or v >= 0, "input_version", "must be >= 0", v)
    _check_columns(cfg)
    check_table(cfg.table)


def _check_columns(cfg: Config | ProcessorConfig) -> None:
    """columns: two distinct names, neither of them the exclusion column."""
    c = cfg.columns
    for name in ("user_id", "history"):
        _need(bool(getattr(c, name)), f"columns.{name}", "must name an input column", getattr(c, name))
    _need(c.user_id != c.history, "columns.history", f"must differ from columns.user_id ({c.user_id})", c.history)
    column = cfg.decoding.exclude_column
    _need(column not in (c.user_id, c.history), "decoding.exclude_column", "must differ from columns.*", column)


def check_table(t: Table) -> None:
    """A table section that cannot be committed to -> ValueError naming the setting."""
    if t.uri is not None:
        _check_sink("table.uri", t.uri, "table")
    _need(t.rows_per_file >= 1, "table.rows_per_file", "must be >= 1", t.rows_per_file)
    _need(t.writers >= 1, "table.writers", "must be >= 1", t.writers)


def _check_incremental(i: Incremental) -> None:
    _need(i.pin_s > 0, "incremental.pin_s", "must be > 0 seconds", i.pin_s)
    n = i.base_shards_per_task
    _need(n >= 1, "incremental.base_shards_per_task", "must be >= 1", n)


def _check_storage(s: Storage) -> None:
    _need(s.retry_s >= 0, "storage.retry_s", "must be >= 0 seconds (0: no retries)", s.retry_s)
    e = s.endpoint
    _need(e is None or e.startswith(("http://", "https://")), "storage.endpoint", "must be an http(s):// URL", e)
