"""Offline evaluation of a published run: Recall@K and NDCG@K against the input's `target_items`.

The paper's convention: users without target items are skipped; the split's history convention (a test user's
history is its train + valid items, the AtSpeed paper's) is quoted from the data folder's prepare.json. A user with
targets but no recommendations (a rejected row) counts as a miss, so a run cannot look better by rejecting users.
Duplicate user ids: the first row's targets, as the nightly job keeps the first row.

Exclusions: the report states the run's `decoding.exclude` setting (and the excluded items per user, from its
manifest). Targets are scored as given (`targets="all"`, the AtSpeed protocol: it excludes nothing), or without the
items of each user's whole history (`targets="unseen"`, the protocol that matches a run with `exclude: history`, which
can never recommend them); a user left without targets is then skipped, as users without targets always are.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from decoding.metrics import recall_ndcg_flat
from pipeline import markdown
from pipeline import storage as S
from pipeline.report import num, quality_cell
from pipeline.runs import Run, load_run, read_recommendations, report_dir
from pipeline.storage import Storage

KS = (1, 5, 10, 20)
TARGETS = {
    "all": "as given (the AtSpeed protocol: nothing excluded)",
    "unseen": "without the items of the user's whole history (a run with decoding.exclude: history can never "
    "recommend them)",
}


def split_protocol(input_uri: str, storage: Storage) -> dict:
    """How the evaluated users' histories and targets were built: the split's line of SPLIT_CONVENTION in the
    `prepare.json` that jobs.prepare_data writes beside the split (`<data>/test.parquet` -> "test") -> {"split",
    "convention", "source"}; an input without one carries its histories as given."""
    folder, _, name = input_uri.rstrip("/").rpartition("/")
    split = name.removesuffix(".parquet")
    raw = S.read_bytes(S.join(folder or ".", "prepare.json"), storage) if name.endswith(".parquet") else None
    splits = json.loads(raw).get("splits", {}) if raw else {}
    if split in splits:
        return {"split": split, "convention": splits[split], "source": S.join(folder or ".", "prepare.json")}
    return {
        "split": split,
        "convention": "the input's own history and target_items columns, as given "
        "(no prepare.json with a split convention beside it)",
        "source": None,
    }


def read_targets(input_uri: str, storage: Storage, targets: str = "all") -> pa.Table:
    """The input's (user_id, target_items) of the users that have targets, one row per user (the first); targets
    "unseen": each user's history items removed from its targets first (TARGETS)."""
    fs, path = S.filesystem(input_uri, storage)
    read = ["user_id", "target_items", "history"]
    try:  # every file's columns, as the nightly reads its input (`S.unified_dataset`)
        data = S.unified_dataset(pads.dataset(path, filesystem=fs, format="parquet"), f"input {input_uri}", read)
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"input {input_uri}: not readable as parquet ({e})") from None
    if "target_items" not in data.schema.names:
        raise ValueError(
            f"input {input_uri}: no target_items column; offline evaluation needs each user's held-out "
            f"items (has {data.schema.names})"
        )
    kind = data.schema.field("target_items").type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise ValueError(f"input {input_uri}: target_items must be a list of integer item ids, got {kind}")
    table = data.to_table(columns=["user_id", "target_items"] + ["history"] * (targets == "unseen"))
    if pc.list_flatten(table["target_items"]).null_count:
        raise ValueError(f"input {input_uri}: target_items holds null item ids")
    if targets == "unseen":
        table = table.set_column(1, "target_items", without_history(table["target_items"], table["history"]))
    table = table.append_column("row", pa.array(np.arange(table.num_rows)))
    first = table.group_by("user_id", use_threads=False).aggregate([("row", "min")]).column("row_min")
    table = table.take(np.sort(first.to_numpy()))  # the first row of every user, in input order
    has = pc.fill_null(pc.greater(pc.list_value_length(table["target_items"]), 0), False)
    return table.filter(has).select(["user_id", "target_items"])


def without_history(targets: pa.ChunkedArray, history: pa.ChunkedArray) -> pa.Array:
    """Each row's target items that are not in its history (list<int64>), vectorised over flat arrays."""
    targets, history = (c.combine_chunks().cast(pa.list_(pa.int64())) for c in (targets, history))
    row_t, row_h = (pc.list_parent_indices(c).to_numpy() for c in (targets, history))  # [T], [H]
    item_t = pc.list_flatten(targets).to_numpy()
    item_h = pc.list_flatten(history).fill_null(-1).to_numpy(zero_copy_only=False)
    codes, inverse = np.unique(np.concatenate([item_t, item_h]), return_inverse=True)
    key_t, key_h = (
        row * len(codes) + code for row, code in ((row_t, inverse[: len(item_t)]), (row_h, inverse[len(item_t) :]))
    )
    keep = ~np.isin(key_t, key_h)  # [T]
    lengths = np.bincount(row_t[keep], minlength=len(targets))  # [U]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(item_t[keep], pa.int64()), mask=targets.is_null())


