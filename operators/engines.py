"""How an actor picks its decoder and engine: decoding.mode auto (`AutoMode`: beam search or strict speculation,
whichever its trial batches decode faster; their lists are identical) and compute.engine auto (`AutoEngine`: one
decision per run, from trial users decoded by both engines and in the next wider dtype, with parity against what the
run's dtype costs, recorded in the run so that every actor, restart and resume uses it).

AutoEngine owns the decision: the trials (`choose`), the evidence (`engine_parity`, `dtype_noise`), the record it
adopts, and the buckets the compiled engine may run in. What it uses of the actor (`r`): its spec, models, device and
inputs (`r.catalog`, `r.renderer`), its compiled engine (`r.compiled`, `r.warm_up`) and its sliced decode (`r.slices`),
whose engine it switches while the trials run (`r.engine`, `r.trialing`).
"""

from __future__ import annotations

import os
import time

import pyarrow as pa
import torch

from decoding.beam import Recommendations
from decoding.memory import decode_bytes_per_user, free_device_memory, host_free_memory, usable_bytes
from decoding.metrics import same_within_ties, topk_agreement
from decoding.models import load_model
from operators.spec import ActorSpec
from operators.validate import validate

SKEW_ENV = "GENREC_TEST_ENGINE_SKEW"  # tests only: "1" makes the compiled engine's trial lists differ from eager's


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

    # ---------------------------------------------------------------- the trials, at the actor's first beam batch

    def choose(self, r, ids, mask) -> None:
        """The run's recorded decision, else this actor's trials (on the spec's trial users, else on this batch's
        prompts ids [U, S]) recorded as the run's unless another actor recorded one first (then that one); the
        compiled engine's bucket compiled if chosen (`r.warm_up`)."""
        record = r.spec.engine_record
        recorded = record.read() if record is not None else None
        if recorded is None:
            why = exclusions_set(r.spec)
            if why:
                self.decide("eager", why)
            else:
                self.trials(r, self.groups_of(r, ids, mask))
            mine = self.decision(r.actor)
            recorded = record.claim(mine) if record is not None and not self.local else mine
            if self.local:  # this actor's own failure: it decodes eager; the run's decision is left to the others
                self.note = f"this actor decodes eager ({self.reason}); the run's decision is not recorded by it"
        self.adopt(recorded)
        r.engine = self.choice
        if self.choice == "compiled" and not r.compiled.warm:
            r.warm_up()

    @staticmethod
    def groups_of(r, ids, mask) -> list[tuple]:
        """The trial users' prompts in groups of one decode batch (spec.warm_users): the spec's trial users (the
        input's first, the same for every actor and attempt) when any is valid, else this batch's prompts [U, S]."""
        trial = trial_prompts(r)
        ids, mask = trial if trial is not None else (ids, mask)
        n = max(r.spec.warm_users, 1)
        return [(ids[i : i + n], mask[i : i + n]) for i in range(0, ids.shape[0], n)]

    def trials(self, r, groups: list[tuple]) -> None:
        """Trial groups decoded with both engines in turn, and in the reference dtype (what the run's dtype costs),
        until a decision or the groups run out (inconclusive: eager). None runs when the reference copy would not fit
        (this actor stays eager; the run's decision is left to others)."""
        if groups and (why := reference_does_not_fit(r, *groups[0][0].shape)):
            self.decide("eager", f"inconclusive on this actor, no trial run: {why}", local=True)
            return
        r.trialing, ref = True, None
        try:
            for ids, mask in groups[: self.max_groups]:
                runs = self.both_engines(r, ids, mask)
                if runs is None:
                    return
                ref = ref or load_model(r.paths["target"], str(r.device), reference_dtype(r.target.dtype))
                reference = r.slices("beam", ids, mask, pa.nulls(len(ids)), ref, None, batch=len(ids))
                self.record(
                    runs["eager"][0],
                    runs["compiled"][0],
                    dtype_noise(runs["eager"][0], reference),
                    (runs["eager"][1], runs["compiled"][1]),
                )
                if self.choice:
                    return
            self.inconclusive()
        except torch.OutOfMemoryError as e:
            self.decide("eager", f"the engine trials ran out of memory: {e}"[:300], local=True)
        finally:
            r.engine, r.trialing = "eager", False
            del ref
            if r.device.type == "cuda":
                torch.cuda.empty_cache()

    def both_engines(self, r, ids, mask) -> dict | None:
        """One trial group decoded by both engines, in this trial's order -> {engine: (lists, seconds per user)};
        None once a decision is taken without them (the compile failed, the run is too short, the compiled engine
        did not run)."""
        runs = {}
        for engine in self.order():
            if engine == "compiled" and not self.warm_up(r):
                return None
            runs[engine] = self.trial_decode(r, engine, ids, mask)
            if engine == "eager" and not self.groups and self.too_short(runs["eager"][1]):
                return None
        if runs["compiled"][0].stats.get("engine") != "compiled":
            note = runs["compiled"][0].stats.get("engine_note")
            self.decide("eager", f"the compiled engine did not run: {note}", local=True)
            return None
        return runs

    def warm_up(self, r) -> bool:
        """The compiled engine's bucket compiled for the trials (timed: what the compiled engine costs) -> whether it
        compiled (if not, the choice is eager, with the error)."""
        if not r.compiled.warm:
            t0 = time.perf_counter()
            r.warm_up()
            self.compile_s += time.perf_counter() - t0
        if r.compiled.errors:
            self.decide("eager", "compile failed: " + "; ".join(r.compiled.errors.values()), local=True)
            return False
        return True

    def trial_decode(self, r, engine: str, ids, mask) -> tuple[Recommendations, float]:
        """A trial group's prompts [U, S] decoded by `engine` -> (its lists, decode seconds per user); the compiled
        engine's bucket counts as checked."""
        r.engine = engine
        t0 = time.perf_counter()
        rec = r.slices("beam", ids, mask, pa.nulls(len(ids)), r.target, None)
        compile_s = rec.stats.get("compile_s", 0.0)
        self.compile_s += compile_s
        seconds = (time.perf_counter() - t0 - compile_s) / len(ids)
        if engine == "compiled" and rec.stats.get("engine") == "compiled":
            self.checked.add((int(rec.stats["bucket_users"]), int(rec.stats["bucket_prompt"])))
        if engine == "compiled" and os.environ.get(SKEW_ENV):  # tests only: an engine that differs
            rec = Recommendations(rec.item_ids.roll(1, 1), rec.token_ids, rec.scores, rec.stats)
        return rec, seconds


