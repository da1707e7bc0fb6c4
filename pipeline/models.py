"""Model directories as users bring them: attach the prompt template a model was trained with, checked first; and
what travels with the models: the compiled engine's cache in object storage (`CompileStore`)."""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import io
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from decoding.catalog import Catalog
from decoding.models import load_config, load_tokenizer
from decoding.templates import TEMPLATE_FILE, PromptTemplate, get_template, read_template, write_template
from operators.compile_cache import private_dirs
from operators.prompts import Renderer, catalog_probes
from pipeline import storage as S
from pipeline.storage import Storage

log = logging.getLogger("genrec.nightly")


def attach_template(
    model_dir, template: str | PromptTemplate, catalog, max_items: int | None = None, chat_template=None
) -> dict:
    """Writes `template` (a preset, a JSON file or a template) into a local model directory after checking it against
    the model and a catalog (items.parquet): a causal LM, every code token the catalog needs in its tokenizer, the
    template compiling against the tokenizer -> a summary (the template, its longest prompt in tokens).
    `chat_template`: a jinja file copied into the model directory first, under the name the template gives it (the
    template's chat template from then on: part of the model, hashed and uploaded with it)."""
    template = get_template(template).with_max_items(max_items)
    if chat_template is not None:
        if not template.messages:
            raise ValueError(f"--chat-template: prompt template {template.name!r} has no messages to write with it")
        template = replace(template, chat_template=template.chat_template or Path(chat_template).name)
        shutil.copyfile(chat_template, Path(model_dir) / template.chat_template)
    renderer = check_renders(model_dir, template, pq.read_table(catalog), str(catalog))
    path = write_template(model_dir, template)
    return {"file": str(path), "template": template.to_dict(), "max_prompt_tokens": renderer.max_len}


def check_renders(model_dir, template: PromptTemplate, catalog: pa.Table, source: str) -> Renderer:
    """A model directory's config, tokenizer and `template` checked against a catalog: a causal LM, every code token
    the catalog's items need in the tokenizer, prompts of the catalog's items rendered with the code tokens kept apart
    from the text -> the compiled Renderer."""
    load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    cat = Catalog.from_table(catalog, tokenizer, on_duplicate="first", source=source, code_token=template.code)
    return Renderer.compile(template, tokenizer, catalog_probes(cat.item_tokens), catalog, model_dir)


# ---------------------------------------------------------------- uploading a model to object storage

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def missing_parts(model_dir: Path) -> list[str]:
    """What a model folder lacks to be uploaded (nothing read but the file names) -> one line per missing part,
    [] when complete: config.json, safetensors weights, a tokenizer, the prompt template; no pickled file."""
    names = {p.name for p in S.model_files(model_dir)}
    missing = [] if "config.json" in names else ["config.json (the model's configuration)"]
    if not any(n.endswith(".safetensors") for n in names):
        missing.append("*.safetensors weights (save with save_pretrained: safetensors is its default)")
    if not names & set(TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)}: tokenizer.save_pretrained into the folder)")
    if TEMPLATE_FILE not in names:
        missing.append(
            f"{TEMPLATE_FILE}, the prompt template (`genrec-batch template --model {model_dir} --preset codes "
            "--catalog items.parquet` writes it, checked)"
        )
    pickled = sorted(n for n in names if n.endswith(S.PICKLED))
    if pickled:
        missing.append(
            f"no pickled file, but it has {pickled}: pickles run code when loaded; keep only the safetensors weights"
        )
    return missing