def exclusion_setting(manifest: dict) -> dict:
    """The run's exclusions as its manifest records them (runs from before exclusions: the configured mode)."""
    return manifest.get("exclusions") or {"mode": manifest["config"]["decoding"].get("exclude", "none")}


def evaluate_run(run: Run, input_uri: str, storage: Storage, ks=KS, targets: str = "all") -> dict:
    """Recall@k and NDCG@k of the run's published recommendations against the targets as given ("all") or without
    each user's history items ("unseen") -> a dict (ks, users, metrics, counts, the run's exclusions)."""
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {', '.join(TARGETS)}, got {targets!r}")
    exclusions = exclusion_setting(run.manifest)
    targets_table = read_targets(input_uri, storage, targets)
    result = score(run, targets_table, storage, ks)
    return {
        "run_id": run.run_id,
        "run": run.uri,
        "input": input_uri,
        "ks": list(ks),
        "k": result.pop("k"),
        "protocol": split_protocol(input_uri, storage),
        "exclusions": exclusions,
        "targets": {"mode": targets, "meaning": TARGETS[targets]},
        **result,
    }


def score(run: Run, targets: pa.Table, storage: Storage, ks) -> dict:
    """The run's recommendations against targets (user_id, target_items) -> k, users without recommendations and
    the metrics."""
    recs = read_recommendations(run, storage, ("user_id", "rank", "item_id"))
    k = int(run.manifest["config"]["decoding"]["k"])
    user_type = targets.schema.field("user_id").type
    row = pc.index_in(pc.cast(recs["user_id"], user_type), value_set=targets["user_id"])  # target user of each rec
    found = pc.is_valid(row).to_numpy(zero_copy_only=False)
    rows = row.to_numpy(zero_copy_only=False)[found].astype(np.int64)
    ranks = recs["rank"].to_numpy()[found].astype(np.int64)
    matrix = np.full((targets.num_rows, max(k, int(ranks.max(initial=0)))), -1, np.int64)  # [U, K] best first
    matrix[rows, ranks - 1] = recs["item_id"].to_numpy()[found]
    lists = targets["target_items"]
    metrics = recall_ndcg_flat(matrix, pc.list_flatten(lists).to_numpy(), pc.list_value_length(lists).to_numpy(), ks)
    return {"k": k, "users_without_recommendations": int((matrix[:, 0] < 0).sum()), **metrics}


def evaluate(
    uri: str, storage: Storage, input_uri: str | None = None, out: str | None = None, ks=KS, targets: str = "all"
) -> dict:
    """Evaluates a published run against `input_uri` (default: the run's configured input), its targets as given or
    without history items (`targets`, TARGETS), and writes evaluation.json and evaluation.md into `out` (default
    `<run>/report`, where the report reads it) -> the result."""
    if not ks or min(ks) < 1:
        raise ValueError(f"the cut-offs k must be >= 1, got {list(ks)}")
    run = load_run(uri, storage)
    result = evaluate_run(run, input_uri or run.manifest["config"]["input"], storage, tuple(ks), targets)
    out = out or report_dir(run.uri)
    S.write_bytes(S.join(out, "evaluation.json"), json.dumps(result, indent=2).encode(), storage)
    S.write_bytes(S.join(out, "evaluation.md"), to_markdown(result).encode(), storage)
    return result


def exclusions_line(ev: dict) -> str:
    """What the run excluded and how the targets were scored, in one sentence."""
    e, t = ev["exclusions"], ev["targets"]
    counts = (
        f" (excluded items per user: mean {num(e['excluded_per_user_mean'], 1)}, max {num(e['excluded_per_user_max'])})"
        if "excluded_per_user_mean" in e
        else ""
    )
    column = f" plus the input column `{e['column']}`" if e.get("column") else ""
    return f"The run's exclusions: `decoding.exclude: {e['mode']}`{column}{counts}. Targets scored {t['meaning']}."


def to_markdown(ev: dict) -> str:
    ks = ev["ks"]
    lines = [
        f"# Offline evaluation of run {ev['run_id']}",
        "",
        f"`{ev['input']}`: {num(ev['users'])} users with target items (users without targets skipped; "
        f"{num(ev['users_without_recommendations'])} of them got no recommendations and count as misses); "
        f"the run returned k = {ev['k']} items per user.",
        "",
        *([f"Split `{ev['protocol']['split']}`: {ev['protocol']['convention']}.", ""] if "protocol" in ev else []),
        *([exclusions_line(ev), ""] if "exclusions" in ev else []),
    ]
    rows = [[m, *(quality_cell(ev, m, k) for k in ks)] for m in ("Recall", "NDCG")]  # n/a above the run's k
    table = markdown.table(["metric", *(f"@{k}" for k in ks)], rows, align=["left"] + ["right"] * len(ks))
    return "\n".join([*lines, table]) + "\n"
