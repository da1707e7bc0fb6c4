"""What decides a user's list, by content: the run's fingerprint (every input but the user's own) and each user's input
hash (what its prompt and its exclusions read). Two runs with equal fingerprints give a user with equal input hashes
the same list, so an incremental run (pipeline/carry.py) copies that user's list from its base instead of decoding it.

Nothing here imports torch: the input hashes are computed by the nightly's read tasks (pipeline/units.py).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import importlib.util
import json
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decoding.codes import ragged_ranges
from decoding.templates import as_text

HASH = "blake2b-128/windows+exclusions+fields/v2"  # how `input_hashes` reads a row: a part of the fingerprint

NOT_PARTS = {  # settings a list does not depend on, and why (docs/output.md#incremental-runs)
    "compute.batch_size, decode_batch, batches_per_task, num_actors, cpus_per_actor, threads_per_actor": (
        "how users are cut into shards and decodes; beam search, the engines and the samplers give a user the same "
        "list in any batch (per-user draws in the sampling modes); in half precision within near-ties"
    ),
    "compute.order_by_length": "the order users are decoded in; outputs are in the input order either way",
    "compute.engine (in float32)": "the compiled engine returns the eager engine's lists exactly",
    "compute.audit_users": "the precision audit re-decodes users beside the run; it never changes a list",
    "compute.compile_cache, models.cache_dir, storage, runs, serving": "where files are kept and how the job runs",
    "models.target and models.draft URIs": "a model is its content: the sha256 of its weights and its other files",
    "decoding.draft_beams, gamma, auto_trials (but atspeed-relaxed)": (
        "beam search and strict speculation return beam search's lists whatever the draft does"
    ),
}


def input_hashes(
    history: pa.Array,
    exclude: pa.Array | None,
    history_len: int,
    whole_history: bool,
    others: list[tuple[pa.Array, int]] = (),
    texts: list[pa.Array] = (),
) -> pa.Array:
    """Each user's input hash [B] binary (16 bytes; null where the history is not a list of integer ids, or the
    exclusion column's row or another history's window holds a null id: such a row is rejected or decoded, never
    carried): blake2b over what the user's list depends on, each part prefixed by its length: the prompt's window
    (the last `history_len` items, in order), the whole history when it is excluded (`whole_history`: `decoding.exclude:
    history`), the row of the exclusion column `exclude` as given (a null row: nothing), the window of each other
    history the prompt writes (`others`: (column, window)) and each user field it writes (`texts`: its text, a null
    apart from an empty one). A change outside the windows leaves the hash as it was unless the whole history is
    excluded; a reordered exclusion list changes it (the user is decoded again, with the same list)."""
    h, bad = _int_lists(history, null_ok=False)
    values, starts, lengths = _ragged(h)  # [T], [B], [B]
    used = np.minimum(lengths, history_len)  # [B]
    parts = [(values, starts + lengths - used, used)] + [(values, starts, lengths)] * whole_history
    if exclude is not None:
        lists, bad_e = _int_lists(exclude, null_ok=True)
        bad |= bad_e
        parts.append(_ragged(lists))
    for column, window in others:
        lists, bad_c = _int_lists(column, null_ok=True)
        bad |= bad_c
        v, s, n = _ragged(lists)
        kept = np.minimum(n, window)
        parts.append((v, s + n - kept, kept))
    out = _digests(parts, _text_bytes(texts, len(bad)))
    return pc.if_else(pa.array(bad), pa.nulls(len(bad), pa.binary()), out) if bad.any() else out


def _digests(parts: list, extra: list[bytes]) -> pa.Array:
    """Each row's ragged parts (`_words`) and its extra bytes -> blake2b-128 of them [B] binary."""
    words, size = _words(parts)  # [sum(size)] int64, [B]
    ends = np.cumsum(size) * 8
    raw = memoryview(words.astype("<i8").tobytes())
    blake2b = hashlib.blake2b
    return pa.array(
        [
            blake2b(raw[a:b].tobytes() + x if x else raw[a:b], digest_size=16).digest()
            for a, b, x in zip((ends - size * 8).tolist(), ends.tolist(), extra)
        ],
        pa.binary(),
    )


def _text_bytes(texts: list[pa.Array], rows: int) -> list[bytes]:
    """User fields [B] each -> per row, each field as its length (8 bytes; -1: null) and the UTF-8 bytes of the text
    the prompt writes (`as_text`: a float column's 3.0 is "3.0", an integer column's 3 is "3")."""
    out = [b""] * rows
    for column in texts:
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):  # its bytes, not decoded: a
            # value that is not UTF-8 hashes too (validation rejects it)
            values = column.cast(pa.large_binary()).to_pylist()
        else:
            values = [None if null else v.encode() for v, null in zip(as_text(column), column.is_null().to_pylist())]
        out = [x + (b"\xff" * 8 if v is None else len(v).to_bytes(8, "little") + v) for x, v in zip(out, values)]
    return out