def weight_shapes(model_dir: Path) -> dict[str, tuple]:
    """{tensor name: shape} of a model folder's *.safetensors files, read from their headers (no tensor is loaded);
    ValueError naming a file that is not safetensors (a pickle renamed, a truncated file)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise ValueError(f"{f}: not a valid safetensors file ({type(e).__name__}: {e})") from e
    return shapes


def check_weights(model_dir: Path) -> None:
    """The folder's safetensors hold every tensor of the model its config.json describes, each of its shape (the
    model built on the meta device: no memory, no weights); ValueError naming what is missing or mismatched. Tied
    tensors (one parameter under two names, as save_pretrained stores it) need one of their names."""
    from transformers import AutoModelForCausalLM

    got = weight_shapes(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(model_dir))
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    want = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    missing = [group[0] for group in names.values() if not any(n in got for n in group)]
    wrong = [f"{n} {list(got[n])} (config: {list(want[n])})" for n in want if n in got and got[n] != want[n]]
    if missing or wrong:
        raise ValueError(
            f"{model_dir}: the safetensors weights do not match config.json: "
            + "; ".join(filter(None, [missing and f"missing {sorted(missing)[:8]}", wrong and f"shapes {wrong[:8]}"]))
        )


def check_upload(model_dir, catalog: pa.Table, source: str) -> dict:
    """A model folder checked for `upload_model` -> a summary; ValueError naming every missing part (`missing_parts`),
    weights that are not safetensors or do not fit config.json (`check_weights`), or what the model, tokenizer and
    template fail (`check_renders` against the catalog)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{model_dir}: not a folder")
    missing = missing_parts(path)
    if missing:
        raise ValueError(f"{model_dir} cannot be uploaded; it needs:\n  - " + "\n  - ".join(missing))
    check_weights(path)
    template = read_template(path)
    renderer = check_renders(path, template, catalog, source)
    return {"template": template.name, "max_prompt_tokens": renderer.max_len}


def upload_model(model_dir, uri: str, catalog: str, storage: Storage) -> dict:
    """Checks a local model folder (`check_upload`, against the catalog the nightly reads: a path or an s3:// URI)
    and only then uploads it to the s3:// prefix `uri` with its sha256sums.json, read back and verified
    (`S.upload_model_dir`) -> a summary: the files and their sha256, the template, the longest prompt in tokens."""
    if not S.is_s3(uri):
        raise ValueError(f"{uri}: not an s3:// URI (a local folder is used where it is, with no upload)")
    for where in (uri, catalog):
        S.check_access(where, storage)  # credentials refused: PermissionError naming the URI, nothing written
    summary = check_upload(model_dir, S.read_parquet(catalog, storage), catalog)
    files = S.upload_model_dir(str(model_dir), uri, storage)
    return {"uri": uri, **summary, "files": files}


# ---------------------------------------------------------------- the compiled engine's cache, beside the models


KEY_ENV = "GENREC_COMPILE_STORE_KEY"  # the store's signing key itself
KEY_FILE_ENV = "GENREC_COMPILE_STORE_KEY_FILE"  # or the file that holds it (a mounted secret)
CACHE_META = "cache.json"
META_FIELDS = ("archive", "sha256", "bytes", "key", "torch", "target")  # what a signature covers
MAX_ARCHIVE_BYTES = 4 << 30  # no archive larger than this is downloaded (inductor's caches are megabytes)
MAX_META_BYTES = 64 << 10  # a cache.json larger than this is no signed description: never read whole
NODE_NAMESPACE = "signed-v1"  # the node's folders of verified caches, apart from any older unchecked ones
MANIFEST = "genrec-signed.json"  # in a node folder: its files' sha256, HMAC-signed when it was placed


