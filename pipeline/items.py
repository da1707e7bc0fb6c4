"""The items a run serves from: the item index, the recommendable set and the block list, one meaning each.

- `catalog`, the item index: every item a history may name, with its semantic ID (tonight's items and every earlier
  one users still hold; it typically only grows). Prompts render from it, whether an item is recommendable or not;
  only an item it lacks makes a row `unknown_item`.
- The recommendable set: the items a list may hold. `recommendable` names a parquet of item ids (column `item_id`),
  `recommendable_column` a boolean column of the catalog (null: not recommendable); neither: every catalog item. Ids
  the index lacks have no semantic ID, so they cannot be recommended: counted, not fatal.
- The block list: items no list may hold, whatever the set says (legal, safety, a brand's request): a parquet of item
  ids (`blocked`) and ids in the config (`blocked_items`). Ids the index lacks are counted, not fatal.

The constraint index (decoding.catalog.Catalog) is built over the recommendable items less the blocked ones, so every
decoder and engine keeps to them exactly, as if the catalog held nothing else. The driver reads the three once
(`read_items`) for its checks, the manifest and a resume's identity; each actor reads them again itself (`ItemsRef`:
small, inline constructor arguments) and refuses any whose content changed since the driver read it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decoding.catalog import argsort_ids
from decoding.codes import duplicate_policy, format_rows, semantic_id_matrix
from pipeline import storage as S
from pipeline.config import Config
from pipeline.prepare.splits import sorted_unique
from pipeline.storage import Storage

INDEX_COLUMNS = ["item_id", "semantic_id"]  # what the run reads of the catalog, with the column duplicate_items names


@dataclass
class Items:
    """The run's items as read: the index table and which of its rows a list may hold."""

    table: pa.Table  # the item index, every row: its `index_columns`
    served: np.ndarray | None  # [N] bool over the table's rows: recommendable and not blocked (None: every row)
    info: dict  # the manifest's record of them (`describe`)

    @property
    def identity(self) -> dict:
        """What a resume must find unchanged beside the catalog file: the recommendable set's and the block list's
        contents ({"recommendable": sha256, "blocked": sha256} of their ids)."""
        return self.info["sets"]


@dataclass(frozen=True)
class ItemsRef:
    """The run's items as an actor finds them: where they are and the content the driver read. The actor reads them
    itself, so its constructor arguments stay small and travel inline, never through an object store that a lost
    node can take with it (ray#53727: a restarted actor whose arguments are lost cannot start)."""

    sources: Sources
    catalog_id: str  # the catalog file's content identity (S.content_id)
    identity: dict = field(default_factory=dict)  # Items.identity as the driver read it

    def read(self, storage: Storage) -> Items:
        """The items, refused (ValueError) unless each is still what the run started with."""
        items = read_items(self.sources, storage, record=False)
        fs, path = S.filesystem(self.sources.catalog, storage)
        found = S.content_id(path, fs, storage)
        if found != self.catalog_id:
            raise ValueError(
                f"catalog {self.sources.catalog} changed during the run (was {self.catalog_id}, now {found}): "
                "rerun the date"
            )
        for name, sha in items.identity.items():
            if sha != self.identity.get(name):
                raise ValueError(
                    f"the {name} items ({self.sources.named(name)}) changed during the run (sha256 was "
                    f"{self.identity.get(name)}, now {sha}): rerun the date"
                )
        return items


@dataclass(frozen=True)
class Sources:
    """Where the run's items come from (the config's fields, `{run_date}` filled)."""

    catalog: str
    recommendable: str | None = None
    recommendable_column: str | None = None
    blocked: str | None = None
    blocked_items: tuple[int, ...] = ()
    order_column: str | None = None  # the catalog column duplicate_items orders a semantic ID's items by
    columns: tuple[str, ...] = ()  # the catalog's columns the prompt template writes ({item:COLUMN}), read too

    @classmethod
    def of(cls, cfg: Config, columns=()) -> Sources:
        return cls(
            catalog=cfg.catalog,
            recommendable=cfg.recommendable,
            recommendable_column=cfg.recommendable_column,
            blocked=cfg.blocked,
            blocked_items=tuple(cfg.blocked_items),
            order_column=duplicate_policy(cfg.duplicate_items)[1],
            columns=tuple(columns),
        )

    def named(self, what: str) -> str:
        """The source of the recommendable set or the block list, in words."""
        if what == "recommendable":
            if self.recommendable:
                return self.recommendable
            return f"column {self.recommendable_column} of {self.catalog}" if self.recommendable_column else "all"
        given = [self.blocked] * bool(self.blocked) + [f"blocked_items ({len(self.blocked_items)})"] * bool(
            self.blocked_items
        )
        return " + ".join(given) or "none"


