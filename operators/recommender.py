"""The Ray Data recommender actor: loads target, draft and catalog once; `recommend(batch)` is pure.

The graph (pipeline/nightly.py, or the processor: pipeline/processor.py) resolves everything first and hands the actor
an `ActorSpec` of plain values: local model directories, the catalog table it read once, the decoding settings.
`recommend` validates the batch's rows (operators/validate.py), renders their prompts (operators/prompts.py), decodes
them and returns its users' recommendations, its rejects and one metric row (`Recommended`); `__call__` returns them
as the nightly's output rows (operators/outputs.py: each row tagged with its kind), the processor as columns beside
each input row.

The actor composes what a decode needs, each in a module of its own: the decoder and engine choice
(operators/engines.py: decoding.mode auto, compute.engine auto's trials and decision), the compiled engine
(operators/compile_cache.py: its warm-up, cache folders and fallbacks), memory-fitted slices (operators/batcher.py:
users per decode, halved on out-of-memory, the length order) and the precision audit (operators/audit.py).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from decoding.beam import Prefix, Recommendations, beam_search
from decoding.catalog import Catalog, Exclusions
from decoding.compiled import device_tag
from decoding.disc import disc_sample
from decoding.draws import UserDraws, user_seeds
from decoding.memory import trim_host_heap
from decoding.models import attention_window, check_window, load_config, load_model, load_tokenizer
from decoding.speculative import speculative_beam_search
from decoding.stats import PHASES
from operators.audit import PrecisionAudit, float32_need
from operators.batcher import Batcher, fitting, holding, length_order
from operators.compile_cache import CompiledEngine
from operators.engines import AutoEngine, AutoMode
from operators.exclusions import batch_exclusions
from operators.outputs import (
    Decoded,
    batch_counts,
    decoder_metrics,
    no_items,
    no_items_rejects,
    non_finite_rejects,
    output_table,
    padding_metrics,
    recommendation_table,
)
from operators.prompts import Prompts, Renderer, answer_ids, catalog_probes
from operators.spec import ActorSpec
from operators.validate import rendered

FAIL_AFTER_ENV = "GENREC_TEST_FAIL_AFTER"  # tests only: "N:/path/marker" exits the actor once, after N batches
log = logging.getLogger("genrec.actor")


@dataclass
class Inputs:
    """What an actor builds from its spec before any weight is loaded; each step refuses bad input, naming it."""

    target: str  # local model directories
    draft: str | None
    tokenizer: object
    catalog: Catalog  # index + item-to-tokens map, every code token checked against the tokenizer
    renderer: Renderer  # the prompt template compiled against the tokenizer


@dataclass
class Recommended:
    """One batch's decode (`Recommender.recommend`), rows B, validated users U, rejects R."""

    rows: np.ndarray  # [U] the validated users' rows in the batch, in order
    listed: np.ndarray  # [U] the items each got (0: none, a rejected user's)
    recs: pa.Table  # their recommendations (TABLES["rec"]): listed[u] rows each, users in order, ranks 1..
    rejects: pa.Table  # (TABLES["reject"]) the batch's invalid rows, then its users rejected after their decode
    reject_rows: np.ndarray  # [R] each reject's row in the batch
    metric: dict  # the batch's metric row


def prepare(spec: ActorSpec, device: torch.device | str = "cpu") -> Inputs:
    """Fetches the model directories, checks the models (causal LMs; a sliding window covering the longest prompt
    plus an item; one vocabulary for target and draft), parses the catalog with the template's code-token names and
    compiles the template. The graph calls it on the driver first: what an actor would refuse fails before any work."""
    fetch = spec.fetch or (lambda uri, *_: uri)  # models on object storage: copied once per node by the graph's fetch,
    # which refuses a model that is not the one the plan fingerprinted
    target = fetch(spec.target, spec.target_sha256, spec.target_files)
    draft = fetch(spec.draft, spec.draft_sha256, spec.draft_files) if spec.decoding.uses_draft else None
    tokenizer = load_tokenizer(target)
    configs = {role: load_config(path) for role, path in (("target", target), ("draft", draft)) if path is not None}
    catalog = Catalog.from_table(
        spec.catalog,
        tokenizer,
        on_duplicate=spec.on_duplicate,
        device=device,
        source=spec.catalog_name,
        code_token=spec.template.code,
        recommendable=spec.recommendable,
    )
    renderer = compile_renderer(spec, tokenizer, catalog, target, configs.values())
    if len(renderer.answer) and spec.decoding.mode != "beam":
        raise ValueError(
            f"prompt template {renderer.template.name!r} scores the tokens after an item's codes (answer_suffix "
            f"{renderer.template.answer_suffix!r}, answer_eos {renderer.template.answer_eos}), which beam search does: "
            f"set decoding.mode to beam (it is {spec.decoding.mode})"
        )
    vocab = {}
    for role, config in configs.items():
        check_window(
            config, renderer.max_len + catalog.code_len, f"models.{role} {target if role == 'target' else draft}"
        )
        vocab[role] = config.vocab_size
    if len(set(vocab.values())) > 1:
        raise ValueError(
            f"models.draft {draft}: vocabulary of {vocab['draft']} tokens, the target's has "
            f"{vocab['target']}: a draft must share its target's tokenizer"
        )
    return Inputs(target, draft, tokenizer, catalog, renderer)


