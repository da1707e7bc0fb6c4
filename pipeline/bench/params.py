"""The parameters of every benchmark section, as plain dataclasses (no torch here: the command line reads the
defaults from them before anything heavy is imported)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

REPEATS = 5  # timed repeats per method, interleaved, after one warm-up run of each
SECTIONS = ("decode", "speculative", "disc", "disc-bias")  # what `bench all` runs, in this order
# what `bench gpu` can run; the default, in order of value, as far as --budget-s reaches
GPU_SECTIONS = ("anchor", "qwen", "auto", "parity", "padding", "shapes", "disc", "speculative")
GPU_DEFAULT = ["anchor", "qwen", "auto", "parity", "padding", "shapes"]
GPU_BUDGET_S = 480.0  # infra/gpu/bench.sh's default: a 10-minute device call, with time to start and copy back


@dataclass(kw_only=True)
class Common:
    """Every section: the prepared data, the prompt window, precision, device and seed."""

    data: str  # a prepared data dir (python -m jobs.prepare_data)
    history_len: int = 20
    dtype: str = "auto"
    device: str | None = None  # None: cuda if available, else cpu
    seed: int = 0


@dataclass(kw_only=True)
class Timed(Common):
    """A section that compares methods by wall time: `repeats` interleaved runs of each."""

    repeats: int = REPEATS


@dataclass(kw_only=True)
class ModelParams(Timed):
    """A section on one model: `model` (a local dir), or a random Llama of layers x hidden when None."""

    model: str | None = None
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    attn: str = "sdpa"


@dataclass(kw_only=True)
class DecodeParams(ModelParams):
    users: int = 128
    batch: int = 32
    k: int = 20
    engines: list[str] = field(default_factory=lambda: ["eager"])  # beam_search engines; with compiled: eager vs
    # compiled on the same batches (the compiled engine warmed up on its bucket first, its compile time recorded)
    transformers: bool = True  # transformers beam search vs beam_search (eager)
    index_items: list[int] = field(default_factory=lambda: [10_000_000])  # synthetic catalog sizes
    trie_max_items: int = 10_000_000  # no CPU trie above this size
    top_m: int = 50  # PPV candidates per row


@dataclass(kw_only=True)
class ExcludeParams(ModelParams):
    """`bench exclude`: beam_search without exclusions and with each of `counts` excluded items per user; by default
    the demo's shape (pipeline/configs/demo.yaml: k = 10, batches of 256 users; the demo target when trained)."""

    users: int = 512
    batch: int = 256
    k: int = 10
    counts: list[int] = field(default_factory=lambda: [50, 1000])


@dataclass(kw_only=True)
class PaddingParams(ModelParams):
    """`bench padding`: Beauty users decoded in batches cut in input order and ordered by prompt length; with
    prompt_tokens, every prompt stretched to that many tokens x its share of the longest (a prefill-heavy shape)."""

    users: int = 2048
    batch: int = 256
    k: int = 10
    prompt_tokens: int | None = None


@dataclass(kw_only=True)
class SpeculativeParams(Timed):
    target: str
    drafts: list[str]
    ks: list[int] = field(default_factory=lambda: [1, 3, 5, 10, 20])
    users: int = 20  # users at batch size 1
    batch: int = 64  # the throughput batch size
    throughput_users: int = 128
    draft_beams: int = 40
    gamma: int | None = None
    temperature: float = 1.0
    with_transformers: bool = True  # transformers beam search at batch size 1 too


@dataclass(kw_only=True)
class DiscParams(ModelParams):
    k: int = 10
    users: int = 128
    batch: int = 32
    max_rounds: int = 4  # DISC rounds 1..max_rounds
    top_m: int = 50  # the PPV variant's candidates
    temperature: float = 1.0


@dataclass(kw_only=True)
class DiscBiasParams(Common):
    model: str
    users: int = 4
    draws: int = 2000  # items drawn per user and method (k=1 each)
    batch: int = 500  # draws per batch
    rounds: list[int] = field(default_factory=lambda: [1, 2, 4])
    temperature: float = 1.0
    chunk: int = 1024  # catalog items per forward when scoring P_S


@dataclass(kw_only=True)
class NightlyParams:
    config: str  # the nightly YAML
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE, as `jobs.nightly --set`
    out: str = "bench-out"  # the job writes under OUT/nightly-bench
    cpus: int = 2  # CPUs of the local Ray
    device: str | None = None
    repeats: int = REPEATS


@dataclass
class DelistedParams:
    """`bench delisted`: the nightly of `config` twice with a random `fraction` of the catalog's items delisted:
    taken out of the catalog, and left out of the recommendable set."""

    config: str  # the nightly YAML (default: the demo's)
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE, as `jobs.nightly --set`
    fraction: float = 0.05
    seed: int = 0
    cpus: int = 2  # CPUs of the local Ray
    out: str = "bench-out"