def _int_lists(column: pa.Array, null_ok: bool) -> tuple[pa.Array, np.ndarray]:
    """A column -> (list<int64>, bad [B]: rows with a null id, null rows unless `null_ok`, every row when the
    column does not cast)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    try:
        lists = column.cast(pa.list_(pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pa.array([[]] * len(column), pa.list_(pa.int64())), np.ones(len(column), bool)
    bad = np.zeros(len(lists), bool) if null_ok else lists.is_null().to_numpy(zero_copy_only=False).copy()
    flat = pc.list_flatten(lists)
    if flat.null_count:
        parents = pc.list_parent_indices(lists).to_numpy()
        bad[np.unique(parents[flat.is_null().to_numpy(zero_copy_only=False)])] = True
    return lists, bad


def _ragged(lists: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """list<int64> [B] -> (values [T], starts [B], lengths [B]); a null row has length 0, a null id is -1."""
    offsets = lists.offsets.to_numpy().astype(np.int64)  # [B + 1] (a slice's: into the whole child array)
    nulls = lists.is_null().to_numpy(zero_copy_only=False)
    values = lists.values.slice(offsets[0], offsets[-1] - offsets[0])
    values = values.fill_null(-1) if values.null_count else values
    values = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return values, offsets[:-1] - offsets[0], np.where(nulls, 0, np.diff(offsets))


def _words(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged parts (values [T], starts [B], lengths [B]) -> each row's words, every part as its length then its
    values, rows one after another [sum(size)] int64, and each row's word count size [B]."""
    size = sum(1 + n for _, _, n in parts)  # [B]
    at = np.cumsum(size) - size  # [B] where each row's words begin
    out = np.empty(int(size.sum()), np.int64)
    for values, starts, n in parts:
        out[at] = n
        out[ragged_ranges(at + 1, n)] = values[ragged_ranges(starts, n)]
        at = at + 1 + n
    return out, size


def catalog_texts_sha256(table: pa.Table, columns: list[str]) -> str | None:
    """The catalog's columns a prompt template writes, by content: sha256 over each column's name, then its values
    as the prompt writes them, in item id order (`_text_bytes`). None when the template writes none."""
    if not columns:
        return None
    order = pa.array(np.argsort(table.column("item_id").to_numpy(), kind="stable"))
    h = hashlib.sha256()
    for c in columns:
        h.update(f"{c}\0".encode())
        h.update(b"".join(_text_bytes([table.column(c).combine_chunks().take(order)], table.num_rows)))
    return h.hexdigest()