@dataclass(frozen=True)
class CompileStore:
    """The compiled engine's cache in object storage (or a shared folder): under `root`, one folder per
    `decoding.compiled.compile_key` (torch and transformers versions, device, the model's sha256 and dtype, the
    bucket) and `target` (the CPU model and flags or the GPU's capability, and the compilers' versions) holding
    `cache-<sha256>.tar.gz` (inductor's cache folder after a compile) and `cache.json` (written last: the archive's
    name, sha256 and size, the key, torch and target, and an HMAC-SHA256 signature of that description, which binds
    the archive's bytes).

    Loading inductor's cache runs its code (it unpickles graphs, imports wrapper modules, loads shared objects), so an
    archive is used only if its description's signature verifies under the key in GENREC_COMPILE_STORE_KEY (or the
    file GENREC_COMPILE_STORE_KEY_FILE names), checked before anything is downloaded; its size is capped
    (MAX_ARCHIVE_BYTES, and what the store says the object holds) and its bytes streamed to disk and checked against
    the signed sha256 before unpacking. Write access to the store is not enough to run code in an actor. Without a
    key nothing is fetched or uploaded. Every refusal or failure reads as "no cache" (a cold compile, with a warning),
    never as an error.

    On the node, caches live in `node_folder` (`<compile_cache>/signed-v1/<key>/<target tag>`, its folders private:
    `private_dirs`). A folder there is used only if its manifest (the sha256 of each of its files, its key and
    target, HMAC-signed with the key when it was unpacked from a verified archive or compiled by an actor holding the
    key: `seal`) still verifies when it is used; one that does not is moved aside, never loaded, never published.
    Folders are filled in a fresh folder beside and renamed into place, so no process sees a half-written folder or
    has a file it loaded rewritten; a folder something else placed first is used only if it verifies, else the
    actor's own verified copy. cache.json is read with a bound (MAX_META_BYTES). Several actors uploading one key at
    once is safe: each archive is named by its content and written before the `cache.json` that points at it, which
    is one whole object (last writer wins)."""

    root: str
    storage: Storage

    @staticmethod
    def node_folder(cache: str, key: str, device: torch.device | str = "cpu") -> str:
        """The node's folder for `key`'s verified cache on this target, under the node's compile cache `cache`, its
        parents made private (`private_dirs`: ValueError naming one another user could write)."""
        folder = Path(cache).expanduser() / NODE_NAMESPACE / key / compile_target(device)["tag"]
        private_dirs(Path(cache).expanduser(), folder.parent)
        return str(folder)

    def keyed(self) -> bool:
        """Whether this process holds the store's signing key (without it nothing is fetched or uploaded)."""
        return signing_key() is not None

    @staticmethod
    def cold_folder(folder: Path) -> Path:
        """A fresh private folder beside the node folder for this actor's cold compile (then `compiled`)."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".compiling", dir=folder.parent))

    def compiled(self, key: str, fresh: Path, folder: str | None, device: torch.device | str = "cpu") -> dict:
        """After this actor's cold compile into `fresh` (`cold_folder`): sealed, uploaded signed (`publish`), renamed
        onto the node folder -> publish's summary and "placed" (False: a sibling placed one first, or no node folder
        is safe to place it in)."""
        try:
            seal(fresh, key, signing_key(), compile_target(device)["tag"])
            out = self.publish(key, str(fresh), device)
            return {**out, "placed": folder is not None and place(fresh, Path(folder))}
        except (OSError, ValueError, TypeError) as e:  # the run goes on with the actor's own folder
            log.warning("compile cache %s not sealed or placed: %s", folder, e)
            note = f"{type(e).__name__}: {e}"[:300]
            return {"uploaded": False, "bytes": 0, "seconds": 0.0, "note": note, "placed": False}

    def fetch(self, key: str, folder: str, device: torch.device | str = "cpu") -> dict:
        """The node's folder of `key` (the node's own copy if its manifest verifies, else the store's archive,
        verified and unpacked into place) -> what happened {"found", "used", "note", "bytes", "seconds"} and, when
        used, "folder": the one to load (the node folder, or this actor's own verified copy beside it when what was
        placed there first does not verify)."""
        t0 = time.perf_counter()
        out = {"found": False, "used": False, "note": "", "bytes": 0}
        secret, target = signing_key(), compile_target(device)
        try:
            if secret is None:
                out["note"] = f"no signing key ({KEY_ENV}): nothing is loaded"
            elif Path(folder).is_dir() and sealed(Path(folder), key, secret, target["tag"]):
                out.update(used=True, folder=folder, note="the node's verified copy, not fetched again")
            else:
                aside = set_aside(Path(folder))
                self._fetch(key, Path(folder), target, secret, out)
                out["note"] = f"{aside}; {out['note']}" if aside else out["note"]
        except Exception as e:  # noqa: BLE001 -- a cache that cannot be read is a cold compile, never a failure
            out["note"] = f"unreadable ({type(e).__name__}: {e})"[:300]
        if out["found"] and not out["used"]:
            log.warning("compile cache %s ignored: %s; compiling cold", S.join(self.root, key), out["note"])
        return {**out, "seconds": time.perf_counter() - t0}

    def _fetch(self, key: str, folder: Path, target: dict, secret: bytes, out: dict) -> None:
        where = S.join(self.root, key, target["tag"])
        try:
            raw = S.read_bytes(S.join(where, CACHE_META), self.storage, limit=MAX_META_BYTES)
        except S.TooLarge as e:  # no signed description is that large: not read, never parsed
            out.update(found=True, note=f"{e}: not a signed description")
            return
        if raw is None:
            out["note"] = "no cache for this key"
            return
        out["found"] = True
        meta = json.loads(raw)
        why = foreign(meta, key, target)
        if why is None and not hmac.compare_digest(str(meta.get("signature", "")), signature(secret, meta)):
            why = f"{meta['archive']} is not signed with this store's key: never downloaded or unpacked"
        if why is None:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".download.", dir=folder.parent) as tmp:
                archive = Path(tmp) / "archive.tar.gz"
                why = download_checked(S.join(where, meta["archive"]), meta, archive, self.storage)
                used = unpack_into_place(archive, folder, key, secret, target["tag"]) if why is None else None
        if why is None:
            own = "" if used == folder else f" into {used.name} (what another process placed first does not verify)"
            out.update(used=True, folder=str(used), bytes=meta["bytes"], note="verified and unpacked" + own)
        else:
            out["note"] = why

    def publish(self, key: str, folder: str, device: torch.device | str = "cpu") -> dict:
        """Uploads `folder` (inductor's cache after this actor's successful compile, sealed: its manifest verifies),
        signed, as the cache of `key` on this target -> {"uploaded", "bytes", "seconds", "note"}; a failure is logged
        and reported, not raised."""
        t0 = time.perf_counter()
        secret = signing_key()
        try:
            if secret is None:
                raise ValueError(f"no signing key ({KEY_ENV} or {KEY_FILE_ENV}): nothing is uploaded")
            target = compile_target(device)
            if not sealed(Path(folder), key, secret, target["tag"]):
                raise ValueError(f"{folder} has no valid manifest (not compiled or verified here): not uploaded")
            where = S.join(self.root, key, target["tag"])
            data = pack(Path(folder))
            sha = hashlib.sha256(data).hexdigest()
            archive = f"cache-{sha[:32]}.tar.gz"
            S.write_bytes(S.join(where, archive), data, self.storage)
            meta = {"archive": archive, "sha256": sha, "bytes": len(data), "key": key, "torch": torch.__version__}
            meta = {**meta, "target": target}
            meta["signature"] = signature(secret, meta)
            S.write_bytes(S.join(where, CACHE_META), json.dumps(meta).encode(), self.storage)
            out = {"uploaded": True, "bytes": len(data), "note": ""}
        except Exception as e:  # noqa: BLE001 -- the run goes on without a shared cache
            log.warning("compile cache %s not uploaded: %s", S.join(self.root, key), e)
            out = {"uploaded": False, "bytes": 0, "note": f"{type(e).__name__}: {e}"[:300]}
        return {**out, "seconds": time.perf_counter() - t0}


def signing_key() -> bytes | None:
    """The compile store's HMAC key: GENREC_COMPILE_STORE_KEY, else the file GENREC_COMPILE_STORE_KEY_FILE names (its
    bytes), surrounding whitespace stripped either way; None when neither is set or the key is empty. ValueError
    (one line, naming the variable) for a key file that is missing or that its group or others may write."""
    secret = os.environ.get(KEY_ENV, "").strip().encode()
    name = os.environ.get(KEY_FILE_ENV, "").strip()
    if not secret and name:
        path = Path(name).expanduser()
        try:
            mode = path.stat().st_mode
            if mode & 0o022:
                raise ValueError(
                    f"{KEY_FILE_ENV}={name}: group- or world-writable (mode {mode & 0o777:o}); anyone who can write "
                    "it can sign code the actors run: chmod go-w it"
                )
            secret = path.read_bytes().strip()
        except OSError as e:
            raise ValueError(f"{KEY_FILE_ENV}={name}: cannot read the compile store's key ({e.strerror})") from None
    return secret or None


def signature(secret: bytes, meta: dict) -> str:
    """HMAC-SHA256 over the archive's description (META_FIELDS, canonical JSON: its name, sha256 and size bind its
    bytes): an archive signed for one key, torch or target verifies under no other."""
    described = json.dumps({f: meta.get(f) for f in META_FIELDS}, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, described, hashlib.sha256).hexdigest()


def foreign(meta: dict, key: str, target: dict) -> str | None:
    """Why a cache.json does not describe a cache of `key` built by this torch for this target (None: it does)."""
    if not isinstance(meta, dict) or not set(META_FIELDS) <= set(meta):
        return "cache.json is not a cache description"
    if meta["key"] != key or meta["torch"] != torch.__version__ or meta["target"] != target:
        return f"a foreign cache (built for {meta['key']} with torch {meta['torch']} on {meta['target']})"
    if not isinstance(meta["archive"], str) or "/" in meta["archive"] or not meta["archive"].startswith("cache-"):
        return f"cache.json names an archive outside its folder: {meta['archive']!r}"
    if not isinstance(meta["bytes"], int) or not 0 < meta["bytes"] <= MAX_ARCHIVE_BYTES:
        return f"cache.json gives an archive of {meta['bytes']!r} bytes (at most {MAX_ARCHIVE_BYTES} are fetched)"
    return None


def download_checked(uri: str, meta: dict, dest: Path, storage: Storage) -> str | None:
    """The archive at `uri` streamed into `dest`, never more than the signed size, hashed on the way -> None when it
    is the signed archive (its size as the store reports it, then its sha256), else why not."""
    fs, path = S.filesystem(uri, storage)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return f"{meta['archive']} is missing (a partial upload)"
    if info.size != meta["bytes"]:
        return f"{meta['archive']} does not match its checksum: {info.size} bytes stored, {meta['bytes']} signed"
    h, got = hashlib.sha256(), 0
    with fs.open_input_stream(path, compression=None) as src, open(dest, "wb") as out:
        while got <= meta["bytes"] and (chunk := src.read(1 << 20)):
            got += len(chunk)
            h.update(chunk)
            out.write(chunk)
    if got != meta["bytes"] or h.hexdigest() != meta["sha256"]:
        return f"{meta['archive']} does not match its checksum"
    return None


def manifest_of(folder: Path, key: str, target: str) -> dict:
    """A node folder's files (inductor's lock files and the manifest left out) -> {"key", "target", "files": {path:
    sha256}}: what a seal signs, so that a sealed folder verifies for its own key and target only. ValueError naming
    the first entry that is a symbolic link (to a file or a folder: a walk would not look inside it, inductor would)
    or neither a regular file nor a folder."""
    files = {}
    for root, dirs, names in os.walk(folder, followlinks=False):
        for name in dirs + names:
            path = Path(root) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ValueError(f"{path}: a symbolic link or special file in a compile cache folder")
            rel = path.relative_to(folder)
            if stat.S_ISREG(mode) and rel.parts[0] not in ("locks", MANIFEST):
                files[str(rel)] = S.sha256_file(path)
    return {"key": key, "target": target, "files": dict(sorted(files.items()))}


def manifest_signature(secret: bytes, manifest: dict) -> str:
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, b"genrec-node-manifest\n" + body, hashlib.sha256).hexdigest()


def seal(folder: Path, key: str, secret: bytes, target: str) -> None:
    """Writes the node folder's manifest: each file's sha256, the key and the target, HMAC-signed (a folder this
    actor compiled or unpacked from a verified archive). ValueError for a folder holding a link or special file."""
    manifest = manifest_of(folder, key, target)
    body = json.dumps({**manifest, "signature": manifest_signature(secret, manifest)}).encode()
    tmp = folder / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_bytes(body)
    os.replace(tmp, folder / MANIFEST)


def sealed(folder: Path, key: str, secret: bytes, target: str) -> bool:
    """Whether the node folder holds exactly the files its manifest signs for `key` on `target`, with those bytes,
    and nothing else (no link, no special file)."""
    try:
        written = json.loads((folder / MANIFEST).read_bytes())
        manifest = manifest_of(folder, key, target)
    except (OSError, ValueError):
        return False
    claimed = hmac.compare_digest(str(written.get("signature", "")), manifest_signature(secret, manifest))
    return claimed and written.get("files") == manifest["files"]


def set_aside(folder: Path) -> str:
    """A node folder without a manifest that verifies -> renamed aside (never loaded, never rewritten: a process may
    hold its files) -> a note ("" when there was none)."""
    if not folder.exists():
        return ""
    aside = folder.with_name(f".{folder.name}.unverified-{time.time_ns()}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return ""
    log.warning("compile cache %s has no valid manifest: moved to %s, never loaded", folder, aside.name)
    return f"the node's copy did not verify (moved aside to {aside.name})"


def place(fresh: Path, folder: Path) -> bool:
    """Renames the filled folder `fresh` onto `folder` -> whether it was placed (False: another process placed one
    first; that one is kept as it is, and `fresh` stays where it is, as a process may hold its files)."""
    try:
        os.rename(fresh, folder)  # atomic; fails if the folder exists and is not empty
        return True
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise


@functools.cache
def compile_target(device: torch.device | str = "cpu") -> dict:
    """What inductor compiled for, beyond compile_key's kernel family: the GPU's name and compute capability, or the
    CPU's model and a hash of its flags (inductor builds CPU code for the build machine's own instruction set), and
    the compilers (torch, triton, the C++ compiler's version line); `tag` names it all in a store path."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        hardware = {"gpu": torch.cuda.get_device_name(device), "capability": f"sm{major}{minor}"}
    else:
        info = cpuinfo()
        flags = " ".join(sorted(info.get("flags", info.get("Features", "")).split()))
        model = info.get("model name") or info.get("CPU part") or platform.processor() or platform.machine()
        hardware = {"cpu": model, "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16]}
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    target = {**hardware, "torch": torch.__version__, "triton": triton_version, "cxx": cxx_version()}
    tag = hashlib.sha256(json.dumps(target, sort_keys=True).encode()).hexdigest()[:16]
    return {**target, "tag": f"target-{tag}"}


def cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines()) if k.strip()}