@dataclass
class ScaleParams:
    """`bench nightly-scale`: the nightly job on `users` synthetic users (each size a whole run in its own driver
    process) with a tiny random model, against the recommender called directly on `direct_batches` batches,
    `direct_repeats` times before the job and as many after it."""

    users: list[int] = field(default_factory=lambda: [100_000, 1_000_000])
    k: int = 10
    batch: int = 256
    actors: int = 1
    cpus: int = 2  # CPUs of the local Ray
    items: int = 3000
    history_len: int = 20
    direct_batches: int = 20
    direct_repeats: int = 3
    out: str = "bench-out"


@dataclass
class ProcessorParams:
    """`bench processor`: on `nightly-scale`'s world of each size in `users`, the nightly job and a Ray Data pipeline
    through the processor (read_parquet -> processor -> write_parquet) on the same users and config, each run in its
    own driver process, interleaved `repeats` times: users/s, every user once, the drivers' peak memory."""

    users: list[int] = field(default_factory=lambda: [100_000])
    repeats: int = 3
    k: int = 10
    batch: int = 256
    cpus: int = 2  # CPUs of the local Ray
    out: str = "bench-out"


@dataclass
class ExportParams:
    """`bench export`: a nightly of `users` synthetic users (`nightly-scale`'s world) at each K, exported into a local
    redis-server (append-only file, fsync every second) `repeats` times, each into its own namespace: users/s and
    MB/s of list values, and Redis's memory per user (its used_memory before and after the first export)."""

    users: list[int] = field(default_factory=lambda: [100_000])
    ks: list[int] = field(default_factory=lambda: [10, 50])
    k_users: int = 20_000  # users of the nights at K other than the first (memory per user only)
    repeats: int = 3
    writers: int = 2
    batch: int = 256
    cpus: int = 2  # CPUs of the local Ray
    out: str = "bench-out"


@dataclass
class TableParams:
    """`bench table`: `repeats` nightlies of `users` synthetic users (`nightly-scale`'s world) at K `k`, each
    published run then committed to a fresh local table of each `format` in turn (pipeline/stores: a Delta table,
    an Iceberg table of a SQLite catalog) and re-committed (a no-op: already committed): seconds of the publish step,
    the commit and the re-commit side by side, rows/s, the table's files, the nightly's total; each table read back
    once per size against the run's rows."""

    users: list[int] = field(default_factory=lambda: [1_000_000])
    format: list[str] = field(default_factory=lambda: ["delta", "iceberg"])
    k: int = 10
    repeats: int = 3
    rows_per_file: int = 2_000_000  # table.rows_per_file
    writers: int = 4  # table.writers
    batch: int = 256
    cpus: int = 2  # CPUs of the local Ray
    out: str = "bench-out"


@dataclass
class IncrementalParams:
    """`bench incremental`: for each size of synthetic users (`nightly-scale`'s world) a base night, then for each
    share of users `changed` a full and an incremental night on the same input, interleaved `repeats` times, each in
    its own driver process."""

    users: list[int] = field(default_factory=lambda: [100_000, 1_000_000])
    changed: list[float] = field(default_factory=lambda: [0.0, 0.1, 0.5, 1.0])
    repeats: int = 2
    k: int = 10
    batch: int = 256
    cpus: int = 2  # CPUs of the local Ray
    out: str = "bench-out"


@dataclass(kw_only=True)
class TemplatesParams(Timed):
    """`bench templates`: rendering users/s per CPU core of three prompt shapes (`shapes`: about 300 tokens; about
    2,000 OpenOneRec-like, a chat template around two histories of semantic IDs and a 200-token profile; about 2,000
    with a title on every history item) on `shape_users` synthetic users, against the tokenizer on each user's
    text; then (`beauty`) rendering every Beauty test user with each template, renderer vs tokenizer, and the
    nightly job on `users` users with each template on one random Llama (layers x hidden) over a byte-level BPE of
    about `text_vocab` tokens plus the code tokens, one CPU actor of `cpus` CPUs."""

    shapes: list[str] = field(default_factory=lambda: ["300", "openonerec", "titles"])
    shape_users: int = 1000
    beauty: bool = True
    templates: list[str] = field(default_factory=lambda: ["codes", "lcrec"])
    render_users: int | None = None  # the first N Beauty test users rendered (None: every one)
    users: int = 2000
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    k: int = 10
    batch: int = 256
    text_vocab: int = 4000
    cpus: int = 2
    out: str = "bench-out"  # the jobs write under OUT/templates-bench


