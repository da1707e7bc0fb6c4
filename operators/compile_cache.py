"""The compiled engine in an actor: its cache folders on the node, private to the user the actors run as (inductor
runs the code it finds there: it unpickles graphs, imports wrapper modules, loads shared objects), and its state:
the bucket it compiled at start, the buckets that failed, where a decode may run compiled, what it compiled."""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from pathlib import Path

import torch

from decoding.beam import Recommendations
from decoding.compiled import (
    Bucket,
    Engine,
    cold_compiles,
    compile_key,
    compile_totals,
    unsupported,
    use_compile_cache,
    warm_up,
)

log = logging.getLogger("genrec.actor")


def private_dirs(base: Path, leaf: Path) -> None:
    """Every folder from `base` down to `leaf`, made where missing with mode 0700 -> None; ValueError naming the first
    folder that another user could write: one below base that another user owns, that group or others may write or
    that is a link; base itself followed (an operator's link), owned by this user and writable by no one else; and
    every folder above base writable by no one but its owner (this user or root) unless sticky (/tmp), so that nobody
    can swap base for another folder."""
    rel = leaf.relative_to(base).parts
    for depth in range(len(rel) + 1):
        path = base.joinpath(*rel[:depth])
        try:
            path.mkdir(mode=0o700, parents=depth == 0, exist_ok=True)
            st = path.stat() if depth == 0 else path.lstat()
        except OSError as e:  # a file where a folder goes, a dangling link
            raise ValueError(f"compile cache folder {path} cannot be made ({e.strerror})") from None
        if depth == 0:  # the folders above base, now that they exist
            for parent in reversed(base.parents):
                _check(parent, parent.stat(), above=True)
        _check(path, st, above=False)


def _check(path: Path, st: os.stat_result, above: bool) -> None:
    owner_ok = st.st_uid in ((os.geteuid(), 0) if above else (os.geteuid(),))
    shared = bool(st.st_mode & 0o022) and not (above and st.st_mode & stat.S_ISVTX)
    if not stat.S_ISDIR(st.st_mode) or not owner_ok or shared:
        raise ValueError(
            f"compile cache folder {path} is not private (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}; "
            f"this process runs as uid {os.geteuid()}): whoever can write it can plant code the actors load. Give it "
            "to this user with mode 0700, or set compute.compile_cache to a private folder"
        )


# ------------------------------------------------------------------ the actor's compiled engine

COMPILED_EXTRAS = {  # the compiled engine's extra stats, set on an eager fallback too (so that slices concatenate)
    "engine": "eager",
    "engine_note": "",
    "bucket_users": 0,
    "bucket_prompt": 0,
    "compile_s": 0.0,
    "graphs_compiled": 0,
}