def read_items(src: Sources, storage: Storage, record: bool = True) -> Items:
    """The index, the recommendable set and the block list -> Items (`record`: with the manifest's record, which
    hashes the whole index; an actor needs only the sets' identity). A missing file raises FileNotFoundError naming
    it; a file that is not parquet, or lacks its column, ValueError naming it. Sorts and binary searches: no set of
    ids is hashed or sorted twice."""
    table = read_catalog(src, storage)
    ids = table.column("item_id").to_numpy().astype(np.int64)  # [N]
    order = argsort_ids(ids)  # [N]: the ids in order, so that every lookup below is a merge
    index = ids[order]  # [N] sorted (repeats are the catalog parser's to refuse)
    unknown = 0  # ids of the recommendable set the index lacks
    if src.recommendable_column:
        listed = _column_mask(table, src.recommendable_column, src.catalog)  # [N]
        table, in_set = table.select(list(dict.fromkeys(index_columns(src) + list(src.columns)))), index[listed[order]]
    elif src.recommendable:
        given = read_ids(src.recommendable, storage, "recommendable")  # [R] sorted, distinct
        listed, known = np.empty(len(ids), bool), member(index, given)  # [N], [R]
        listed[order] = member(given, index)
        in_set, unknown = given[known], int((~known).sum())
    else:
        listed, in_set = np.ones(len(ids), bool), index
    blocks = np.asarray(src.blocked_items, dtype=np.int64)
    if src.blocked:
        blocks = np.concatenate([blocks, read_ids(src.blocked, storage, "blocked")])
    blocks = sorted_unique(blocks)  # [B]
    blocked = member(blocks, ids)  # [N]
    served = listed & ~blocked
    if not served.any():
        raise ValueError(
            f"no item is left to recommend: the recommendable set ({src.named('recommendable')}) holds "
            f"{int(listed.sum())} of the catalog's {len(ids)} items ({src.catalog}), and the block list "
            f"({src.named('blocked')}) blocks {int((listed & blocked).sum())} of them"
        )
    sets = {"recommendable": ids_sha256(in_set), "blocked": ids_sha256(blocks)}
    info = {"sets": sets}
    if record:
        unknown_blocks = int((~member(index, blocks)).sum())
        info = describe(src, table, ids, listed, blocked, len(blocks), (unknown, unknown_blocks), sets)
    return Items(table, None if served.all() else served, info)


def member(sorted_ids: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """sorted_ids [M] (ascending), ids [N] -> [N] bool: each id is one of sorted_ids (a binary search each: fast when
    ids are sorted too, or few)."""
    if not len(sorted_ids):
        return np.zeros(len(ids), bool)
    at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return sorted_ids[at] == ids


def index_columns(src: Sources) -> list[str]:
    """The catalog's columns the index is built from: item_id, semantic_id and the column duplicate_items orders
    a semantic ID's items by (when it names one)."""
    return list(dict.fromkeys(INDEX_COLUMNS + [c for c in [src.order_column] if c]))


def read_catalog(src: Sources, storage: Storage) -> pa.Table:
    """The catalog's index columns (`index_columns`; the recommendable column, when named, and the columns the
    prompt template writes); item ids integers, never null (the index's other checks are the catalog parser's:
    decoding.catalog.Catalog.from_table)."""
    named = [src.recommendable_column, *src.columns]
    columns = list(dict.fromkeys(index_columns(src) + [c for c in named if c]))
    table = _read(src.catalog, storage, "catalog", columns)
    ids = table.column("item_id")
    if ids.null_count:
        nulls = np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))
        raise ValueError(f"catalog {src.catalog}: column 'item_id' is null in rows {format_rows(nulls)}")
    return table


