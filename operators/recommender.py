"""The Ray Data recommender actor: loads target, draft and catalog once; `__call__(batch)` is pure.

The graph (pipeline/nightly.py) resolves everything first and hands the actor an `ActorSpec` of plain values: local
model directories, the catalog table it read once, the decoding settings. Output rows carry a `kind`: "rec"
(user_id, rank, item_id, score, mode), "reject" (user_id, reason, detail) or "metric" (one per batch, JSON in
`metrics`), so that one map over the users yields all three tables; `TABLES` names each table's columns.

`__call__` validates, renders, decodes (`Decoded`: one batch's items, scores, stats and audit) and hands the rest to
pure functions of plain arrays: `recommendation_table`, `non_finite_rejects`, `batch_counts`, `decoder_metrics` and
`output_table`, which tags each row with its kind.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from decoding.beam import Prefix, Recommendations, beam_search
from decoding.catalog import Catalog, Exclusions
from decoding.compiled import (
    Bucket,
    Engine,
    cold_compiles,
    compile_key,
    compile_totals,
    device_tag,
    unsupported,
    use_compile_cache,
    warm_up,
)
from decoding.disc import disc_sample
from decoding.draws import UserDraws, user_seeds
from decoding.memory import (
    audit_placement,
    decode_bytes_per_user,
    fit_batch,
    free_device_memory,
    host_free_memory,
    trim_host_heap,
    usable_bytes,
)
from decoding.metrics import same_within_ties, topk_agreement
from decoding.models import check_window, load_config, load_model, load_tokenizer
from decoding.speculative import speculative_beam_search
from decoding.stats import BASE_KEYS, PHASES
from operators.compile_cache import private_dirs
from operators.prompts import Prompts, Renderer, catalog_probes, excluded_items
from operators.spec import ActorSpec
from operators.validate import reject_schema, validate

FAIL_AFTER_ENV = "GENREC_TEST_FAIL_AFTER"  # tests only: "N:/path/marker" exits the actor once, after N batches
SKEW_ENV = "GENREC_TEST_ENGINE_SKEW"  # tests only: "1" makes the compiled engine's trial lists differ from eager's
COMPILED_EXTRAS = {  # the compiled engine's extra stats, set on an eager fallback too (so that slices concatenate)
    "engine": "eager",
    "engine_note": "",
    "bucket_users": 0,
    "bucket_prompt": 0,
    "compile_s": 0.0,
    "graphs_compiled": 0,
}
log = logging.getLogger("genrec.actor")
SAMPLING = ("atspeed-relaxed", "disc")  # modes whose items are draws (per user: decoding/draws.py)
NON_FINITE = (
    "the model's log-probabilities were NaN or infinite while decoding this user (e.g. a float16 "
    "overflow); its items would not be the model's"
)
NO_ITEMS = "no item is left to this user: every item a list may hold (recommendable, not blocked) is excluded for it"
TABLES = {
    "rec": ["user_id", "rank", "item_id", "score", "mode"],
    "reject": ["user_id", "reason", "detail"],
    "metric": ["metrics"],
}  # the published tables' columns, by output kind


def output_schema(user_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("kind", pa.string()),
            ("user_id", user_type),
            ("rank", pa.int32()),
            ("item_id", pa.int64()),
            ("score", pa.float32()),
            ("mode", pa.string()),
            ("reason", pa.string()),
            ("detail", pa.string()),
            ("metrics", pa.string()),
        ]
    )


def table_schema(kind: str, user_type: pa.DataType) -> pa.Schema:
    """The schema of one published table (TABLES[kind]'s columns of the output schema)."""
    schema = output_schema(user_type)
    return pa.schema([schema.field(n) for n in TABLES[kind]])


@dataclass
class Decoded:
    """One batch's decode, what its output rows are made from (rows: the validated users, U)."""

    mode: str  # the decoder that ran (decoding.mode = auto: the one whose turn it was)
    items: np.ndarray  # [U, k] int64, -1 where there is no item (a small catalog; a user with non-finite log-probs)
    scores: np.ndarray  # [U, k] float32, the target model's sequence log-probabilities
    broken: np.ndarray  # [U] bool: NaN / inf log-probabilities while decoding (rejected, never a short list)
    stats: dict  # the decoder's stats (decoding/stats.py); BASE_KEYS at 0 when no user was decoded
    audit: dict  # the precision audit's metrics (audit_*), {} when no user of the batch was audited

    @classmethod
    def empty(cls, mode: str, k: int) -> Decoded:
        """A batch without a valid row: nothing decoded."""
        none = np.zeros((0, k), np.int64), np.zeros((0, k), np.float32), np.zeros(0, bool)
        return cls(mode, *none, dict.fromkeys(BASE_KEYS, 0), {})

    def unsort(self, order: np.ndarray) -> Decoded:
        """Rows decoded in `order` [U] (row i is input row order[i]) -> the rows in input order."""
        back = np.argsort(order)
        return Decoded(self.mode, self.items[back], self.scores[back], self.broken[back], self.stats, self.audit)


def length_order(mask: torch.Tensor, users) -> np.ndarray:
    """Prompts' attention mask [U, S] and user ids [U] -> the rows by prompt length, then user id [U]: the same
    decode order for any permutation of the same users."""
    key = pa.table({"length": pa.array(mask.sum(1).cpu().numpy()), "user": users})
    return pc.sort_indices(key, sort_keys=[("length", "ascending"), ("user", "ascending")]).to_numpy().astype(np.int64)


def trim_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts ids, mask [U, S] -> without the leading columns that no user of them needs [U, S']."""
    used = mask.any(0).nonzero()
    first = int(used[0]) if len(used) else 0
    return ids[:, first:], mask[:, first:]


def padding_metrics(stats: dict) -> dict:
    """A decode's prompt positions (the prefills' users x columns over every slice, the shared prefix left out),
    those that were left padding, their fraction, and the KV tokens of left padding held at the peak."""
    positions, padding = int(stats.get("prompt_positions", 0)), int(stats.get("prompt_padding", 0))
    return {
        "prompt_positions": positions,
        "prompt_padding": padding,
        "prompt_padding_fraction": padding / positions if positions else None,
        "kv_padding_tokens": int(stats.get("kv_padding_tokens", 0)),
    }


def recommendation_table(users: pa.Array, items: np.ndarray, scores: np.ndarray, mode: str) -> pa.Table:
    """users [U], items [U, k] (-1: no item), scores [U, k] -> the recommendations (TABLES["rec"]), one row per
    item, users in order and ranks 1.. within each."""
    row, rank = np.nonzero(items >= 0)  # fewer than k only when the catalog has fewer items
    return pa.table(
        {
            "user_id": users.take(pa.array(row, pa.int64())),
            "rank": pa.array((rank + 1).astype(np.int32)),
            "item_id": pa.array(items[row, rank]),
            "score": pa.array(scores[row, rank].astype(np.float32)),
            "mode": pa.array(np.full(len(row), mode, object), pa.string()),
        }
    )


def non_finite_rejects(users: pa.Array, broken: np.ndarray) -> pa.Table:
    """users [U], broken [U] bool -> the rejects (TABLES["reject"]) of the users whose log-probabilities were not
    finite while decoding."""
    return _rejects(users, broken, "non_finite_logits", NON_FINITE)


def no_items_rejects(users: pa.Array, items: np.ndarray, broken: np.ndarray) -> pa.Table:
    """users [U], items [U, k] (-1: none), broken [U] -> the rejects of the users left with no item at all (every
    item a list may hold is excluded for them), who are not broken."""
    return _rejects(users, ~broken & (items < 0).all(1), "no_items", NO_ITEMS)


def _rejects(users: pa.Array, rows: np.ndarray, reason: str, detail: str) -> pa.Table:
    """users [U], rows [U] bool -> the rejects of those rows, each with `reason` and `detail`."""
    n = int(rows.sum())
    return pa.table(
        [users.filter(pa.array(rows)), pa.array([reason] * n, pa.string()), pa.array([detail] * n, pa.string())],
        schema=reject_schema(users.type),
    )


def output_table(recs: pa.Table, rejects: pa.Table, metric: dict, user_type: pa.DataType) -> pa.Table:
    """The batch's recommendations, rejects and metric row (JSON in `metrics`) as one table of the output schema,
    each row tagged with its `kind`."""
    schema = output_schema(user_type)
    tagged = [
        t.add_column(0, "kind", pa.array([kind] * t.num_rows, pa.string()))
        for t, kind in ((recs, "rec"), (rejects, "reject"))
    ]
    metrics = pa.table({"kind": ["metric"], "metrics": [json.dumps(metric)]})
    return pa.concat_tables([*tagged, metrics], promote_options="permissive").select(schema.names).cast(schema)


def batch_counts(
    users_in: int,
    items: np.ndarray,
    broken: np.ndarray,
    rejected: int,
    recommendations: int,
    prompts: Prompts,
    prefix_len: int,
) -> dict:
    """A batch's counts: its rows, the validated users (items [U, k], -1: none; broken [U]) that got a list and
    those whose list is shorter than k (fewer items left to them), rejects, items, and the prompt tokens (those
    rendered, prompts [U, S], plus the shared prefix each user's prefill skipped)."""
    users = len(broken)
    got = (items >= 0).sum(1)  # [U] items each user got
    listed = ~broken & (got > 0)  # [U]
    return {
        "users_in": users_in,
        "users_ok": int(listed.sum()),
        "users_short": int((listed & (got < items.shape[1])).sum()),
        "users_rejected": rejected,
        "recommendations": recommendations,
        "prompt_tokens": int(prompts.attention_mask.sum()) + prefix_len * users,
        "prefix_tokens_saved": prefix_len * users,
    }


def decoder_metrics(stats: dict, wall: float) -> dict:
    """A decoder's stats and the batch's wall time -> metric values: wall_s, the base stats (decoding/stats.py),
    other_s = the wall time outside the decoder (validation, prompts, output rows), and the speculative extras (mean
    accepted steps per round and their histogram; None for the other decoders)."""
    base = {key: float(stats[key]) if key in PHASES else int(stats[key]) for key in BASE_KEYS}
    accepted, rounds, hist = stats.get("accepted_steps"), stats.get("rounds"), stats.get("accepted_hist")  # [U], [U]
    mean = accepted is not None and len(accepted)
    return {
        "wall_s": wall,
        **base,
        "other_s": max(wall - sum(base[p] for p in PHASES), 0.0),
        "mean_accepted_steps": float((accepted.float() / rounds.clamp(min=1).float()).mean()) if mean else None,
        "accepted_hist": hist.tolist() if hist is not None else None,
    }


@dataclass
class Inputs:
    """What an actor builds from its spec before any weight is loaded; each step refuses bad input, naming it."""

    target: str  # local model directories
    draft: str | None
    tokenizer: object
    catalog: Catalog  # index + item-to-tokens map, every code token checked against the tokenizer
    renderer: Renderer  # the prompt template compiled against the tokenizer


def prepare(spec: ActorSpec, device: torch.device | str = "cpu") -> Inputs:
    """Fetches the model directories, checks the models (causal LMs; a sliding window covering the longest prompt
    plus an item; one vocabulary for target and draft), parses the catalog with the template's code-token names and
    compiles the template. The graph calls it on the driver first: what an actor would refuse fails before any work."""
    fetch = spec.fetch or str  # models on object storage: copied once per node by the graph's fetch
    target = fetch(spec.target)
    draft = fetch(spec.draft) if spec.decoding.uses_draft else None
    tokenizer = load_tokenizer(target)
    catalog = Catalog.from_table(
        spec.catalog,
        tokenizer,
        on_duplicate=spec.on_duplicate,
        device=device,
        source=spec.catalog_name,
        code_token=spec.template.code,
        recommendable=spec.recommendable,
    )
    renderer = Renderer.compile(
        spec.template.with_max_items(spec.decoding.history_len), tokenizer, catalog_probes(catalog.item_tokens)
    )
    if len(renderer.answer) and spec.decoding.mode != "beam":
        raise ValueError(
            f"prompt template {renderer.template.name!r} scores the tokens after an item's codes (answer_suffix "
            f"{renderer.template.answer_suffix!r}, answer_eos {renderer.template.answer_eos}), which beam search does: "
            f"set decoding.mode to beam (it is {spec.decoding.mode})"
        )
    vocab = {}
    for role, path in (("target", target), ("draft", draft)):
        if path is not None:
            config = load_config(path)
            check_window(config, renderer.max_len + catalog.code_len, f"models.{role} {path}")
            vocab[role] = config.vocab_size
    if len(set(vocab.values())) > 1:
        raise ValueError(
            f"models.draft {draft}: vocabulary of {vocab['draft']} tokens, the target's has "
            f"{vocab['target']}: a draft must share its target's tokenizer"
        )
    return Inputs(target, draft, tokenizer, catalog, renderer)


class AutoMode:
    """decoding.mode = auto: the first batches alternate between beam search and strict speculative decoding (their
    outputs are identical) in the order A B B A ..., `trials` batches each; then the decoder with the lower time per
    user (the better of its trials, so that a cold first call does not decide) decodes every later batch."""

    CHOICES = ("beam", "atspeed-strict")

    def __init__(self, trials: int):
        self.plan = [self.CHOICES[(i + 1) // 2 % 2] for i in range(2 * trials)]  # beam, strict, strict, beam, ...
        self.per_user = {m: [] for m in self.CHOICES}  # decoder seconds per user of every trial batch
        self.choice: str | None = None

    def next(self) -> str:
        done = sum(map(len, self.per_user.values()))
        return self.choice or self.plan[done]

    def record(self, mode: str, seconds: float, users: int) -> None:
        if self.choice is None and users:
            self.per_user[mode].append(seconds / users)
            if sum(map(len, self.per_user.values())) == len(self.plan):
                self.choice = min(self.CHOICES, key=lambda m: min(self.per_user[m]))

    def state(self) -> dict:
        best = {m: 1 / min(v) if v else None for m, v in self.per_user.items()}
        return {
            "choice": self.choice,
            "trial_users_per_s": best,
            "trial_batches": {m: len(v) for m, v in self.per_user.items()},
        }


EPS32 = torch.finfo(torch.float32).eps


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose eager decode measures what `dtype` costs: float32 for half precision, float64 for float32."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def dtype_noise(eager: Recommendations, reference: Recommendations) -> float:
    """What the run's dtype costs the eager engine on these users: the largest |score difference| of an item both the
    eager lists [U, k] and the reference dtype's lists hold (0 if none)."""
    diff = topk_agreement(reference.item_ids, reference.scores, eager.item_ids, eager.scores)["score_diff"]  # [U]
    return float(diff.max()) if diff.numel() else 0.0


def engine_parity(eager: Recommendations, compiled: Recommendations, noise: float) -> dict:
    """The compiled engine's lists and scores against the eager engine's on the same trial users [U, k] -> the
    evidence. Both engines round the same exact scores in one dtype, each about as much as that dtype costs the eager
    engine (`noise`, measured against the next wider dtype on these users), so their scores may differ by the bound
    2 x noise (floored at the float32 spacing of the scores, what they are returned in). A user is clear of a
    near-tie when its eager tie gap exceeds twice the bound; a clear user must get the same list up to swaps of items
    whose eager scores are within twice the bound. Parity holds when every clear user does, every score is within the
    bound and the same scores are finite."""
    s_e, s_c = eager.scores.float().cpu(), compiled.scores.float().cpu()  # [U, k]
    finite = torch.isfinite(s_e)
    magnitude = float(s_e[finite].abs().max()) if finite.any() else 1.0
    bound = max(2 * noise, EPS32 * magnitude)
    both = finite & torch.isfinite(s_c)
    max_diff = float((s_e - s_c).abs()[both].max()) if both.any() else 0.0
    clear = eager.stats["tie_gap"].float().cpu() > 2 * bound  # [U]
    same = same_within_ties(eager.item_ids.cpu(), s_e, compiled.item_ids.cpu(), 2 * bound)  # [U]
    holds = bool(same[clear].all()) and max_diff <= bound and torch.equal(finite, torch.isfinite(s_c))
    return {
        "users": int(same.numel()),
        "clear": int(clear.sum()),
        "identical_clear": int(same[clear].sum()),
        "identical": int((eager.item_ids.cpu() == compiled.item_ids.cpu()).all(1).sum()),
        "max_score_diff": max_diff,
        "noise": noise,
        "bound": bound,
        "holds": holds,
    }


class AutoEngine:
    """compute.engine = auto: one decision per run. Unless the run has one recorded (`adopt`), the actor decodes trial
    groups (one decode batch of trial users each) with both engines in turn (eager first, then compiled first, ...)
    and, in the reference dtype, measures what the run's dtype costs (`dtype_noise`); after each group the pooled
    evidence (`engine_parity`) decides: no parity -> eager; at least `min_groups` groups and `need` users clear of a
    near-tie -> compiled if its best group decoded faster per user than eager's best, else eager; `max_groups` groups
    (or no trial users left) without enough clear users -> eager, inconclusive. A run too short to earn a compile
    back (users_hint x eager's time per user < short_run_s, after the first group) stays eager without compiling;
    so does a run with per-user exclusions (the compiled engine decodes them eager), decided before any trial.

    A decision holds for one setting (`setting`: dtype, device and its capability or CPU kernel family, torch, k),
    recorded with it and with each bucket it checked; an actor in another setting adopts only "eager" (engine_note
    says why). An outcome of this actor's own making (its trials ran out of memory, its compile failed, the
    reference copy does not fit) is `local`: the actor decodes eager, and the run's decision is left to others."""

    def __init__(self, spec: ActorSpec, device: str, setting: dict):
        self.min_groups, self.max_groups, self.need = spec.engine_trials, spec.engine_trial_max, spec.engine_clear_users
        self.users_hint, self.short_run_s, self.device = spec.users_per_actor, spec.engine_short_run_s, device
        self.per_user: dict[str, list[float]] = {"eager": [], "compiled": []}  # decode seconds per user, each group
        self.groups: list[tuple[Recommendations, Recommendations, float]] = []  # (eager, compiled, noise) per group
        self.parity: dict | None = None  # the pooled evidence so far
        self.checked: set[tuple[int, int]] = set()  # the compiled engine's buckets (users, prompt) the trials ran in
        self.compile_s = 0.0
        self.choice: str | None = None
        self.reason = ""
        self.decided_by: str | None = None  # the actor whose trials decided the run
        self.setting = setting  # what the decision holds for: dtype, device, capability or CPU family, torch, k
        self.local = False  # the choice is this actor's alone (an out-of-memory or compile error): never recorded
        self.note = ""  # why this actor decodes otherwise than the run's recorded decision says

    def order(self) -> tuple[str, str]:
        return ("eager", "compiled") if len(self.groups) % 2 == 0 else ("compiled", "eager")

    def decide(self, choice: str, reason: str, local: bool = False) -> None:
        self.choice, self.reason, self.local = choice, reason, local

    def too_short(self, eager_per_user: float) -> bool:
        """After the first eager group: can this actor's share of the run earn a compile back? If not, eager."""
        expected = (self.users_hint or 0) * eager_per_user
        if self.users_hint is not None and expected < self.short_run_s:
            self.per_user["eager"].append(eager_per_user)
            self.decide(
                "eager",
                f"too short to earn a compile back: {self.users_hint} users x {eager_per_user * 1e3:.1f} ms "
                f"= {expected:.0f} s of eager decode < compute.engine_short_run_s {self.short_run_s:g} s",
            )
        return self.choice is not None

    def record(self, eager: Recommendations, compiled: Recommendations, noise: float, seconds: tuple) -> None:
        """One trial group's results (eager's and compiled's per-user seconds) -> the pooled evidence; decides when it
        can."""
        self.per_user["eager"].append(seconds[0])
        self.per_user["compiled"].append(seconds[1])
        self.groups.append((eager, compiled, noise))
        e, c = (Recommendations.concat([g[i] for g in self.groups]) for i in (0, 1))
        p = self.parity = engine_parity(e, c, max(g[2] for g in self.groups))
        fast_e, fast_c = min(self.per_user["eager"]), min(self.per_user["compiled"])
        if not p["holds"]:
            self.decide("eager", f"no parity on the trial users: {p}")
        elif len(self.groups) >= self.min_groups and p["clear"] >= self.need:
            faster = fast_c < fast_e
            self.decide(
                "compiled" if faster else "eager",
                f"parity held on {p['clear']} users clear of a near-tie; compiled ran at {fast_e / fast_c:.2f}x "
                f"eager's users/s" + ("" if faster else ", not faster"),
            )
        elif len(self.groups) >= self.max_groups:
            self.inconclusive()

    def inconclusive(self) -> None:
        clear, users = (self.parity["clear"], self.parity["users"]) if self.parity else (0, 0)
        self.decide(
            "eager",
            f"inconclusive: {clear} of {users} trial users clear of a near-tie, compute.engine_clear_users "
            f"{self.need} needed",
        )

    def decision(self, actor: str) -> dict:
        """What the run records (pipeline.runs.EngineRecord) and every actor adopts."""
        return {**self.state(), "decided_by": actor, "at": time.time()}

    def adopt(self, record: dict) -> None:
        """The run's recorded decision, made by this actor's trials or another's: "compiled" only in the setting it
        was made in, and only in the buckets it checked in that setting; elsewhere eager, with a note."""
        self.choice, self.reason, self.decided_by = record["choice"], record["reason"], record["decided_by"]
        theirs = record.get("setting")
        ours = [b for b in record["checked"] if isinstance(b, dict) and b.get("setting") == self.setting]
        self.checked = {(int(b["users"]), int(b["prompt"])) for b in ours}
        self.parity = (record["parity"] or [None])[0]
        if self.choice == "compiled" and theirs != self.setting:
            self.choice, self.checked = "eager", set()
            self.note = f"the run's decision (compiled) was made for {theirs}; this actor runs {self.setting}: eager"

    def state(self) -> dict:
        return {
            "choice": self.choice,
            "reason": self.reason,
            "decided_by": self.decided_by,
            "trial_users_per_s": {m: 1 / min(v) if v else None for m, v in self.per_user.items()},
            "trial_batches": len(self.groups),
            "compile_s": self.compile_s,
            "parity": [self.parity] if self.parity else [],
            "checked": [{"users": u, "prompt": p, "setting": self.setting} for u, p in sorted(self.checked)],
            "device": self.device,
            "setting": self.setting,
            "local": self.local,
        }


class Recommender:
    def __init__(self, spec: ActorSpec):
        self.spec = spec
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.device = torch.device("cuda" if spec.gpu and torch.cuda.is_available() else "cpu")
        self._load(spec)
        self.spec = spec = replace(spec, catalog=None, recommendable=None)  # parsed into self.catalog: not kept twice
        pa.default_memory_pool().release_unused()
        trim_host_heap()  # the index build's temporaries, freed, leave the process
        # the precision audit: this many of the actor's first users re-decoded in float32 (half precision only)
        self.audit_left = spec.audit_users if self.target.dtype != torch.float32 else 0
        self.float32: dict = {}  # the audit's float32 models, loaded on first use, freed when the audit is done
        self.on_cpu: tuple | None = None  # (catalog, answer) on the CPU, for float32 copies that did not fit the GPU
        self.audit_where = "cpu"  # where the float32 copies went: gpu (beside the run) or cpu
        self.auto = AutoMode(spec.decoding.auto_trials) if spec.decoding.mode == "auto" else None
        self._engines(spec)
        self.actor = _actor_id()
        self.host = socket.gethostname()
        self.accelerator = f"{self.host}/{_device_id(self.device)}"  # actors that share a GPU share this
        self.batches = 0
        self.decode_batch, self.oom_batch = 0, None  # users per decode of the last shard; the halved batch after an OOM
        self.compiled = (0.0, 0)  # compile seconds and graphs reported in metric rows so far
        if spec.engine == "compiled" and spec.decoding.mode in ("beam", "auto"):
            self._warm_up()
        self.ready_at = time.time()  # ready to decode: process started, modules imported, models loaded, compiled

    @property
    def prefix_len(self) -> int:
        """Tokens of the template's fixed prefix: prefilled once per model, left out of every rendered prompt."""
        return len(self.prefix) if self.prefix is not None else 0

    def _warm_shape(self) -> tuple[int, int]:
        """The users and prompt tokens the actor compiles its bucket for: its decode batch x the longest prompt."""
        prompt = self.renderer.max_len - self.prefix_len
        fits = self._fitting_batch("beam", prompt, self.target, None)
        return min(self.spec.warm_users, fits or self.spec.warm_users), prompt

    def _warm_up(self) -> None:
        """The compiled engine's start: the node's compile cache (with a keyed compile store: `_node_cache`), then
        the actor's bucket compiled (a dummy batch of `_warm_shape`; every decode of a shard snaps to it); after a cold
        compile into a fresh folder the cache is sealed, uploaded (signed) to the store and renamed into the node's
        place. A compile error is recorded for the bucket, which then decodes eager. What happened goes into the
        actor's first metric row (`compile_cache`)."""
        users, prompt = self._warm_shape()
        k, store = self.spec.decoding.k, self.spec.compile_store
        key = compile_key(
            self.target, self.spec.target_sha256, users, prompt, k, self.catalog.code_len, self.prefix_len
        )
        folder, fresh, fetched = self._node_cache(key)
        cold = cold_compiles()
        self.warm = True
        try:
            warm_up(self.target, self.catalog, users, prompt, k, self.prefix)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 -- an image without a C++ compiler, an inductor bug: this bucket runs eager
            bucket = Bucket.of(users, prompt, k, self.catalog.code_len)
            self._compile_failed((bucket.users, bucket.prompt), e)
        cold = cold_compiles() - cold
        uploaded = None
        if store is not None and fresh is not None and cold and not self.compile_errors:  # compiled here: the only
            # folder ever published
            uploaded = store.compiled(key, fresh, folder, self.device)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder if uploaded["placed"] else str(fresh)
        self.compile_cache = {"key": key, "graphs_cold": cold, "fetched": fetched, "uploaded": uploaded}

    def _load(self, spec: ActorSpec) -> None:
        """The catalog, template and models on the actor's device; the template's fixed prefix and scored answer."""
        inputs = prepare(spec, self.device)
        self.catalog, self.renderer = inputs.catalog, inputs.renderer
        self.paths = {"target": inputs.target, "draft": inputs.draft}
        self.target = load_model(inputs.target, device=str(self.device), dtype=spec.dtype)
        self.draft = load_model(inputs.draft, device=str(self.device), dtype=spec.dtype) if inputs.draft else None
        self.dtype = str(self.target.dtype).removeprefix("torch.")
        ids = self.renderer.prefix_ids  # the template's fixed text: prefilled once per model, kept
        self.prefix = Prefix(ids) if len(ids) else None
        answer = self.renderer.answer  # the template's forced, scored tokens after an item's codes
        self.answer = torch.from_numpy(answer).to(self.device) if len(answer) else None

    def _engines(self, spec: ActorSpec) -> None:
        """The engine state: which engine publishes, compute.engine auto's trials, the compiled engine's errors."""
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        setting = {"dtype": self.dtype, "device": device_tag(self.device), "torch": torch.__version__}
        setting["k"] = spec.decoding.k
        self.engine_auto = (
            AutoEngine(spec, device_name, setting)
            if spec.engine == "auto" and spec.decoding.mode in ("beam", "auto")
            else None
        )
        self.engine = "eager" if spec.engine == "auto" else spec.engine  # the engine of the lists published now
        self.warm = False  # the compiled engine's bucket compiled (or its compile failed)
        self.trialing = False  # compute.engine auto's trials are running: the compiled engine checks its buckets
        self.compile_errors: dict[tuple[int, int], str] = {}  # bucket (users, prompt) -> why it did not compile
        self.reported_errors = 0  # compile errors reported in metric rows so far
        self.compile_cache: dict | None = None  # what the warm-up found in and gave to the compile store
        self.batch_engine = self.engine  # the engine whose lists the last batch published

    def _node_cache(self, key: str) -> tuple[str | None, object, dict | None]:
        """Where inductor's cache goes for the bucket `key` -> (the node folder, the fresh folder a cold compile fills
        (None: the node folder verified), what the store fetch did). With a compile store and its key: the node's
        verified folder (`CompileStore.node_folder`, its manifest checked, else filled from the store's verified
        archive), else a fresh folder beside it; otherwise the node's compile cache as it is (no store)."""
        store, cache = self.spec.compile_store, self.spec.compile_cache
        if not cache:
            return None, None, None
        try:
            if store is None or not store.keyed():  # inductor's own cache: private, as the signed one
                private_dirs(Path(cache).expanduser(), Path(cache).expanduser())
                use_compile_cache(cache)
                return None, None, store.fetch(key, cache, self.device) if store else None
            folder = store.node_folder(cache, key, self.device)
        except ValueError as e:  # a cache folder others could write: nothing loaded from it or placed in it
            log.warning("%s; this actor compiles cold into a private temporary folder", e)
            fresh = Path(tempfile.mkdtemp(prefix="genrec-compile-"))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh)
            return None, fresh, {"found": False, "used": False, "note": str(e)[:300], "bytes": 0, "seconds": 0.0}
        fetched = store.fetch(key, folder, self.device)
        fresh = None if fetched["used"] else store.cold_folder(Path(folder))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh or fetched["folder"])
        return folder, fresh, fetched

    def _compile_failed(self, bucket: tuple[int, int], error: Exception) -> str:
        """Records a compile error for the bucket (users, prompt), which decodes eager on this actor -> the note."""
        msg = f"{type(error).__name__}: {error}"[:500]
        self.compile_errors[bucket] = msg
        log.warning("the compiled engine's bucket %s failed to compile; it decodes eager: %s", bucket, msg)
        return f"compile failed: {msg}"

    def __call__(self, batch: pa.Table) -> pa.Table:
        """A histories batch -> its output rows: its users' recommendations and rejects, and one metric row."""
        self._fault_injection()
        t0 = time.perf_counter()
        d = self.spec.decoding
        good, rejects = validate(batch, self.catalog.item_tokens, self.renderer.max_items, d.exclude_column)
        users = good.column("user_id")
        exclude, excluded = self._exclusions(good)
        prompts = self.renderer.render(good.column("history"), self.catalog.item_tokens, self.prefix_len)
        decoded = self._decode_batch(prompts, users, exclude)
        broken = decoded.broken
        rejects = pa.concat_tables(
            [rejects, non_finite_rejects(users, broken), no_items_rejects(users, decoded.items, broken)]
        )
        recs = recommendation_table(users, decoded.items, decoded.scores, d.mode)
        wall = time.perf_counter() - t0 - decoded.audit.get("audit_s", 0.0)  # the audit is reported as its own cost
        counts = batch_counts(
            batch.num_rows, decoded.items, broken, rejects.num_rows, recs.num_rows, prompts, self.prefix_len
        )
        metric = {**self._metric_row(counts, wall, decoded), **excluded}
        self.batches += 1
        return output_table(recs, rejects, metric, batch.schema.field("user_id").type)

    def _decode_batch(self, prompts: Prompts, users, exclude: Exclusions | None) -> Decoded:
        """The validated users' prompts [U, S] decoded by this batch's decoder (auto: the one whose turn it is), in
        slices that fit, ordered by prompt length (compute.order_by_length; the result in input order), the first
        users audited while the audit lasts -> Decoded (empty when no row was valid)."""
        mode = self.auto.next() if self.auto else self.spec.decoding.mode
        if not len(users):
            return Decoded.empty(mode, self.spec.decoding.k)
        if not self.spec.order_by_length:
            return self._decode_rows(mode, prompts, users, exclude, np.arange(len(users)))
        order = length_order(prompts.attention_mask, users)  # [U]
        rows = torch.from_numpy(order)
        prompts = Prompts(prompts.input_ids[rows], prompts.attention_mask[rows])
        exclude = exclude.select(rows.to(self.device)) if exclude is not None else None
        return self._decode_rows(mode, prompts, users.take(pa.array(order)), exclude, order).unsort(order)

    def _decode_rows(self, mode: str, prompts: Prompts, users, exclude: Exclusions | None, order) -> Decoded:
        """`_decode_batch` of the users in decode order (row i: input row order[i]); the audit takes the first in
        input order."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ids, mask = prompts.input_ids.to(self.device), prompts.attention_mask.to(self.device)
        first = self._first_batch(mode, ids, self.target, self.draft, self.oom_batch)
        if mode == "beam" and self.engine_auto and self.engine_auto.choice is None:
            self._choose_engine(ids, mask)
        rec, self.decode_batch = self._decode_slices(mode, ids, mask, users, self.target, self.draft, first, exclude)
        self.batch_engine = rec.stats.get("engine", "eager") if mode == "beam" else "eager"  # any slice eager: eager
        self.oom_batch = self.decode_batch if self.decode_batch < first else self.oom_batch  # kept for later shards
        if self.auto:
            self.auto.record(mode, sum(rec.stats[key] for key in PHASES), len(users))
        broken = rec.stats["non_finite"].cpu().numpy()  # [U] NaN / inf log-probs: rejected, never a short list
        ok = np.nonzero(~broken)[0]
        pick = ok[np.argsort(order[ok], kind="stable")][: self.audit_left]  # the first users, while the audit lasts
        audit = self._audit(mode, ids, mask, users, rec, pick, exclude) if len(pick) else {}
        items = rec.item_ids.cpu().numpy()  # [U, k]
        items[broken] = -1
        return Decoded(mode, items, rec.scores.float().cpu().numpy(), broken, rec.stats, audit)

    def _choose_engine(self, ids, mask) -> None:
        """compute.engine auto, at the actor's first beam batch: the run's recorded decision, else this actor's trials
        (`_engine_trials` on the spec's trial users, else on this batch's prompts ids [U, S]) recorded as the run's
        unless another actor recorded one first (then that one); the compiled engine's bucket compiled if chosen."""
        a, record = self.engine_auto, self.spec.engine_record
        recorded = record.read() if record is not None else None
        if recorded is None:
            why = self._exclusions_set()
            if why:
                a.decide("eager", why)
            else:
                self._engine_trials(self._trial_groups(ids, mask))
            mine = a.decision(self.actor)
            recorded = record.claim(mine) if record is not None and not a.local else mine
            if a.local:  # this actor's own failure: it decodes eager; the run's decision is left to the others
                a.note = f"this actor decodes eager ({a.reason}); the run's decision is not recorded by it"
        a.adopt(recorded)
        self.engine = a.choice
        if a.choice == "compiled" and not self.warm:
            self._warm_up()

    def _exclusions_set(self) -> str | None:
        """Why the run decodes eager before any trial: per-user exclusions (decoding.exclude history, or the input's
        exclusion column), under which the compiled engine decodes eager; None when there are none."""
        d, t = self.spec.decoding, self.spec.trial_users
        if d.exclude != "none":
            return f"per-user exclusions (decoding.exclude {d.exclude}): the compiled engine decodes them eager"
        if d.exclude_column and t is not None and d.exclude_column in t.column_names:
            return f"per-user exclusions (the input's {d.exclude_column} column): the compiled engine decodes eager"
        return None

    def _trial_groups(self, ids, mask) -> list[tuple]:
        """The trial users' prompts in groups of one decode batch (spec.warm_users): the spec's trial users (the
        input's first, the same for every actor and attempt) when given, else this batch's prompts ids [U, S]."""
        t = self.spec.trial_users
        if t is not None:
            good, _ = validate(t, self.catalog.item_tokens, self.renderer.max_items, self.spec.decoding.exclude_column)
            if good.num_rows:
                p = self.renderer.render(good.column("history"), self.catalog.item_tokens, self.prefix_len)
                ids, mask = p.input_ids.to(self.device), p.attention_mask.to(self.device)
        n = max(self.spec.warm_users, 1)
        return [(ids[i : i + n], mask[i : i + n]) for i in range(0, ids.shape[0], n)]

    def _engine_trials(self, groups: list[tuple]) -> None:
        """Decodes trial groups with both engines in turn, and in the reference dtype (what the run's dtype costs),
        until AutoEngine decides or the groups run out (inconclusive: eager). None runs when the reference copy would
        not fit (this actor stays eager; the run's decision is left to others)."""
        a, ref = self.engine_auto, None
        if groups and (why := self._reference_does_not_fit(*groups[0][0].shape)):
            a.decide("eager", f"inconclusive on this actor, no trial run: {why}", local=True)
            return
        self.trialing = True
        try:
            for ids, mask in groups[: a.max_groups]:
                runs = {}
                for engine in a.order():
                    if engine == "compiled" and not self._trial_warm_up():
                        return
                    runs[engine] = self._trial_decode(engine, ids, mask)
                    if engine == "eager" and not a.groups and a.too_short(runs["eager"][1]):
                        return
                note = runs["compiled"][0].stats.get("engine_note")
                if runs["compiled"][0].stats.get("engine") != "compiled":
                    a.decide("eager", f"the compiled engine did not run: {note}", local=True)
                    return
                ref = ref or load_model(self.paths["target"], str(self.device), reference_dtype(self.target.dtype))
                reference, _ = self._decode_slices("beam", ids, mask, pa.nulls(len(ids)), ref, None, len(ids))
                noise = dtype_noise(runs["eager"][0], reference)
                a.record(runs["eager"][0], runs["compiled"][0], noise, (runs["eager"][1], runs["compiled"][1]))
                if a.choice:
                    return
            a.inconclusive()
        except torch.OutOfMemoryError as e:
            a.decide("eager", f"the engine trials ran out of memory: {e}"[:300], local=True)
        finally:
            self.engine, self.trialing = "eager", False
            del ref
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _trial_warm_up(self) -> bool:
        """The compiled engine's bucket compiled for the trials (timed: what the compiled engine costs) -> whether it
        compiled (if not, the choice is eager, with the error)."""
        if not self.warm:
            t0 = time.perf_counter()
            self._warm_up()
            self.engine_auto.compile_s += time.perf_counter() - t0
        if self.compile_errors:
            self.engine_auto.decide("eager", "compile failed: " + "; ".join(self.compile_errors.values()), local=True)
            return False
        return True

    def _reference_does_not_fit(self, users: int, prompt_len: int) -> str | None:
        """Why the trials' reference-dtype copy of the target and a trial group of `users` prompts of `prompt_len`
        tokens decoded by it do not fit beside the run's models (the device's usable memory, or the host's on a CPU
        actor; decoding/memory.py), None when they fit."""
        wide = reference_dtype(self.target.dtype)
        weights = sum(p.numel() for p in self.target.parameters()) * torch.finfo(wide).bits // 8
        d = self.spec.decoding
        per_user = decode_bytes_per_user(self.target, prompt_len + self.prefix_len, d.k, self.catalog.code_len, wide)
        device_free, host_free = self._audit_budget()
        free = device_free if device_free is not None else host_free
        need = weights + users * per_user
        if need <= usable_bytes(free):
            return None
        return f"the {wide} reference copy and its decode need {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"

    def _trial_decode(self, engine: str, ids, mask) -> tuple[Recommendations, float]:
        """A trial group's prompts [U, S] decoded by `engine` -> (its lists, decode seconds per user); the compiled
        engine's bucket counts as checked."""
        self.engine = engine
        first = self._first_batch("beam", ids, self.target, None, self.oom_batch)
        t0 = time.perf_counter()
        rec, _ = self._decode_slices("beam", ids, mask, pa.nulls(len(ids)), self.target, None, first)
        compile_s = rec.stats.get("compile_s", 0.0)
        self.engine_auto.compile_s += compile_s
        seconds = (time.perf_counter() - t0 - compile_s) / len(ids)
        if engine == "compiled" and rec.stats.get("engine") == "compiled":
            self.engine_auto.checked.add((int(rec.stats["bucket_users"]), int(rec.stats["bucket_prompt"])))
        if engine == "compiled" and os.environ.get(SKEW_ENV):  # tests only: an engine that differs
            rec = Recommendations(rec.item_ids.roll(1, 1), rec.token_ids, rec.scores, rec.stats)
        return rec, seconds

    def _first_batch(self, mode: str, ids, target, draft, oom_batch: int | None = None) -> int:
        """Users per decode for the prompts ids [U, S]: compute.decode_batch if pinned, else on CUDA the largest that
        fits (decoding/memory.py), else all of them; never above `oom_batch` (the batch an out-of-memory left)."""
        n = ids.shape[0]
        return min(
            n, self.spec.decode_batch or self._fitting_batch(mode, ids.shape[1], target, draft) or n, oom_batch or n
        )

    def _decode_slices(
        self, mode: str, ids, mask, users, target, draft, batch: int, exclude: Exclusions | None = None
    ) -> tuple[Recommendations, int]:
        """The users [U, S] in consecutive slices of `batch` users, a slice that runs out of memory halved and retried
        (the slices already decoded stay), each without the left padding none of its users needs -> (one
        Recommendations, the batch it ended at); its stats count the prompt positions, padding and padding's KV
        tokens (`padding_metrics`). Sampling modes draw per user: a slice draws what the whole batch would."""
        parts, a, widths = [], 0, []
        while a < ids.shape[0]:
            rows = torch.arange(a, min(a + batch, ids.shape[0]), device=ids.device)
            part = exclude.select(rows) if exclude is not None else None  # the slice's users' exclusions
            slice_ids, slice_mask = trim_padding(ids[a : a + batch], mask[a : a + batch])
            try:
                parts.append(self._decode(mode, target, draft, slice_ids, slice_mask, users.slice(a, batch), part))
                widths.append((len(rows), slice_mask.shape[1], int(slice_mask.sum())))
                a += batch
            except torch.OutOfMemoryError:
                if batch == 1:
                    raise
                batch //= 2
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        rec = Recommendations.concat(parts)
        holding = 2 if draft is not None and mode.startswith("atspeed") else 1  # models whose caches hold the prompts
        rec.stats.update(
            prompt_positions=sum(n * s for n, s, _ in widths),
            prompt_padding=sum(n * s - t for n, s, t in widths),
            kv_padding_tokens=max(holding * (n * s - t) for n, s, t in widths),
        )
        return rec, batch

    def _compiled_since(self) -> dict:
        """The engine, and the seconds and graphs the actor compiled since its last metric row (its first row: the
        warm-up's too)."""
        seconds, graphs = compile_totals(self.target)
        (s0, g0), self.compiled = self.compiled, (seconds, graphs)
        cache, self.compile_cache = self.compile_cache, None  # reported once, in the row after the warm-up
        errors = list(self.compile_errors.items())[self.reported_errors :]  # each reported once
        self.reported_errors = len(self.compile_errors)
        return {
            "compile_errors": json.dumps({f"{u}x{p}": why for (u, p), why in errors}) if errors else None,
            "engine": self.batch_engine,
            "compile_s": seconds - s0,
            "graphs_compiled": graphs - g0,
            "graphs_cold": cache["graphs_cold"] if cache else None,
            "compile_cache": json.dumps(cache) if cache else None,
        }

    def _fitting_batch(self, mode: str, prompt_len: int, target, draft) -> int | None:
        """On CUDA: the most users whose decode fits in the free memory; elsewhere None (no limit)."""
        free = free_device_memory(target.device)
        if free is None:
            return None
        d = self.spec.decoding
        per_user = decode_bytes_per_user(
            target,
            prompt_len + self.prefix_len,
            d.k,
            self.catalog.code_len,
            target.dtype,
            mode,
            draft,
            d.draft_beams,
            d.gamma,
        )
        return fit_batch(per_user, free)

    def _exclusions(self, good: pa.Table) -> tuple[Exclusions | None, dict]:
        """The validated users' exclusions (decoding.exclude: history, the exclusion column) on the device, None when
        nobody excludes anything -> (them, metrics: exclude_users, excluded_items (distinct items the index holds,
        summed over users), excluded_max (one user's most), exclude_unknown_ids (ids the catalog does not hold,
        ignored; items dropped as sharing a kept item's semantic ID are neither))."""
        d = self.spec.decoding
        column = good.column(d.exclude_column) if d.exclude_column in good.column_names else None
        row, item = excluded_items(good.column("history"), column, d.exclude == "history")  # [M], [M]
        counts = {
            "exclude_users": good.num_rows,
            "excluded_items": 0,
            "excluded_max": 0,
            "exclude_unknown_ids": int((~self.catalog.item_tokens.lookup(item)[1]).sum()),
        }
        if not len(item):
            return None, counts
        exclude = Exclusions.from_items(self.catalog, torch.from_numpy(row), torch.from_numpy(item), good.num_rows)
        per_user = exclude.per_user()  # [U]
        return exclude, {**counts, "excluded_items": int(per_user.sum()), "excluded_max": int(per_user.max())}

    def _decode(self, mode: str, target, draft, ids, mask, users, exclude: Exclusions | None = None):
        """One decode of the users ids [U, S] by `mode`'s decoder -> Recommendations. Sampling modes draw per user
        (decoding/draws.py), seeded by decoding.seed and the user's id: a user draws the same items in any batch
        (reordered, a halved slice, a retried or resumed shard)."""
        d, shared = self.spec.decoding, {"prefix": self.prefix, "exclude": exclude}
        catalog, answer = (self.catalog, self.answer) if target.device.type == self.device.type else self.on_cpu
        if mode == "beam" and target is self.target and self.engine == "compiled":
            return self._compiled_beam(ids, mask, shared)
        if mode == "beam":  # the eager engine: the reference, and the audit's and trials' reference dtypes
            return beam_search(target, ids, mask, catalog, d.k, engine="eager", answer=answer, **shared)
        draws = UserDraws(user_seeds(d.seed, users.to_pylist(), ids.device))
        shared.update(temperature=d.temperature, generator=draws)
        if mode == "disc":
            return disc_sample(target, ids, mask, catalog, d.k, rounds=d.rounds, top_m=d.top_m, **shared)
        drafting = {"draft_beams": d.draft_beams, "gamma": d.gamma, "verification": mode.removeprefix("atspeed-")}
        return speculative_beam_search(target, draft, ids, mask, catalog, d.k, **drafting, **shared)

    def _compiled_beam(self, ids, mask, shared: dict) -> Recommendations:
        """Beam search of the prompts ids [U, S] by the compiled engine where it may run: in a bucket that compiled
        without error and, under compute.engine auto, one the trials checked; else eager (stats: engine, the reason
        in engine_note). Every result carries the compiled engine's extra stats, so that slices concatenate."""
        d = self.spec.decoding
        run = functools.partial(beam_search, self.target, ids, mask, self.catalog, d.k, answer=self.answer, **shared)
        bucket = self._bucket(ids)
        why = f"compile failed: {self.compile_errors[bucket]}" if bucket in self.compile_errors else None
        a = self.engine_auto
        if why is None and bucket and a and not self.trialing and bucket not in a.checked:
            why = f"the engine trials did not check bucket {bucket} (users, prompt): it decodes eager"
        rec = None
        if why is None:
            try:
                rec = run(engine="compiled")
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 -- a compile error: this bucket decodes eager on this actor
                why = self._compile_failed(bucket, e)
        if rec is None:
            rec = run(engine="eager")
            rec.stats.update(engine="eager", engine_note=why)
        for key, value in COMPILED_EXTRAS.items():
            rec.stats.setdefault(key, value)
        return rec

    def _bucket(self, ids) -> tuple[int, int] | None:
        """The compiled engine's bucket (users, prompt) for the prompts ids [U, S]: the warm one it snaps to, else its
        own; None for a model the compiled engine does not run (it decodes eager, saying why)."""
        if unsupported(self.target):
            return None
        b = Engine.of(self.target).bucket_for(ids.shape[0], ids.shape[1], self.spec.decoding.k, self.catalog.code_len)
        return b.users, b.prompt

    def _audit(
        self, mode: str, ids, mask, users, rec: Recommendations, pick: np.ndarray, exclude: Exclusions | None = None
    ) -> dict:
        """The precision audit: the users at `pick` (rows of this batch, decoded in half precision into `rec`)
        re-decoded by the float32 models with the same mode -> their agreement (metrics keys audit_*). A sampling
        mode's draws are per user, the same in both precisions' decodes. The float32 copies go where they
        fit (_float32_models); where nothing fits, the audit is skipped and says why (audit_skipped)."""
        t0 = time.perf_counter()
        sel = torch.as_tensor(pick, device=self.device)
        ids, mask, users = ids[sel], mask[sel], users.take(pa.array(pick))
        exclude = exclude.select(sel) if exclude is not None else None
        first = int(mask.any(0).nonzero()[0])  # left padding no audited user needs
        ids, mask = ids[:, first:], mask[:, first:]
        f32, skipped = self._float32_models(mode, ids.shape[1])
        if skipped:
            self.audit_left = 0
            return {"audit_skipped": skipped}
        on = f32[0].device  # the float32 copies' device: the actor's, or the CPU
        moved = exclude.to(on) if exclude is not None else None
        ref, _ = self._decode_slices(
            mode, ids.to(on), mask.to(on), users, *f32, self._first_batch(mode, ids, *f32), moved
        )
        agree = topk_agreement(*(t.cpu() for t in (ref.item_ids, ref.scores, rec.item_ids[sel], rec.scores[sel])))
        self.audit_left -= len(pick)
        if not self.audit_left:  # done for this run: the float32 copies leave the device
            self.float32.clear()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return {
            "audit_users": len(pick),
            "audit_identical_lists": int(agree["identical"].sum()),
            "audit_topk_overlap_sum": float(agree["overlap"].sum()),
            "audit_max_abs_score_diff": float(agree["score_diff"].max()),
            "audit_s": time.perf_counter() - t0,
            "audit_device": self.audit_where,
        }

    def _float32_models(self, mode: str, prompt_len: int) -> tuple[tuple, str]:
        """The audit's (target, draft) in float32, loaded from the same directories on first use, on the device when
        they fit beside the run's models and decode batch, else on the CPU (audit_placement) -> (them, "") or
        ((), why the audit is skipped)."""
        roles = ("target", "draft") if mode.startswith("atspeed") else ("target",)
        if any(role not in self.float32 for role in roles):
            where, why = self._audit_placement(mode, prompt_len, roles)
            if where == "cpu" and self.device.type != "cpu" and mode in SAMPLING:
                where, why = None, f"{mode} draws differ between devices: its audit needs the float32 copies on the GPU"
            if where is None:
                return (), why
            self.audit_where = "gpu" if where == "device" else "cpu"
            device = "cpu" if where == "cpu" else str(self.device)  # "device" on a CPU actor: a simulated budget
            if device != str(self.device) and self.on_cpu is None:
                self.on_cpu = (self.catalog.to("cpu"), self.answer.cpu() if self.answer is not None else None)
            for role in roles:
                self.float32[role] = load_model(self.paths[role], device=device, dtype="float32")
        return (self.float32["target"], self.float32.get("draft")), ""

    def _audit_placement(self, mode: str, prompt_len: int, roles: tuple) -> tuple[str | None, str]:
        """audit_placement for this actor: the float32 weights of `roles`' models, one user's float32 decode, the
        run's decode batch, the device's free memory and the host's available memory (_audit_budget)."""
        d, models = self.spec.decoding, [getattr(self, role) for role in roles]
        weights = sum(p.numel() for m in models for p in m.parameters()) * 4
        args = (prompt_len + self.prefix_len, d.k, self.catalog.code_len)
        drafting = (mode, self.draft, d.draft_beams, d.gamma)
        per_user = decode_bytes_per_user(self.target, *args, torch.float32, *drafting)
        beside = self.decode_batch * decode_bytes_per_user(self.target, *args, self.target.dtype, *drafting)
        return audit_placement(weights, per_user, beside, *self._audit_budget())

    def _audit_budget(self) -> tuple[int | None, int]:
        """(the device's free bytes, None without a GPU; the host's available bytes)."""
        return free_device_memory(self.device), host_free_memory()

    def _metric_row(self, counts: dict, wall: float, decoded: Decoded) -> dict:
        """One row per batch: ids, counts (batch_counts), the decoder's stats (decoder_metrics), the actor's state
        (its decode batch, auto mode, dtype, compile totals) and the precision audit's figures."""
        d, ok = self.spec.decoding, counts["users_ok"]
        return {
            **self._ids(),
            "mode": d.mode,
            "k": d.k,
            **counts,
            **decoder_metrics(decoded.stats, wall),
            **padding_metrics(decoded.stats),
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None,
            "decode_batch": self.decode_batch if ok else None,
            "actor_ready_at": self.ready_at if self.batches == 0 else None,  # on the actor's first batch only
            "users_per_s": ok / wall if wall > 0 else None,
            "users_non_finite": int(decoded.broken.sum()),
            "decoder": decoded.mode,
            "engine_note": decoded.stats.get("engine_note") or (self.engine_auto and self.engine_auto.note) or None,
            "auto": self._auto_state(),
            "dtype": self.dtype,
            **decoded.audit,
            **self._compiled_since(),
        }

    def _auto_state(self) -> dict | None:
        """The actor's auto choices so far: decoding.mode auto's (choice, trial users/s, trial batches) and, under
        "engine", compute.engine auto's (AutoEngine.state)."""
        state = self.auto.state() if self.auto else {}
        if self.engine_auto:
            state["engine"] = self.engine_auto.state()
        return state or None

    def _ids(self) -> dict:
        """Who decoded the batch: the run, the shard (actor:batch), the actor, its host, accelerator and device."""
        return {
            "run_id": self.spec.run_id,
            "shard": f"{self.actor}:{self.batches}",
            "actor": self.actor,
            "batch": self.batches,
            "host": self.host,
            "accelerator": self.accelerator,
            "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
        }

    def _fault_injection(self) -> None:
        spec = os.environ.get(FAIL_AFTER_ENV)
        if not spec:
            return
        after, marker = spec.split(":", 1)
        if self.batches >= int(after) and not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            os._exit(1)  # a crash mid-run: Ray restarts the actor and retries the batch


def _device_id(device: torch.device) -> str:
    """The physical device an actor decodes on: `gpu<id>` (Ray's GPU ids under Ray, which sets CUDA_VISIBLE_DEVICES
    per actor; else torch's index) or `cpu`."""
    if device.type != "cuda":
        return "cpu"
    try:
        import ray

        if ray.is_initialized() and ray.get_gpu_ids():
            return "gpu" + ",".join(str(i) for i in ray.get_gpu_ids())
    except Exception:  # outside Ray
        pass
    return f"gpu{torch.cuda.current_device()}"


def _actor_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_actor_id() or f"pid{os.getpid()}"
    except Exception:  # outside Ray (direct calls in tests)
        pass
    return f"pid{os.getpid()}"