class CompiledEngine:
    """An actor's compiled beam-search engine (decoding/compiled.py). It owns the bucket compiled at the actor's start
    (`warm_up`: from the node's compile cache, and the compile store's signed archive when one is set), the buckets
    that failed to compile (they decode eager, saying why), where a decode may run compiled (`beam`: under
    compute.engine auto, only in the buckets the trials checked) and what it compiled since the last metric row
    (`since`)."""

    def __init__(self, spec, device: torch.device, levels: int):
        self.spec, self.device = spec, device  # the ActorSpec: k, compile_store, compile_cache, target_sha256
        self.levels = levels  # the catalog's codes per item
        self.warm = False  # the bucket compiled at start (or its compile failed)
        self.errors: dict[tuple[int, int], str] = {}  # bucket (users, prompt) -> why it did not compile
        self.reported = 0  # compile errors reported in metric rows so far
        self.cache: dict | None = None  # what the warm-up found in and gave to the compile store, reported once
        self.totals = (0.0, 0)  # compile seconds and graphs reported in metric rows so far

    def warm_up(self, target, catalog, users: int, prompt: int, prefix) -> None:
        """The bucket of `users` prompts of `prompt` tokens compiled (a dummy batch; every decode of a shard snaps to
        it), from the node's compile cache (`node_cache`); after a cold compile into a fresh folder the cache is
        sealed, uploaded (signed) to the store and renamed into the node's place. A compile error is recorded for the
        bucket, which then decodes eager. What happened goes into the actor's next metric row (`compile_cache`)."""
        k, store = self.spec.decoding.k, self.spec.compile_store
        prefix_len = len(prefix) if prefix is not None else 0
        key = compile_key(target, self.spec.target_sha256, users, prompt, k, self.levels, prefix_len)
        folder, fresh, fetched = self.node_cache(key)
        cold = cold_compiles()
        self.warm = True
        try:
            warm_up(target, catalog, users, prompt, k, prefix)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 -- an image without a C++ compiler, an inductor bug: this bucket runs eager
            bucket = Bucket.of(users, prompt, k, self.levels)
            self.failed((bucket.users, bucket.prompt), e)
        cold = cold_compiles() - cold
        uploaded = None
        if store is not None and fresh is not None and cold and not self.errors:  # compiled here: published
            uploaded = store.compiled(key, fresh, folder, self.device)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder if uploaded["placed"] else str(fresh)
        self.cache = {"key": key, "graphs_cold": cold, "fetched": fetched, "uploaded": uploaded}

    def node_cache(self, key: str) -> tuple[str | None, Path | None, dict | None]:
        """Where inductor's cache goes for the bucket `key` -> (the node folder, the fresh folder a cold compile fills
        (None: the node folder verified), what the store fetch did). With a compile store and its key: the node's
        verified folder (`CompileStore.node_folder`, its manifest checked, else filled from the store's verified
        archive), else a fresh folder beside it; otherwise the node's compile cache as it is (no store). A cache
        folder others could write is never used: a private temporary one instead."""
        store, cache = self.spec.compile_store, self.spec.compile_cache
        if not cache:
            return None, None, None
        try:
            if store is None or not store.keyed():  # inductor's own cache: private, as the signed one
                private_dirs(Path(cache).expanduser(), Path(cache).expanduser())
                use_compile_cache(cache)
                return None, None, store.fetch(key, cache, self.device) if store else None
            folder = store.node_folder(cache, key, self.device)
        except ValueError as e:  # nothing loaded from it or placed in it
            log.warning("%s; this actor compiles cold into a private temporary folder", e)
            fresh = Path(tempfile.mkdtemp(prefix="genrec-compile-"))
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh)
            return None, fresh, {"found": False, "used": False, "note": str(e)[:300], "bytes": 0, "seconds": 0.0}
        fetched = store.fetch(key, folder, self.device)
        fresh = None if fetched["used"] else store.cold_folder(Path(folder))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh or fetched["folder"])
        return folder, fresh, fetched

    def failed(self, bucket: tuple[int, int] | None, error: Exception) -> str:
        """Records a compile error for the bucket (users, prompt), which decodes eager on this actor -> the note."""
        msg = f"{type(error).__name__}: {error}"[:500]
        self.errors[bucket] = msg
        log.warning("the compiled engine's bucket %s failed to compile; it decodes eager: %s", bucket, msg)
        return f"compile failed: {msg}"

    def bucket(self, target, ids) -> tuple[int, int] | None:
        """The bucket (users, prompt) for the prompts ids [U, S]: the warm one it snaps to, else its own; None for a
        model the compiled engine does not run (it decodes eager, saying why)."""
        if unsupported(target):
            return None
        b = Engine.of(target).bucket_for(ids.shape[0], ids.shape[1], self.spec.decoding.k, self.levels)
        return b.users, b.prompt

    def beam(self, run, target, ids, checked: set | None) -> Recommendations:
        """Beam search of the prompts ids [U, S] (`run(engine=...)`: beam_search of them) by the compiled engine where
        it may run: in a bucket that compiled without error and, given `checked` (compute.engine auto's trials are
        over), one they checked; else eager (stats: engine, the reason in engine_note). Every result carries the
        compiled engine's extra stats, so that slices concatenate."""
        bucket = self.bucket(target, ids)
        why = f"compile failed: {self.errors[bucket]}" if bucket in self.errors else None
        if why is None and bucket and checked is not None and bucket not in checked:
            why = f"the engine trials did not check bucket {bucket} (users, prompt): it decodes eager"
        rec = None
        if why is None:
            try:
                rec = run(engine="compiled")
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 -- a compile error: this bucket decodes eager on this actor
                why = self.failed(bucket, e)
        if rec is None:
            rec = run(engine="eager")
            rec.stats.update(engine="eager", engine_note=why)
        for key, value in COMPILED_EXTRAS.items():
            rec.stats.setdefault(key, value)
        return rec

    def since(self, target, engine: str) -> dict:
        """The batch's engine, and the seconds and graphs compiled since the last metric row (the first row: the
        warm-up's too), the compile errors and the compile cache's report, each reported once."""
        seconds, graphs = compile_totals(target)
        (s0, g0), self.totals = self.totals, (seconds, graphs)
        cache, self.cache = self.cache, None
        errors = list(self.errors.items())[self.reported :]
        self.reported = len(self.errors)
        return {
            "compile_errors": json.dumps({f"{u}x{p}": why for (u, p), why in errors}) if errors else None,
            "engine": engine,
            "compile_s": seconds - s0,
            "graphs_compiled": graphs - g0,
            "graphs_cold": cache["graphs_cold"] if cache else None,
            "compile_cache": json.dumps(cache) if cache else None,
        }