@dataclass(kw_only=True)
class ShapesParams:
    """`bench shapes`: every vocabulary x prompt length x K cell, beam_search vs transformers, each method in its own
    process (fresh memory), alternating, `repeats` times. The full grid takes hours on a CPU (transformers at
    prompt 1000 and K = 50 alone runs minutes per repeat): choose cells with --vocabs / --prompts / --ks there."""

    data: str  # a prepared data dir: its catalog's semantic IDs become code tokens after the text vocabulary
    vocabs: list[int] = field(default_factory=lambda: [2048, 33024, 152667])
    prompts: list[int] = field(default_factory=lambda: [81, 300, 1000])
    ks: list[int] = field(default_factory=lambda: [10, 20, 50])
    users: int = 16
    batch: int = 8
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    repeats: int = REPEATS
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    methods: list[str] = field(default_factory=lambda: ["beam_search", "transformers"])  # and beam_search_compiled


@dataclass(kw_only=True)
class ItemsParams:
    """`bench items`: the constraint index over a synthetic catalog of each of `sizes` items (levels x codes) and over
    a recommendable set of a `recommendable` share of them, and what an actor holds for them; each in a fresh
    process, `repeats` times interleaved."""

    sizes: list[int] = field(default_factory=lambda: [100_000, 2_000_000])
    recommendable: float = 0.95
    levels: int = 4
    codes: int = 256
    repeats: int = 3
    out: str = "bench-out"


@dataclass(kw_only=True)
class CompileParams:
    """`bench compile`: the compiled engine's cold compile (an empty inductor cache, a fresh process) at each depth
    of a random Qwen3."""

    layers: list[int] = field(default_factory=lambda: [2, 8, 28])
    hidden: int = 128
    vocab: int = 2048
    items: int = 2000
    users: int = 8
    prompt: int = 40
    k: int = 8
    repeats: int = 1
    decodes: int = 3
    device: str | None = None
    seed: int = 0


@dataclass(kw_only=True)
class GpuParams:
    """`bench gpu`: the matmul rate, the SID-GR anchor, the Qwen2.5-0.5B shape, engine auto, parity and the shapes
    grid on CUDA (DISC, and speculative with --target / --drafts, when named in --sections), in one process, cell by
    cell within --budget-s (pipeline/bench/gpu.py)."""

    data: str
    sections: list[str] = field(default_factory=lambda: list(GPU_DEFAULT))
    target: str | None = None  # a trained target and its drafts for the speculative section (skipped without)
    drafts: list[str] = field(default_factory=list)
    repeats: int = 3  # timed rounds per cell, methods interleaved
    batch: int = 32  # transformers' batch in the shapes grid (halved until it fits)
    simulate_oom: list[str] = field(default_factory=list)  # methods made to run out of memory (tests the recording)
    layers: int = 8
    hidden: int = 1024
    heads: int = 16
    smoke: bool = False  # smoke sizes (runs on a CPU too)
    budget_s: float = GPU_BUDGET_S  # seconds for the cells (compiles included); a cell not reached says so
    plan: bool = False  # print each cell's expected seconds on an H100 instead of running (no GPU needed)
    engines: list[str] = field(default_factory=lambda: ["eager"])  # beam_search engines (eager, compiled)
    device: str | None = None
    seed: int = 0
    out: str = "bench-out"
    page: str | None = None  # also keep the report as a dated page in this folder, gpu-<device>-<date>.md (make
    # bench-gpu: docs/benchmarks), its provenance (date, device, versions, commit, command) on top


@dataclass(kw_only=True)
class AllParams(Timed):
    """`bench all`: every section on one target (and its drafts). The defaults: decode 64 users (batch 32, K=20; the
    index on Beauty and a 1M-item synthetic catalog, 640 prefixes per step), speculative 10 users at batch 1 and 64 at
    batch 32 for K in 1 3 5 10 20, DISC 64 users (batch 32, k=10, rounds 1..4), disc-bias 4 users x 2000 draws;
    every timing 5 interleaved repeats after a warm-up run. With the demo models on 2 CPU cores: about 3 minutes on
    a quiet machine, up to about 2x that on a busy one."""

    target: str
    drafts: list[str]
    sections: list[str] = field(default_factory=lambda: list(SECTIONS))
    users: int = 64  # decode, disc and the speculative throughput batch
    batch: int = 32  # batch size of decode, disc and speculative
    k: int = 20  # K of decode
    index_items: list[int] = field(default_factory=lambda: [1_000_000])
    ks: list[int] = field(default_factory=lambda: [1, 3, 5, 10, 20])  # speculative K (the Table 1 columns)
    batch1_users: int = 10  # speculative users at batch size 1
    disc_k: int = 10  # items per user of the disc timing
    rounds: list[int] = field(default_factory=lambda: [1, 2, 4])  # disc-bias rounds; the disc timing runs 1..max
    bias_users: int = 4
    draws: int = 2000
    temperature: float = 1.0
    chunk: int = 1024


