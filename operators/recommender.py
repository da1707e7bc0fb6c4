"""The Ray Data recommender actor: loads target, draft and catalog once; `__call__(batch)` is pure.

Output rows carry a `kind`: "rec" (user_id, rank, item_id, score, mode), "reject" (user_id, reason, detail) or
"metric" (one per batch, JSON in `metrics`), so that one map over the users yields all three tables.
"""
from __future__ import annotations

import json
import os
import socket
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.disc import disc_sample
from decoding.models import load_model, load_tokenizer
from decoding.speculative import speculative_beam_search
from operators.prompts import ItemTokens, build_prompts
from operators.validate import normalize
from pipeline.config import Config
from pipeline.storage import filesystem, local_model_dir

FAIL_AFTER_ENV = "GENREC_TEST_FAIL_AFTER"  # tests only: "N:/path/marker" exits the actor once, after N batches


def output_schema(user_type: pa.DataType) -> pa.Schema:
    return pa.schema([("kind", pa.string()), ("user_id", user_type), ("rank", pa.int32()), ("item_id", pa.int64()),
                      ("score", pa.float32()), ("mode", pa.string()), ("reason", pa.string()), ("detail", pa.string()),
                      ("metrics", pa.string())])


def read_catalog_table(cfg: Config) -> pa.Table:
    import pyarrow.parquet as pq

    fs, path = filesystem(cfg.catalog, cfg.storage)
    try:
        return pq.read_table(path, filesystem=fs)
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"catalog {cfg.catalog}: cannot be read as parquet ({e})") from None