def compile_renderer(spec: ActorSpec, tokenizer, catalog: Catalog, target: str, configs) -> Renderer:
    """The spec's template (decoding.history_len its window) compiled against the tokenizer, the catalog and the
    model directory (its chat template), prompts bounded by decoding.max_prompt_tokens or `prompt_bound`."""
    template = spec.template.with_max_items(spec.decoding.history_len)
    probes = catalog_probes(catalog.item_tokens)
    answer = len(answer_ids(template, tokenizer, probes))
    bound = spec.decoding.max_prompt_tokens or prompt_bound(configs, catalog.code_len + answer)
    return Renderer.compile(template, tokenizer, probes, spec.catalog, target, bound, spec.decoding.too_long)


def prompt_bound(configs, answer: int) -> int | None:
    """decoding.max_prompt_tokens' default: the models' context (max_position_embeddings, or a shorter attention
    window) less the `answer` tokens (an item's code tokens and the template's forced ones); None when no model
    says."""
    spans = [attention_window(c) or getattr(c, "max_position_embeddings", None) for c in configs]
    spans = [s for s in spans if s]
    return min(spans) - answer if spans else None


class Recommender:
    def __init__(self, spec: ActorSpec):
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.device = torch.device("cuda" if spec.gpu and torch.cuda.is_available() else "cpu")
        self._load(spec)
        self.spec = spec = replace(spec, catalog=None, recommendable=None)  # parsed into self.catalog: not kept twice
        pa.default_memory_pool().release_unused()
        trim_host_heap()  # the index build's temporaries, freed, leave the process
        half = self.target.dtype != torch.float32
        self.audit = PrecisionAudit(spec.audit_users if half else 0, self.device, self.paths)
        self.batcher = Batcher(spec.decode_batch)
        self.auto = AutoMode(spec.decoding.auto_trials) if spec.decoding.mode == "auto" else None
        self.actor, host = _actor_id(), socket.gethostname()
        self.where = {  # actors that share a GPU share its accelerator
            "host": host,
            "accelerator": f"{host}/{_device_id(self.device)}",
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
        }
        self._engines(spec)
        self.batches = 0
        if spec.engine == "compiled" and spec.decoding.mode in ("beam", "auto"):
            self.warm_up()
        self.ready_at = time.time()  # ready to decode: process started, modules imported, models loaded, compiled

    @property
    def prefix_len(self) -> int:
        """Tokens of the template's fixed prefix: prefilled once per model, left out of every rendered prompt."""
        return len(self.prefix) if self.prefix is not None else 0

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
        """Which engine publishes (compute.engine; auto: eager until the run's decision), its trials' state."""
        setting = {"dtype": self.dtype, "device": device_tag(self.device), "torch": torch.__version__}
        setting["k"] = spec.decoding.k
        auto = spec.engine == "auto" and spec.decoding.mode in ("beam", "auto")
        self.engine_auto = AutoEngine(spec, self.where["device"], setting) if auto else None
        self.engine = "eager" if spec.engine == "auto" else spec.engine  # the engine of the lists published now
        self.trialing = False  # compute.engine auto's trials are running: every bucket may run compiled
        self.compiled = CompiledEngine(spec, self.device, self.catalog.code_len)
        self.batch_engine = self.engine  # the engine whose lists the last batch published

    def warm_shape(self) -> tuple[int, int]:
        """The users and prompt tokens the compiled engine's bucket is compiled for: the decode batch x the longest
        prompt (with text from data: a full prompt with short texts; longer batches get buckets of their own)."""
        prompt = self.renderer.full_len - self.prefix_len
        return min(self.spec.warm_users, self.fits("beam", prompt, self.target, None) or self.spec.warm_users), prompt

    def warm_up(self) -> None:
        """The compiled engine's bucket compiled (`warm_shape`)."""
        self.compiled.warm_up(self.target, self.catalog, *self.warm_shape(), self.prefix)

    def __call__(self, batch: pa.Table) -> pa.Table:
        """A histories batch -> its output rows: its users' recommendations and rejects, and one metric row."""
        out = self.recommend(batch)
        return output_table(out.recs, out.rejects, out.metric, batch.schema.field("user_id").type)

    def recommend(self, batch: pa.Table) -> Recommended:
        """A histories batch -> its users' recommendations, its rejects with their rows, its metric row: the decode
        the nightly's shards (`__call__`) and the processor's rows (pipeline/processor.py) are both made of."""
        fault_injection(self.batches)
        t0 = time.perf_counter()
        d = self.spec.decoding
        r = rendered(self.renderer, batch, self.catalog.item_tokens, d, self.prefix_len)
        good, rejects, prompts, rows = r.good, r.rejects, r.prompts, r.rows
        users = good.column("user_id")  # [U]
        exclude, excluded = batch_exclusions(good, self.catalog, d)
        decoded = self._decode_batch(prompts, users, exclude)
        items, broken = decoded.items, decoded.broken
        rejects = pa.concat_tables([rejects, non_finite_rejects(users, broken), no_items_rejects(users, items, broken)])
        reject_rows = np.concatenate([r.reject_rows, rows[broken], rows[no_items(items, broken)]])  # [R]
        recs = recommendation_table(users, items, decoded.scores, d.mode)
        wall = time.perf_counter() - t0 - decoded.audit.get("audit_s", 0.0)  # the audit is reported as its own cost
        counts = batch_counts(batch.num_rows, items, broken, rejects.num_rows, recs.num_rows, prompts, self.prefix_len)
        metric = {**self._metric_row(counts, wall, decoded), **excluded, **prompts.fit_counts()}
        self.batches += 1
        return Recommended(rows, (items >= 0).sum(1), recs, rejects, reject_rows, metric)

    def _decode_batch(self, prompts: Prompts, users, exclude: Exclusions | None) -> Decoded:
        """The validated users' prompts [U, S] decoded by this batch's decoder (auto: the one whose turn it is), in
        slices that fit, ordered by prompt length (compute.order_by_length; the result in input order) -> Decoded
        (empty when no row was valid)."""
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
        """`_decode_batch` of the users in decode order (row i: input row order[i]); the first users in input order
        audited while the audit lasts."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ids, mask = prompts.input_ids.to(self.device), prompts.attention_mask.to(self.device)
        if mode == "beam" and self.engine_auto and self.engine_auto.choice is None:
            self.engine_auto.choose(self, ids, mask)
        first = self.batcher.first(len(ids), self.fits(mode, ids.shape[1], self.target, self.draft))
        decode = functools.partial(self.decode, mode, self.target, self.draft)
        rec, ended = self.batcher.slices(decode, ids, mask, users, first, exclude, holding(mode, self.draft))
        self.batcher.settle(ended, first)
        self.batch_engine = rec.stats.get("engine", "eager") if mode == "beam" else "eager"  # any slice eager: eager
        if self.auto:
            self.auto.record(mode, sum(rec.stats[key] for key in PHASES), len(users))
        broken = rec.stats["non_finite"].cpu().numpy()  # [U] NaN / inf log-probs: rejected, never a short list
        pick = self.audit.pick(np.nonzero(~broken)[0], order)
        audit = (
            self.audit.run(mode, ids, mask, users, rec, pick, exclude, self.slices, self._audit_need)
            if len(pick)
            else {}
        )
        items = rec.item_ids.cpu().numpy()  # [U, k]
        items[broken] = -1
        return Decoded(mode, items, rec.scores.float().cpu().numpy(), broken, rec.stats, audit)

    def slices(
        self, mode: str, ids, mask, users, target, draft, exclude: Exclusions | None = None, batch: int | None = None
    ) -> Recommendations:
        """The users [U, S] decoded by `mode` with these models (the actor's; the audit's float32 copies; the engine
        trials' reference copy) and the current engine, in slices of `batch` users (None: what fits them)."""
        own = target is self.target
        batch = batch or self.batcher.first(len(ids), self.fits(mode, ids.shape[1], target, draft), models=own)
        decode = functools.partial(self.decode, mode, target, draft)
        return self.batcher.slices(decode, ids, mask, users, batch, exclude, holding(mode, draft))[0]

    def fits(self, mode: str, prompt_len: int, target, draft) -> int | None:
        """On CUDA: the most users whose decode with these models fits in their device's free memory; else None."""
        return fitting(self.spec.decoding, prompt_len + self.prefix_len, self.catalog.code_len, mode, target, draft)

    def _audit_need(self, mode: str, prompt_len: int, roles: tuple) -> tuple[int, int, int]:
        """What the audit's float32 copies of `roles` need beside the run: `float32_need`."""
        models = [getattr(self, role) for role in roles]
        shape = (prompt_len + self.prefix_len, self.catalog.code_len, mode, self.target, self.draft)
        return float32_need(self.spec.decoding, *shape, models, self.batcher.decode_batch)

    def decode(self, mode: str, target, draft, ids, mask, users, exclude: Exclusions | None = None):
        """One decode of the users ids [U, S] by `mode`'s decoder with these models -> Recommendations. Sampling
        modes draw per user (decoding/draws.py), seeded by decoding.seed and the user's id: a user draws the same
        items in any batch (reordered, a halved slice, a retried or resumed shard)."""
        d, shared = self.spec.decoding, {"prefix": self.prefix, "exclude": exclude}
        catalog, answer = self.audit.index_on(target.device, self.catalog, self.answer)
        if mode == "beam" and target is self.target and self.engine == "compiled":
            run = functools.partial(beam_search, target, ids, mask, catalog, d.k, answer=answer, **shared)
            checked = self.engine_auto.checked if self.engine_auto and not self.trialing else None
            return self.compiled.beam(run, target, ids, checked)
        if mode == "beam":  # the eager engine: the reference, and the audit's and trials' reference dtypes
            return beam_search(target, ids, mask, catalog, d.k, engine="eager", answer=answer, **shared)
        draws = UserDraws(user_seeds(d.seed, users.to_pylist(), ids.device))
        shared.update(temperature=d.temperature, generator=draws)
        if mode == "disc":
            return disc_sample(target, ids, mask, catalog, d.k, rounds=d.rounds, top_m=d.top_m, **shared)
        drafting = {"draft_beams": d.draft_beams, "gamma": d.gamma, "verification": mode.removeprefix("atspeed-")}
        return speculative_beam_search(target, draft, ids, mask, catalog, d.k, **drafting, **shared)

    def _metric_row(self, counts: dict, wall: float, decoded: Decoded) -> dict:
        """One row per batch: ids, counts (batch_counts), the decoder's stats (decoder_metrics), the actor's state
        (its decode batch, auto mode, dtype, compile totals) and the precision audit's figures."""
        d, ok = self.spec.decoding, counts["users_ok"]
        note = decoded.stats.get("engine_note") or (self.engine_auto and self.engine_auto.note) or None
        return {
            "run_id": self.spec.run_id,
            "shard": f"{self.actor}:{self.batches}",
            "actor": self.actor,
            "batch": self.batches,
            **self.where,
            "mode": d.mode,
            "k": d.k,
            **counts,
            **decoder_metrics(decoded.stats, wall),
            **padding_metrics(decoded.stats),
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None,
            "decode_batch": self.batcher.decode_batch if ok else None,
            "actor_ready_at": self.ready_at if self.batches == 0 else None,  # on the actor's first batch only
            "users_per_s": ok / wall if wall > 0 else None,
            "users_non_finite": int(decoded.broken.sum()),
            "decoder": decoded.mode,
            "engine_note": note,
            "auto": auto_state(self.auto, self.engine_auto),
            "dtype": self.dtype,
            **decoded.audit,
            **self.compiled.since(self.target, self.batch_engine),
        }


def auto_state(auto: AutoMode | None, engine: AutoEngine | None) -> dict | None:
    """An actor's auto choices so far: decoding.mode auto's (choice, trial users/s, trial batches) and, under
    "engine", compute.engine auto's (AutoEngine.state)."""
    state = auto.state() if auto else {}
    if engine:
        state["engine"] = engine.state()
    return state or None


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


def fault_injection(batches: int) -> None:
    """Tests only (FAIL_AFTER_ENV "N:/path/marker"): the actor exits once, after N batches (a crash mid-run: Ray
    restarts the actor and retries the batch)."""
    spec = os.environ.get(FAIL_AFTER_ENV)
    if not spec:
        return
    after, marker = spec.split(":", 1)
    if batches >= int(after) and not Path(marker).exists():
        Path(marker).write_text(str(os.getpid()))
        os._exit(1)