def sha256_of(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(
    cfg,
    models: dict,
    template: dict,
    history_len: int,
    items_info: dict,
    listed: str,
    id_kind: str,
    exclude_column: str | None,
    device: str,
) -> dict:
    """Everything but a user's own inputs that decides its list, part by part (`NOT_PARTS`: what is left out and why):
    the models (the draft only in atspeed-relaxed, whose lists depend on its proposals), the template (with the chat
    template it renders with), the items (the index's content, the catalog columns the template writes, the items
    each semantic ID lists in the duplicate policy's order, `listed`: Catalog.listing_sha256, so a changed `by:`
    column changes it; the recommendable set, the block list),
    the decoding settings that shape a list, the dtype (and the engine outside float32), the device kind, the
    software, the code (`code_identity`: every module of genrec-batch), the kind of user id and how input hashes are
    computed."""
    d, c = cfg.decoding, cfg.compute
    roles = ["target"] + ["draft"] * (d.mode == "atspeed-relaxed")
    dtype = "float32" if c.dtype == "auto" and not c.gpus_per_actor else c.dtype  # auto on a CPU: float32
    return {
        **{role: {"weights": models[role]["sha256"], "files": models[role]["files"]} for role in roles},
        "template": sha256_of(template),
        "catalog": {"index": items_info["sha256"], "listed": listed}
        | ({"texts": items_info["texts"]} if items_info.get("texts") else {}),
        "recommendable": items_info["sets"]["recommendable"],
        "blocked": items_info["sets"]["blocked"],
        "decoding": decoding_parts(cfg, history_len, exclude_column),
        "dtype": dtype,
        **({"engine": c.engine} if dtype != "float32" else {}),
        "device": device,
        "software": software(),
        "code": code_identity()["sha256"],
        "user_id": id_kind,
        "input_hash": HASH,
    }


def decoding_parts(cfg, history_len: int, exclude_column: str | None) -> dict:
    """The decoding settings that shape a list: every mode's, and the sampling modes' and atspeed-relaxed's own."""
    d = cfg.decoding
    parts = {
        "mode": d.mode,
        "k": d.k,
        "history_len": history_len,
        "exclude": d.exclude,
        "exclude_column": exclude_column,
        "duplicate_items": cfg.duplicate_items,
        "max_prompt_tokens": d.max_prompt_tokens,  # None: the model's context (its config is in the model's files)
        "too_long": d.too_long,
    }
    if d.mode in ("atspeed-relaxed", "disc"):
        parts |= {"seed": d.seed, "temperature": d.temperature}
    if d.mode == "atspeed-relaxed":
        parts |= {"gamma": d.gamma, "draft_beams": d.draft_beams}
    if d.mode == "disc":
        parts |= {"rounds": d.rounds, "top_m": d.top_m}
    return parts


DISTRIBUTION = "genrec-batch"


@functools.cache
def code_identity() -> dict:
    """The code this process runs, as it imports it: genrec-batch's version and the sha256 of every Python file of
    its top-level packages (`code_packages`: decoding, operators, pipeline, jobs, ... whichever the package has),
    each file by its path inside its package and its content. Any module can change a list (reading and validating
    rows, the items, the input hashes, the shards, the decoders), so a change to any of them, installed or edited in
    place, whatever the version says, makes the next night a full one and refuses a resume. Read from the files
    where this process finds the packages (a source tree, an editable or a wheel install, a Ray job's working_dir):
    the same code gives the same identity on every node. Computed once a process: its modules are loaded once."""
    h = hashlib.sha256()
    for name in code_packages():
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for f in sorted(Path(folder).rglob("*.py")):
                h.update(f"{name}/{f.relative_to(folder).as_posix()}\0".encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
    return {"version": _project()[1] or _version(DISTRIBUTION), "sha256": h.hexdigest()}


def code_packages() -> list[str]:
    """genrec-batch's top-level packages, from the package itself, never a list kept here: in a source tree (a
    checkout, an editable install, a job's working_dir) the build's own rule, pyproject.toml's
    [tool.setuptools.packages.find] include, over the folders beside this package; in a wheel install the
    distribution's top_level.txt, which that rule wrote."""
    root, _ = _project()
    if root is not None:
        include = _pyproject(root).get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
        patterns = include.get("include", ["*"])
        return sorted(
            d.name
            for d in root.iterdir()
            if d.is_dir() and d.name.isidentifier() and any(fnmatch.fnmatchcase(d.name, p) for p in patterns)
        )
    try:
        listed = distribution(DISTRIBUTION).read_text("top_level.txt") or ""
    except PackageNotFoundError:
        listed = ""
    return sorted(set(listed.split()) | {__name__.partition(".")[0]})


def _project() -> tuple[Path | None, str | None]:
    """The source tree this package lies in (the folder above it, when its pyproject.toml names genrec-batch) and
    the version it gives; (None, None) in a wheel install."""
    root = Path(__file__).resolve().parents[1]
    project = _pyproject(root).get("project", {})
    return (root, project.get("version")) if project.get("name") == DISTRIBUTION else (None, None)


def _pyproject(root: Path) -> dict:
    path = root / "pyproject.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def describe_code(code: dict | None) -> str:
    """A code identity (`code_identity`) in words: `0.1.0, source 1a2b3c4d5e6f`."""
    return f"{code['version']}, source {code['sha256'][:12]}" if code else "not recorded"


def check_code(expected: str, where: str) -> None:
    """A Ray task's check that it runs the code the driver planned with (`code_identity`'s sha256): a node that runs
    other code (another image, a stale install, a working_dir that shadows it) would give other lists than the
    plan's fingerprint says. Refused (ValueError, `code_refusal`)."""
    refused = code_refusal(expected, where)
    if refused:
        raise ValueError(refused)


def code_refusal(expected: str, where: str) -> str | None:
    """Why `where` must not run here (this node's code is not `expected`, the driver's), naming the node and both;
    None when it is (or nothing is expected)."""
    found = code_identity()["sha256"]
    if not expected or found == expected:
        return None
    import socket

    return (
        f"{where} on node {socket.gethostname()} runs other genrec-batch code (source {found[:12]}) than the driver "
        f"planned the run with ({expected[:12]}): every node must run the driver's code (the same image, or the job's "
        "working_dir on every node)"
    )


def software() -> dict:
    """The versions of the software that decodes (genrec-batch, torch, transformers): a fingerprint's `software`, and
    what a resume must find unchanged."""
    return {name: _version(name) for name in ("genrec-batch", "torch", "transformers")}


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def decoded_on(dtypes, devices, engines=()) -> dict:
    """What a run's actors decoded in and on (the metrics' dtype, device and engine columns): `compute.dtype: auto`,
    the GPU model and `compute.engine: auto`'s choice are known only there (the engine matters outside float32). An
    incremental run publishes only when its decoded users' are among its base's (`carry.check_decoded_on`)."""
    dtypes = sorted(set(dtypes))
    out = {"dtypes": dtypes, "devices": sorted(set(devices))}
    return out if set(dtypes) <= {"float32"} else {**out, "engines": sorted(set(engines))}


def differences(base: dict, parts: dict) -> list[str]:
    """The parts of two fingerprints that differ, named (`decoding.k`, `target`), in order; [] when equal."""
    out = []
    for name in sorted(set(base) | set(parts)):
        old, new = base.get(name), parts.get(name)
        if isinstance(old, dict) and isinstance(new, dict) and name in ("decoding", "software"):
            out += [f"{name}.{key}" for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
        elif old != new:
            out.append(name)
    return out
