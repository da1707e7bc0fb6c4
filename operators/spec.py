"""What a recommender actor is told: the decoding settings and the resolved inputs (plain values, no I/O here).

The nightly config embeds `Decoding` as its `decoding` section; the graph builds one `ActorSpec` per run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from decoding.templates import PRESETS, PromptTemplate

MODES = ("beam", "atspeed-strict", "atspeed-relaxed", "disc", "auto")
TOO_LONG = ("drop_oldest", "reject")  # what a prompt longer than decoding.max_prompt_tokens gets


@dataclass
class Decoding:
    """How each user is decoded (the `decoding` section of the nightly config)."""

    mode: str = "beam"  # beam | atspeed-strict | atspeed-relaxed | disc | auto (MODES); auto: beam or atspeed-strict,
    # whichever each actor measures faster
    k: int = 10  # items recommended per user (the top-K)
    draft_beams: int | None = None  # N drafted sequences per step (strict: None = max(40, k); relaxed: always k)
    gamma: int | None = None  # None: the item length
    history_len: int | None = None  # items per prompt (None: the prompt template's max_items)
    temperature: float = 1.0  # atspeed-relaxed and disc
    rounds: int = 4  # disc
    top_m: int | None = None  # disc: None = exact mask, M = PPV over the top-M tokens
    seed: int = 0  # the sampling modes' seed (atspeed-relaxed, disc), mixed with each user's id (decoding/draws.py):
    # a user draws the same items in any batch (reordered, a halved slice, a retried or resumed shard)
    auto_trials: int = 2  # auto: batches decoded with each of beam and atspeed-strict before choosing
    exclude: str = "none"  # none | history: never recommend an item of the user's whole history (every mode, exact)
    exclude_column: str = "exclude_items"  # optional input list<int64> column: more items per user to exclude (either
    # exclude mode; ids the catalog does not hold are ignored and counted; a row that is not a list of ids: rejected)
    max_prompt_tokens: int | None = None  # the most tokens a prompt may hold (None: the model's context,
    # max_position_embeddings, less an item's code tokens and the template's answer tokens)
    too_long: str = "drop_oldest"  # a longer prompt: drop_oldest (its oldest history items dropped until it fits: the
    # histories in the order the prompt writes them, history down to one item, the others to none; still too long:
    # rejected) | reject (rejected as prompt_too_long); either is counted in the manifest

    @property
    def uses_draft(self) -> bool:
        return self.mode.startswith("atspeed") or self.mode == "auto"


@dataclass
class ActorSpec:
    """Everything an actor needs, resolved by the graph before any actor starts."""

    run_id: str
    target: str  # model directory (with its tokenizer): a local path, or a URI that `fetch` turns into one
    catalog: pa.Table  # item_id, semantic_id (and the column on_duplicate orders by): the item index, read once
    catalog_name: str  # for messages
    recommendable: np.ndarray | None = None  # [N] bool over the catalog's rows: the items a list may hold (the
    # recommendable set less the block list); None: every item
    decoding: Decoding = field(default_factory=Decoding)
    template: PromptTemplate = PRESETS["codes"]  # how the model's prompts are written (resolved by the graph)
    on_duplicate: str = "first"  # items sharing a semantic ID: the duplicate_items policy (decoding.codes.POLICIES)
    draft: str | None = None  # the same, atspeed modes
    fetch: Callable[[str, str, str], str] | None = None  # (model URI, its sha256 and files' below) -> its local
    # directory on the actor's node, refused when the model there is not that one (None: local paths, used as they are)
    gpu: bool = False  # decode on CUDA when the actor has one
    decode_batch: int | None = None  # users per decode (None: on CUDA the largest that fits, else the whole shard)
    order_by_length: bool = True  # decode a shard's users in order of prompt length (outputs in the input order)
    dtype: str = "auto"
    audit_users: int = 0  # half precision: the actor's first users re-decoded in float32 (the precision audit)
    threads: int | None = None  # torch CPU threads (None: Ray's OMP_NUM_THREADS)
    engine: str = "eager"  # beam search's engine: eager, compiled (decoding/compiled.py) or auto (AutoEngine)
    engine_trials: int = 2  # auto: the fewest trial groups (one decode batch of users each) decoded by both engines
    engine_trial_max: int = 8  # auto: the most trial groups before an undecided trial stays eager
    engine_clear_users: int = 32  # auto: trial users clear of a near-tie a decision needs
    engine_short_run_s: float = 60.0  # auto: a run with less eager decode per actor ahead than this stays eager
    users_per_actor: int | None = None  # auto: the users this actor may expect (the run's pending / its actors)
    trial_users: pa.Table | None = None  # auto: user_id, history of the trial users (None: the first beam batch's)
    engine_record: object | None = None  # auto: where the run's one decision is recorded (pipeline.runs.EngineRecord)
    compile_cache: str | None = None  # compiled: the node's compile cache directory (None: inductor's default)
    compile_store: object | None = None  # compiled: the cache in object storage (pipeline.models.CompileStore)
    target_sha256: str = ""  # the target's weights as the plan fingerprinted them (its compile cache's key; "": not
    # checked)
    draft_sha256: str = ""  # the draft's, the same
    target_files: str = ""  # the target's other files (config, tokenizer, ...) as the plan fingerprinted them ("": not
    # checked)
    draft_files: str = ""  # the draft's, the same
    warm_users: int = 1  # compiled: users per decode the actor compiles its bucket for at start