class Recommender:
    def __init__(self, config: Config, run_id: str):
        self.cfg, self.run_id = config, run_id
        if config.compute.threads_per_actor:
            torch.set_num_threads(config.compute.threads_per_actor)
        use_gpu = config.compute.gpus_per_actor > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_gpu else "cpu")
        target_dir = local_model_dir(config.models.target, config.models.cache_dir, config.storage)
        self.target = load_model(target_dir, device=str(self.device), dtype=config.compute.dtype)
        self.tokenizer = load_tokenizer(target_dir)
        self.draft = None
        if config.decoding.mode.startswith("atspeed"):
            draft_dir = local_model_dir(config.models.draft, config.models.cache_dir, config.storage)
            self.draft = load_model(draft_dir, device=str(self.device), dtype=config.compute.dtype)
        items = read_catalog_table(config)
        self.catalog = Catalog.from_table(items, self.tokenizer, on_duplicate="first", device=self.device,
                                          source=config.catalog)
        self.item_tokens = ItemTokens.from_catalog(items, self.tokenizer, config.catalog)
        self.actor = _actor_id()
        self.host = socket.gethostname()
        self.batches = 0

    def __call__(self, batch: pa.Table) -> pa.Table:
        self._fault_injection()
        t0 = time.perf_counter()
        d = self.cfg.decoding
        user_type = batch.schema.field("user_id").type
        good, rejects = normalize(batch)
        p = build_prompts(good.column("history"), self.item_tokens, self.tokenizer.bos_token_id,
                          self.tokenizer.pad_token_id, d.history_len)
        users = good.column("user_id").take(pa.array(p.kept, pa.int64()))
        rejects += [(good.column("user_id")[row].as_py(), reason, detail) for row, reason, detail in p.bad]
        stats = {}
        if len(p.kept):
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rec = self._decode(p.input_ids.to(self.device), p.attention_mask.to(self.device), users)
            stats = rec.stats
            items, scores = rec.item_ids.cpu().numpy(), rec.scores.float().cpu().numpy()
        else:
            items, scores = np.zeros((0, d.k), np.int64), np.zeros((0, d.k), np.float32)
        wall = time.perf_counter() - t0
        alive = items >= 0  # [U, k]; fewer than k only when the catalog has fewer items
        rows = np.nonzero(alive)
        recs = {"kind": ["rec"] * len(rows[0]), "user_id": users.take(pa.array(rows[0])).to_pylist(),
                "rank": (rows[1] + 1).tolist(), "item_id": items[rows].tolist(), "score": scores[rows].tolist(),
                "mode": [d.mode] * len(rows[0])}
        metric = self._metric_row(len(batch), len(p.kept), len(rejects), int(p.attention_mask.sum()), wall, stats)
        metric["recommendations"] = len(rows[0])
        table = pa.concat_tables([
            pa.Table.from_pydict(recs, schema=_subset(output_schema(user_type), recs)),
            pa.Table.from_pydict({"kind": ["reject"] * len(rejects), "user_id": [r[0] for r in rejects],
                                  "reason": [r[1] for r in rejects], "detail": [r[2] for r in rejects]},
                                 schema=_subset(output_schema(user_type), ["kind", "user_id", "reason", "detail"])),
            pa.Table.from_pydict({"kind": ["metric"], "metrics": [json.dumps(metric)]},
                                 schema=_subset(output_schema(user_type), ["kind", "metrics"])),
        ], promote_options="default")
        self.batches += 1
        return table.select(output_schema(user_type).names).cast(output_schema(user_type))

    def _decode(self, ids, mask, users):
        d = self.cfg.decoding
        if d.mode == "beam":
            return beam_search(self.target, ids, mask, self.catalog, d.k)
        # sampling modes: a generator seeded by the batch's users, so a retried batch draws the same items
        g = torch.Generator(device=self.device).manual_seed(
            (d.seed * 1_000_003 + zlib.crc32(str(users.to_pylist()).encode())) % (2 ** 63))
        if d.mode == "disc":
            return disc_sample(self.target, ids, mask, self.catalog, d.k, rounds=d.rounds, top_m=d.top_m,
                               temperature=d.temperature, generator=g)
        return speculative_beam_search(self.target, self.draft, ids, mask, self.catalog, d.k,
                                       draft_beams=d.draft_beams, gamma=d.gamma,
                                       verification=d.mode.removeprefix("atspeed-"), temperature=d.temperature,
                                       generator=g)

    def _metric_row(self, users_in, users_ok, rejected, tokens, wall, stats) -> dict:
        d = self.cfg.decoding
        accepted = stats.get("accepted_steps")
        rounds = stats.get("rounds")
        phases = {name: float(stats.get(name, 0.0)) for name in ("prefill_s", "draft_s", "verify_s")}
        phases["decode_s"] = max(wall - sum(phases.values()), 0.0)
        return {
            "run_id": self.run_id, "shard": f"{self.actor}:{self.batches}", "actor": self.actor, "host": self.host,
            "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu", "mode": d.mode,
            "k": d.k, "users_in": users_in, "users_ok": users_ok, "users_rejected": rejected, "tokens": tokens,
            "wall_s": wall, **phases,
            "target_forwards": int(stats.get("target_forwards", 0)), "draft_forwards": int(stats.get("draft_forwards", 0)),
            "mean_accepted_steps": float((accepted.float() / rounds.clamp(min=1).float()).mean())
            if accepted is not None and len(accepted) else None,
            "accepted_hist": stats["accepted_hist"].tolist() if "accepted_hist" in stats else None,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None,
            "kv_tokens": stats.get("kv_tokens"), "kv_tokens_beam_batch": stats.get("kv_tokens_beam_batch"),
            "users_per_s": users_ok / wall if wall > 0 else None,
        }

    def _fault_injection(self) -> None:
        spec = os.environ.get(FAIL_AFTER_ENV)
        if not spec:
            return
        after, marker = spec.split(":", 1)
        if self.batches >= int(after) and not Path(marker).exists():
            Path(marker).write_text(str(os.getpid()))
            os._exit(1)  # a crash mid-run: Ray restarts the actor and retries the batch


def _subset(schema: pa.Schema, names) -> pa.Schema:
    return pa.schema([schema.field(n) for n in names])


def _actor_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_actor_id() or f"pid{os.getpid()}"
    except Exception:  # outside Ray (direct calls in tests)
        pass
    return f"pid{os.getpid()}"