def cxx_version() -> str | None:
    """The first line of `<C++ compiler> --version`, the compiler inductor builds CPU code with (None: none)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        out = subprocess.run([get_cpp_compiler(), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return None


def pack(folder: Path) -> bytes:
    """Inductor's cache folder -> a tar.gz of its regular files (its lock files left out)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder)
            if path.is_file() and not path.is_symlink() and rel.parts[0] not in ("locks", MANIFEST):
                tar.add(path, arcname=str(rel), recursive=False)
    return buf.getvalue()


def regular_members(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """No absolute path and no `..` (refused, where tarfile's "data" filter would strip a leading slash), then that
    filter (nothing outside the folder, no device), and no link at all."""
    if member.name.startswith("/") or os.path.isabs(member.name):
        raise tarfile.AbsolutePathError(member)
    if ".." in Path(member.name).parts:
        raise tarfile.OutsideDestinationError(member, os.path.join(dest, member.name))
    member = tarfile.data_filter(member, dest)
    if not (member.isfile() or member.isdir()):
        raise tarfile.SpecialFileError(member)
    return member


def unpack_into_place(archive: Path, folder: Path, key: str, secret: bytes, target: str) -> Path:
    """A verified archive file -> its regular files in a fresh folder beside `folder`, sealed (`seal`), renamed into
    place -> the folder to load: `folder` (placed here, or placed by another process first and verifying), else this
    process's own sealed copy, kept beside it (what is at `folder` does not verify: left alone, never loaded)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".unpacking", dir=folder.parent))
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            tar.extractall(fresh, filter=regular_members)
        seal(fresh, key, secret, target)
        if place(fresh, folder):
            return folder
        if sealed(folder, key, secret, target):  # another process placed it first, verified: load theirs
            shutil.rmtree(fresh, ignore_errors=True)
            return folder
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    log.warning("compile cache %s was placed by another process and does not verify: loading %s", folder, fresh.name)
    return fresh


def compile_store(cfg) -> CompileStore | None:
    """compute.compile_store: "none" (the default) -> none; "auto" -> beside the target model when it is on object
    storage (`<models.target>.compile-cache`), else none; a URI or folder -> there. Without a signing key the store
    is named but nothing is loaded from it or uploaded (a warning says so)."""
    where = cfg.compute.compile_store
    if where == "none" or (where == "auto" and not S.is_s3(cfg.models.target)):
        return None
    root = cfg.models.target.rstrip("/") + ".compile-cache" if where == "auto" else where
    if signing_key() is None:
        log.warning(
            "compute.compile_store %s: no signing key (%s or %s), so nothing is loaded from it or uploaded to it",
            root,
            KEY_ENV,
            KEY_FILE_ENV,
        )
    return CompileStore(root, cfg.storage)
