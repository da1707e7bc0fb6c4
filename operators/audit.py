"""The precision audit of a half-precision actor: its first `compute.audit_users` users decoded again by float32
copies of its models, and their lists compared with the half-precision ones (the metric row's audit_* figures).

It owns who is audited (the actor's first users, across shards, until the count is reached), where the float32
copies go (on the actor's device when they fit there beside the run's models and decode batch, else on the CPU, else
nowhere: the audit is skipped and says why; decoding/memory.py audit_placement), their lifetime (loaded from the
models' folders on first use, freed when the audit is done) and the comparison (decoding/metrics.py
topk_agreement). The decode itself is the actor's, with the float32 models in place of its own.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import torch

from decoding.beam import Recommendations
from decoding.catalog import Exclusions
from decoding.memory import audit_placement, decode_bytes_per_user, free_device_memory, host_free_memory
from decoding.metrics import topk_agreement
from decoding.models import load_model

SAMPLING = ("atspeed-relaxed", "disc")  # modes whose items are draws (per user: decoding/draws.py)
Decode = Callable[..., Recommendations]  # (mode, ids, mask, users, target, draft, exclude) -> the lists of those models
Need = Callable[[str, int, tuple], tuple[int, int, int]]
# ^ (mode, prompt length, roles) -> the float32 weights of those roles' models, one user's float32 decode, the run's
#   decode batch beside them, in bytes


def float32_need(d, prompt_tokens: int, levels: int, mode: str, target, draft, models: list, beside: int) -> tuple:
    """What float32 copies of `models` (the run's target, and its draft for a speculative mode) need to audit a
    `mode` decode of prompts of `prompt_tokens` tokens beside the run's decode batch of `beside` users -> (their
    weights, one user's float32 decode, the run's batch beside them) in bytes (audit_placement's sizes)."""
    weights = sum(p.numel() for m in models for p in m.parameters()) * 4
    args, drafting = (prompt_tokens, d.k, levels), (mode, draft, d.draft_beams, d.gamma)
    per_user = decode_bytes_per_user(target, *args, torch.float32, *drafting)
    return weights, per_user, beside * decode_bytes_per_user(target, *args, target.dtype, *drafting)


class PrecisionAudit:
    def __init__(self, users: int, device: torch.device, paths: dict):
        self.left = users  # users still to audit (0: none, or done)
        self.device, self.paths = device, paths  # the actor's device; role -> the model's folder
        self.float32: dict = {}  # role -> its float32 copy, loaded on first use, freed when the audit is done
        self.where = "cpu"  # where the copies went: gpu (beside the run) or cpu
        self.on_cpu: tuple | None = None  # (catalog, answer) on the CPU: for float32 copies that went there

    def pick(self, ok: np.ndarray, order: np.ndarray) -> np.ndarray:
        """The decoded users that are fine, ok [U'] (rows in decode order; row i is input row order[i]) -> the first
        of them in input order, as many as the audit still takes."""
        return ok[np.argsort(order[ok], kind="stable")][: self.left]

    def run(
        self, mode: str, ids, mask, users, rec: Recommendations, pick, exclude: Exclusions | None, decode, need
    ) -> dict:
        """The users at `pick` (rows of this batch, decoded in half precision into `rec`) decoded again by the float32
        models with the same mode (`decode`) -> their agreement (metrics keys audit_*). A sampling mode's draws are
        per user, the same in both precisions' decodes. Where no copy fits, the audit is skipped and says why
        (audit_skipped)."""
        t0 = time.perf_counter()
        sel = torch.as_tensor(pick, device=ids.device)
        ids, mask, users = ids[sel], mask[sel], users.take(pa.array(pick))
        exclude = exclude.select(sel) if exclude is not None else None
        first = int(mask.any(0).nonzero()[0])  # left padding no audited user needs
        ids, mask = ids[:, first:], mask[:, first:]
        f32, skipped = self.models(mode, ids.shape[1], need)
        if skipped:
            self.left = 0
            self.free()  # a copy loaded for an earlier batch (the target's, before a speculative batch's draft)
            return {"audit_skipped": skipped}
        on = f32[0].device  # the float32 copies' device: the actor's, or the CPU
        moved = exclude.to(on) if exclude is not None else None
        ref = decode(mode, ids.to(on), mask.to(on), users, *f32, moved)
        agree = topk_agreement(*(t.cpu() for t in (ref.item_ids, ref.scores, rec.item_ids[sel], rec.scores[sel])))
        self.left -= len(pick)
        if not self.left:
            self.free()
        return {
            "audit_users": len(pick),
            "audit_identical_lists": int(agree["identical"].sum()),
            "audit_topk_overlap_sum": float(agree["overlap"].sum()),
            "audit_max_abs_score_diff": float(agree["score_diff"].max()),
            "audit_s": time.perf_counter() - t0,
            "audit_device": self.where,
        }

    def models(self, mode: str, prompt_len: int, need: Need) -> tuple[tuple, str]:
        """The audit's (target, draft) in float32, loaded from the models' folders on first use, on the device when
        they fit beside the run's models and decode batch, else on the CPU (audit_placement) -> (them, "") or
        ((), why the audit is skipped)."""
        roles = ("target", "draft") if mode.startswith("atspeed") else ("target",)
        if any(role not in self.float32 for role in roles):
            where, why = audit_placement(*need(mode, prompt_len, roles), *self.budget())
            if where == "cpu" and self.device.type != "cpu" and mode in SAMPLING:
                where, why = None, f"{mode} draws differ between devices: its audit needs the float32 copies on the GPU"
            if where is None:
                return (), why
            self.where = "gpu" if where == "device" else "cpu"
            device = "cpu" if where == "cpu" else str(self.device)  # "device" on a CPU actor: a simulated budget
            for role in roles:
                self.float32[role] = load_model(self.paths[role], device=device, dtype="float32")
        return (self.float32["target"], self.float32.get("draft")), ""

    def index_on(self, device: torch.device, catalog, answer) -> tuple:
        """The actor's catalog index and scored answer on `device`'s kind: its own, or a CPU copy made once (for
        float32 copies of the models that went to the CPU)."""
        if device.type == self.device.type:
            return catalog, answer
        if self.on_cpu is None:
            self.on_cpu = (catalog.to("cpu"), answer.cpu() if answer is not None else None)
        return self.on_cpu

    def budget(self) -> tuple[int | None, int]:
        """(the device's free bytes, None without a GPU; the host's available bytes)."""
        return free_device_memory(self.device), host_free_memory()

    def free(self) -> None:
        """Done for this run: the float32 copies leave the device."""
        self.float32.clear()
        self.on_cpu = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