def trial_prompts(r) -> tuple | None:
    """compute.engine auto's trial users (the input's first, the same for every actor and attempt) as prompts ids,
    mask [U, S] on the actor's device; None when there are none, or none valid."""
    t = r.spec.trial_users
    if t is None:
        return None
    renderer = r.renderer
    good, _ = validate(
        t, r.catalog.item_tokens, renderer.windows, r.spec.decoding.exclude_column, renderer.user_columns
    )
    p = renderer.render(good, r.catalog.item_tokens, r.prefix_len) if good.num_rows else None
    if p is None or not len(p.input_ids):
        return None
    return p.input_ids.to(r.device), p.attention_mask.to(r.device)


def exclusions_set(spec: ActorSpec) -> str | None:
    """Why the run decodes eager before any trial: per-user exclusions (decoding.exclude history, or the input's
    exclusion column), under which the compiled engine decodes eager; None when there are none."""
    d, t = spec.decoding, spec.trial_users
    if d.exclude != "none":
        return f"per-user exclusions (decoding.exclude {d.exclude}): the compiled engine decodes them eager"
    if d.exclude_column and t is not None and d.exclude_column in t.column_names:
        return f"per-user exclusions (the input's {d.exclude_column} column): the compiled engine decodes eager"
    return None


def reference_does_not_fit(r, users: int, prompt_len: int) -> str | None:
    """Why the trials' reference-dtype copy of the target and a trial group of `users` prompts of `prompt_len`
    tokens decoded by it do not fit beside the run's models (the device's usable memory, or the host's on a CPU
    actor; decoding/memory.py), None when they fit."""
    wide = reference_dtype(r.target.dtype)
    weights = sum(p.numel() for p in r.target.parameters()) * torch.finfo(wide).bits // 8
    d = r.spec.decoding
    per_user = decode_bytes_per_user(r.target, prompt_len + r.prefix_len, d.k, r.catalog.code_len, wide)
    device_free = free_device_memory(r.device)
    free = device_free if device_free is not None else host_free_memory()
    need = weights + users * per_user
    if need <= usable_bytes(free):
        return None
    return f"the {wide} reference copy and its decode need {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