@dataclass(kw_only=True)
class PrecisionParams:
    """`bench precision`: beam_search in each dtype (half precision with the float32 head as shipped, and with
    logits rounded to the model's dtype as transformers computes them) against transformers beam search in float32,
    on a trained target and real users: identical top-K lists, among users clear of a near-tie, top-K set overlap,
    largest score difference."""

    data: str
    target: str
    users: int = 2048
    batch: int = 64
    history_len: int = 20
    device: str | None = None
    ks: list[int] = field(default_factory=lambda: [10, 20])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16", "float16"])
    tie: float = 0.04  # a user is clear of a near-tie when its float32 search's tie gap is at least this


@dataclass(kw_only=True)
class MiniOneRecParams:
    """`bench minionerec`: MiniOneRec's own evaluation (their evaluate.py, imported at run time from `peer`, a copy of
    github AkaliKong/MiniOneRec with its requirements installed) beside beam_search with the minionerec template, on
    the same model and the first `users` rows of their `category`'s test CSV: at their settings (batch 4, 50 beams)
    and at `batch`. `model`: a model dir trained there (None: a random tiny Qwen2 over a Qwen-style tokenizer with the
    category's code tokens, for speed, not quality)."""

    peer: str
    category: str = "Office_Products"
    model: str | None = None
    users: int = 64
    their_batch: int = 4
    beams: int = 50
    batch: int = 64
    dtype: str = "float32"
    device: str | None = None
    seed: int = 0
    repeats: int = 3
    out: str = "bench-out"  # the imported data, the rows compared, their results and the random model go under it


# The command line's view of these fields (jobs/bench.py): help texts, choices, and the fields that take several values
FLAG_HELP = {
    "data": "prepared data (python -m jobs.prepare_data)",
    "device": "cpu or cuda (None: cuda if available)",
    "repeats": "timed runs of each method, interleaved, after one warm-up run each (fewer than 5: smoke tests only)",
    "model": "local model dir (None: a random Llama of --layers x --hidden)",
    "drafts": "draft model dirs (default: models/demo-draft*)",
    "index_items": "synthetic catalog sizes (index)",
    "trie_max_items": "no CPU trie above this size",
    "users": "users (speculative: at batch size 1; all: of decode, disc and the speculative throughput batch)",
    "rounds": "DISC rounds (disc-bias; the disc timing runs 1..max)",
    "chunk": "disc-bias: catalog items per forward when scoring P_S (lower it for large vocabularies)",
    "draws": "items drawn per user and method (k=1 each)",
    "cpus": "CPUs of the local Ray",
    "out": "results folder (the nightly job writes under OUT/nightly-bench)",
    "ks": "speculative K (Table 1 columns)",
    "simulate_oom": "methods made to run out of memory at every batch (checks that the report records it)",
    "dtypes": "engine dtypes to compare with transformers in float32",
    "tie": "near-tie threshold on the float32 search's tie gap",
    "counts": "excluded items per user (each against none)",
    "engines": "beam_search engines (decoding/compiled.py): with compiled, eager vs compiled side by side",
    "methods": "shapes: the methods compared (beam_search is the eager engine)",
    "peer": "minionerec: a copy of github AkaliKong/MiniOneRec (its evaluate.py is imported from there)",
    "category": "minionerec: the category of the peer's data/Amazon to compare on",
    "their_batch": "minionerec: users per generate call in their evaluate.py (theirs: 4)",
    "beams": "minionerec: beams, and items returned per user (theirs: 50)",
    "page": "gpu: also keep the report as a dated page in this folder, gpu-<device>-<date>.md (docs/benchmarks)",
    "budget_s": "gpu: seconds for the cells, compiles included (the report is rewritten after every cell)",
    "plan": "gpu: each cell's expected seconds on an H100 (FLOPs and the matmul rate), without running anything",
    "format": "table: the table formats each night's run is committed to, in turn",
}
CHOICES = {
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "dtypes": ["float32", "bfloat16", "float16"],
    "attn": ["sdpa", "eager"],
    "sections": SECTIONS,
    "templates": ["codes", "lcrec"],
    "shapes": ["300", "openonerec", "titles"],
    "simulate_oom": ["beam_search", "transformers"],
    "engines": ["eager", "compiled"],
    "methods": ["beam_search", "beam_search_compiled", "transformers"],
    "format": ["delta", "iceberg"],
}
LISTS = (
    "sections",
    "templates",
    "shapes",
    "simulate_oom",
    "dtypes",
    "engines",
    "methods",
    "format",
)  # flags that take several values


def field_defaults(cls) -> dict:
    """The dataclass's field defaults (a subparser's defaults)."""
    return {
        f.name: f.default_factory() if f.default_factory is not MISSING else f.default
        for f in fields(cls)
        if f.default is not MISSING or f.default_factory is not MISSING
    }
