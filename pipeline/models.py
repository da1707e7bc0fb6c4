"""Model directories as users bring them: attach the prompt template a model was trained with, checked first; and
what travels with the models: the compiled engine's cache in object storage (`CompileStore`)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch

from decoding.catalog import Catalog
from decoding.models import load_config, load_tokenizer
from decoding.templates import PromptTemplate, get_template, write_template
from operators.prompts import Renderer, catalog_probes
from pipeline import storage as S
from pipeline.config import Storage

log = logging.getLogger("genrec.nightly")


def attach_template(model_dir, template: str | PromptTemplate, catalog, max_items: int | None = None) -> dict:
    """Writes `template` (a preset, a JSON file or a template) into a local model directory after checking it against
    the model and a catalog (items.parquet): a causal LM, every code token the catalog needs in its tokenizer, the
    template compiling against the tokenizer -> a summary (the template, its longest prompt in tokens)."""
    model_dir = Path(model_dir)
    load_config(model_dir)
    template = get_template(template).with_max_items(max_items)
    tokenizer = load_tokenizer(model_dir)
    cat = Catalog.from_table(
        pq.read_table(catalog), tokenizer, on_duplicate="first", source=str(catalog), code_token=template.code
    )
    renderer = Renderer.compile(template, tokenizer, catalog_probes(cat.item_tokens))
    path = write_template(model_dir, template)
    return {"file": str(path), "template": template.to_dict(), "max_prompt_tokens": renderer.max_len}


# ---------------------------------------------------------------- the compiled engine's cache, beside the models


@dataclass(frozen=True)
class CompileStore:
    """The compiled engine's cache in object storage (or a shared folder), beside the models: under `root`, one
    folder per `decoding.compiled.compile_key` (torch version, device and capability, the model's sha256 and dtype,
    the bucket) holding `cache-<sha256>.tar.gz` (inductor's cache folder after a compile) and `cache.json` (written
    last: the archive's name, sha256 and size, the torch version and device it was built with). Every failure reads as
    "no cache" (a cold compile, with a warning), never as an error: a missing or partial upload, a checksum that does
    not match, a foreign cache. Several actors uploading one key at once is safe: each archive is named by its
    content and written before the `cache.json` that points at it, which is one whole object (last writer wins)."""

    root: str
    storage: Storage

    def fetch(self, key: str, folder: str) -> dict:
        """Downloads, verifies and unpacks the cache of `key` into `folder` -> what happened {"found", "used", "note",
        "bytes", "seconds"}."""
        t0 = time.perf_counter()
        out = {"found": False, "used": False, "note": "", "bytes": 0}
        try:
            raw = S.read_bytes(S.join(self.root, key, CACHE_META), self.storage)
            if raw is None:
                out["note"] = "no cache for this key"
            else:
                out["found"] = True
                meta = json.loads(raw)
                why = foreign(meta, key)
                data = None if why else S.read_bytes(S.join(self.root, key, meta["archive"]), self.storage)
                if why is None and data is None:
                    why = f"{meta['archive']} is missing (a partial upload)"
                if why is None and (len(data) != meta["bytes"] or hashlib.sha256(data).hexdigest() != meta["sha256"]):
                    why = f"{meta['archive']} does not match its checksum"
                if why is None:
                    unpack(data, Path(folder))
                    out.update(used=True, bytes=len(data), note="verified and unpacked")
                else:
                    out["note"] = why
        except Exception as e:  # noqa: BLE001 -- a cache that cannot be read is a cold compile, never a failure
            out["note"] = f"unreadable ({type(e).__name__}: {e})"[:300]
        if out["found"] and not out["used"]:
            log.warning("compile cache %s ignored: %s; compiling cold", S.join(self.root, key), out["note"])
        return {**out, "seconds": time.perf_counter() - t0}

    def publish(self, key: str, folder: str) -> dict:
        """Uploads `folder` (inductor's cache after a successful compile) as the cache of `key` -> {"uploaded",
        "bytes", "seconds", "note"}; a failure is logged and reported, not raised."""
        t0 = time.perf_counter()
        try:
            data = pack(Path(folder))
            sha = hashlib.sha256(data).hexdigest()
            archive = f"cache-{sha[:32]}.tar.gz"
            S.write_bytes(S.join(self.root, key, archive), data, self.storage)
            meta = {"archive": archive, "sha256": sha, "bytes": len(data), "key": key, "torch": torch.__version__}
            S.write_bytes(S.join(self.root, key, CACHE_META), json.dumps(meta).encode(), self.storage)
            out = {"uploaded": True, "bytes": len(data), "note": ""}
        except Exception as e:  # noqa: BLE001 -- the run goes on without a shared cache
            log.warning("compile cache %s not uploaded: %s", S.join(self.root, key), e)
            out = {"uploaded": False, "bytes": 0, "note": f"{type(e).__name__}: {e}"[:300]}
        return {**out, "seconds": time.perf_counter() - t0}


CACHE_META = "cache.json"


def foreign(meta: dict, key: str) -> str | None:
    """Why a cache.json does not describe a cache of `key` built by this torch (None: it does)."""
    if not isinstance(meta, dict) or not {"archive", "sha256", "bytes", "key", "torch"} <= set(meta):
        return "cache.json is not a cache description"
    if meta["key"] != key or meta["torch"] != torch.__version__:
        return f"a foreign cache (built for {meta['key']} with torch {meta['torch']})"
    if "/" in meta["archive"] or not meta["archive"].startswith("cache-"):
        return f"cache.json names an archive outside its folder: {meta['archive']!r}"
    return None


def pack(folder: Path) -> bytes:
    """Inductor's cache folder -> a tar.gz of its regular files (its lock files left out)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if path.is_file() and not path.is_symlink() and rel.parts[0] != "locks":
                tar.add(path, arcname=str(rel), recursive=False)
    return buf.getvalue()


def unpack(data: bytes, folder: Path) -> None:
    """A verified archive -> its regular files under `folder` (tarfile's "data" filter: nothing outside the folder,
    no links or devices)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")


def compile_store(cfg) -> CompileStore | None:
    """compute.compile_store: "auto" -> beside the target model when it is on object storage
    (`<models.target>.compile-cache`), else none; "none" -> none; a URI or folder -> there."""
    where = cfg.compute.compile_store
    if where == "none" or (where == "auto" and not S.is_s3(cfg.models.target)):
        return None
    root = cfg.models.target.rstrip("/") + ".compile-cache" if where == "auto" else where
    return CompileStore(root, cfg.storage)