def read_ids(uri: str, storage: Storage, what: str) -> np.ndarray:
    """A parquet file (or folder) of item ids, column `item_id` -> the distinct ids, sorted [M] int64."""
    table = _read(uri, storage, what, ["item_id"])
    ids = table.column("item_id")
    if ids.null_count:
        nulls = np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))
        raise ValueError(f"{what} {uri}: column 'item_id' is null in rows {format_rows(nulls)}")
    return sorted_unique(ids.to_numpy().astype(np.int64))


def _read(uri: str, storage: Storage, what: str, columns: list[str]) -> pa.Table:
    """`columns` of a parquet file or folder (read as the input is: every file's schema unified,
    `S.unified_dataset`), `item_id` read as int64 whatever integer type each file holds. Missing: FileNotFoundError;
    not parquet, a column missing or of two types, ids not integers or beyond int64: ValueError naming it."""
    import pyarrow.dataset as pads

    if not S.exists(uri, storage):
        raise FileNotFoundError(f"{what} {uri} not found")
    fs, path = S.filesystem(uri, storage)
    try:
        data = S.retrying(
            lambda: S.unified_dataset(pads.dataset(path, filesystem=fs, format="parquet"), f"{what} {uri}", columns),
            storage,
            f"LIST {uri}",
        )
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"{what} {uri}: cannot be read as parquet ({e})") from None
    missing = [c for c in columns if c not in data.schema.names]
    if missing:
        raise ValueError(f"{what} {uri}: missing column(s) {missing} (has {data.schema.names})")
    kind = data.schema.field("item_id").type
    if not pa.types.is_integer(kind):
        raise ValueError(f"{what} {uri}: column 'item_id' must hold integer item ids, got {kind}")
    schema = data.schema.set(data.schema.get_field_index("item_id"), pa.field("item_id", pa.int64()))

    def read() -> pa.Table:
        return pads.dataset(path, filesystem=fs, format="parquet", schema=schema).to_table(columns=columns)

    try:
        return S.retrying(read, storage, f"GET {uri}")
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"{what} {uri}: cannot be read as parquet, item ids as int64 ({e})") from None


def _column_mask(table: pa.Table, column: str, source: str) -> np.ndarray:
    """A boolean column of the catalog -> [N] bool (null: not recommendable)."""
    values = table.column(column)
    if not pa.types.is_boolean(values.type):
        raise ValueError(f"catalog {source}: recommendable_column {column!r} must be boolean, got {values.type}")
    return pc.fill_null(values, False).to_numpy(zero_copy_only=False).astype(bool)


def ids_sha256(ids: np.ndarray) -> str:
    """A set of item ids, sorted and distinct [M] -> the sha256 of them as little-endian int64: the set's content,
    whatever file or order it came in."""
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()


def index_sha256(table: pa.Table, ids: np.ndarray) -> str:
    """The item index's content: its (item id, semantic ID) pairs, in item id order, as little-endian int64 ids and
    int64 codes (the code count per item first)."""
    order = np.argsort(ids, kind="stable")
    codes = semantic_id_matrix(table, "catalog")[order]  # [N, L]
    h = hashlib.sha256(np.int64(codes.shape[1]).astype("<i8").tobytes())
    h.update(ids[order].astype("<i8").tobytes())
    h.update(codes.astype("<i8").tobytes())
    return h.hexdigest()


def describe(src: Sources, table: pa.Table, ids, in_set, blocked, blocks: int, unknown: tuple, sets: dict) -> dict:
    """The manifest's record of the run's items: the index (uri, items, sha256), the recommendable set and the block
    list (source, size, sha256 of their ids, ids the index lacks: `unknown` of each) and the partition of the index:
    `recommendable` (a list may hold them), `blocked` (in the recommendable set, removed by the block list),
    `not_recommendable` (outside the set). ids [N], in_set [N], blocked [N]."""
    return {
        "uri": src.catalog,
        "items": len(ids),
        "sha256": index_sha256(table, ids),
        "recommendable_set": {
            "source": src.named("recommendable"),
            "items": int(in_set.sum()),
            "sha256": sets["recommendable"],
            "unknown_ids": unknown[0],
        },
        "block_list": {
            "source": src.named("blocked"),
            "ids": blocks,
            "sha256": sets["blocked"],
            "unknown_ids": unknown[1],
        },
        "recommendable": int((in_set & ~blocked).sum()),
        "blocked": int((in_set & blocked).sum()),
        "not_recommendable": int((~in_set).sum()),
        "sets": sets,
    }
