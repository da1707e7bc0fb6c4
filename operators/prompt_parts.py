"""The pieces a compiled prompt template is made of (operators/prompts.py): the template's symbols (atoms, text,
placeholders), its histories (`Region`: an item pattern cut where its text meets atoms), the spans of text between
atoms (`Span`, classified by what they read), runs of atoms (`Block`), a batch's rows as the renderer reads them
(`Batch`, `Occurrences`), the catalog columns a template writes (`ItemTexts`) and a batch's prompts as chunks of ids
(`Layout`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from decoding.catalog import ItemTokens, argsort_ids
from decoding.codes import format_rows, ragged_ranges
from decoding.templates import Field, PromptTemplate, as_text, parse
from operators.text import BREAK, TextTokenizer, chat_skeleton

CODES = "codes"  # an item's code tokens, among a template's symbols


def ragged_arrays(histories) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A batch of histories -> (values [T] int64, starts [B], lengths [B], nulls [B] bool).

    Accepts a pyarrow (chunked) list array (zero-copy, no loop) or any sequence of
    int arrays / lists / None (e.g. the object column of a Ray numpy batch).
    """
    if isinstance(histories, pa.ChunkedArray):
        histories = histories.combine_chunks() if histories.num_chunks else pa.array([], pa.list_(pa.int64()))
    if isinstance(histories, (pa.ListArray, pa.LargeListArray)):
        offsets = histories.offsets.to_numpy().astype(np.int64)  # [B + 1]
        nulls = histories.is_null().to_numpy(zero_copy_only=False)
        lengths = np.where(nulls, 0, np.diff(offsets))
        values = histories.values
        if values.null_count:  # a null item id -> -1, reported as an unknown item
            values = values.fill_null(-1)
        values = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return values, offsets[:-1], lengths, nulls
    rows = list(histories)
    nulls = np.array([h is None for h in rows], dtype=bool)
    arrays = [np.zeros(0, np.int64) if h is None else np.asarray(h, dtype=np.int64).ravel() for h in rows]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    values = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    starts = np.cumsum(lengths) - lengths
    return values, starts, lengths, nulls


def history_window(histories, history_len: int):
    """The items a prompt uses: the last `history_len` of each history -> (item ids [U], row of each [U],
    items per row [B]). Histories: see `ragged_arrays`."""
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    values, starts, lengths, _ = ragged_arrays(histories)  # [T], [B], [B]
    used = np.minimum(lengths, history_len)  # [B]
    items = values[ragged_ranges(starts + lengths - used, used)]  # [U]
    return items, np.repeat(np.arange(len(lengths)), used), used


def not_utf8(column: pa.Array) -> np.ndarray:
    """A column [B] -> the rows [R] of its strings that are not valid UTF-8 (a writer that let a lone surrogate
    through): checked at C speed, the rows found in Python only when there are some."""
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return np.zeros(0, np.int64)
    try:
        column.validate(full=True)
        return np.zeros(0, np.int64)
    except pa.ArrowInvalid:
        raw = column.cast(pa.large_binary()).to_pylist()
        return np.array([r for r, v in enumerate(raw) if v is not None and not _is_utf8(v)], np.int64)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@dataclass
class ItemTexts:
    """The catalog's columns a template writes ({item:COLUMN}), by item id."""

    item_ids: np.ndarray  # [N] int64 sorted
    columns: dict[str, pa.Array]  # column -> [N] values, row i is item_ids[i]'s

    @classmethod
    def from_table(cls, table: pa.Table | None, columns: list[str]) -> ItemTexts:
        if not columns:
            return cls(np.zeros(0, np.int64), {})
        missing = [c for c in columns if table is None or c not in table.column_names]
        if missing:
            raise ValueError(f"the prompt template writes the catalog's {missing}, which the catalog lacks")
        ids = table.column("item_id").to_numpy().astype(np.int64)
        for c in columns:
            bad = not_utf8(table.column(c).combine_chunks())
            if len(bad):
                raise ValueError(f"the catalog's {c} is not valid UTF-8 text for item ids {format_rows(ids[bad])}")
        order = argsort_ids(ids)
        take = pa.array(order)
        return cls(ids[order], {c: table.column(c).combine_chunks().take(take) for c in columns})

    def rows(self, item_ids: np.ndarray) -> np.ndarray:
        """item ids [U] -> their rows [U] (every one is in the catalog: histories are validated first)."""
        return np.minimum(np.searchsorted(self.item_ids, item_ids), max(len(self.item_ids) - 1, 0))

    def values(self, column: str, rows: np.ndarray) -> list[str]:
        return as_text(self.columns[column].take(pa.array(rows, pa.int64())))


class Span(NamedTuple):
    """Text between two atoms: its parts ("t", text) | ("u", column) | ("i", history, which, column) | ("n", history,
    which), `which` naming the item: first or last of the history's window, self (this item), prev (the one before)."""

    parts: tuple
    leading: bool = False  # the span starts the text the tokenizer is given (no added token before it)

    @property
    def refs(self) -> set:
        return {(p[1], p[2]) for p in self.parts if p[0] in "in"}

    @property
    def kind(self) -> str:
        """const, index, item or each (the module's docstring)."""
        users, items = any(p[0] == "u" for p in self.parts), {(p[1], p[2]) for p in self.parts if p[0] == "i"}
        indexes = {(p[1], p[2]) for p in self.parts if p[0] == "n"}
        if users or len(items) > 1 or (items and indexes):
            return "each"
        return "item" if items else "index" if indexes else "const"


class Block(NamedTuple):
    """Atoms back to back: ids [W], -1 - j where an item's level-j code token goes."""

    ids: np.ndarray


@dataclass
class Region:
    """A history placeholder compiled: the item pattern cut where its text meets atoms."""

    column: str
    window: int
    head: list  # text parts of an item before its first atom (they join the text before the history: first item)
    body: list  # Block and Span pieces from the first atom to the last (refs: self)
    junction: list  # pieces between two items: the tail of one, the separator, the head of the next (prev, self)
    tail: list  # text parts after an item's last atom (they join the text after the history: last item)

    @property
    def fused(self) -> bool:
        """Is every written item the same atoms around its codes, back to back (OpenOneRec's
        `<|sid_begin|>{codes}<|sid_end|>`)? Then a row's items are one chunk."""
        return not self.junction and len(self.body) == 1 and isinstance(self.body[0], Block)

    def item_width(self) -> int:
        """Tokens of one item of a fused history."""
        return len(self.body[0].ids)


@dataclass
class Layout:
    """A batch's prompts as chunks of ids, each a range of one source array, in each row's order."""

    user: np.ndarray  # [C] the chunk's row
    pos: np.ndarray  # [C] its place among the row's chunks
    src: np.ndarray  # [C] which source
    start: np.ndarray  # [C] where in it
    length: np.ndarray  # [C]
    region: np.ndarray  # [C] the history it writes an item of (its number in the template; -1: none)
    q: np.ndarray  # [C] that item's place in the window (0: the oldest written)
    joint: np.ndarray  # [C] bool: the text joining that item to the one before it
    sources: list = field(default_factory=list)

    ARRAYS = ("user", "pos", "src", "start", "length", "region", "q", "joint")

    def tokens(self, rows: int) -> np.ndarray:
        """Tokens of each row [rows]."""
        return np.bincount(self.user, weights=self.length, minlength=rows).astype(np.int64)

    def without(self, rows: np.ndarray) -> Layout:
        keep = ~np.isin(self.user, rows)
        return Layout(*(getattr(self, a)[keep] for a in self.ARRAYS), self.sources)

    def plus(self, other: Layout) -> Layout:
        shift = {"src": len(self.sources)}
        arrays = (np.concatenate([getattr(self, a), getattr(other, a) + shift.get(a, 0)]) for a in self.ARRAYS)
        return Layout(*arrays, self.sources + other.sources)

    def item_tokens(self, rows: np.ndarray, region: int, most: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows' [R] (sorted) items of one history -> (tokens of each item, its joining text included [R, most];
        tokens of the text joining it to the one before [R, most])."""
        mine = (self.region == region) & np.isin(self.user, rows)
        at = np.searchsorted(rows, self.user[mine]) * most + self.q[mine]
        whole = np.bincount(at, weights=self.length[mine], minlength=len(rows) * most)
        joint = np.bincount(at, weights=self.length[mine] * self.joint[mine], minlength=len(rows) * most)
        return whole.reshape(len(rows), most), joint.reshape(len(rows), most)


class Occurrences(NamedTuple):
    """Where a piece is written: rows [O] of the batch, once per row (`top`) or once per written item of a history
    (`items`: q [O] its place in the window, 0 the oldest written)."""

    batch: Batch
    row: np.ndarray  # [O]
    q: np.ndarray  # [O] (top: -1)
    column: str | None  # the history of an item occurrence
    used: dict  # {history: [B] items written}

    @classmethod
    def top(cls, batch: Batch, rows: np.ndarray, used: dict) -> Occurrences:
        return cls(batch, rows, np.full(len(rows), -1), None, used)

    @classmethod
    def items(cls, batch: Batch, rows: np.ndarray, used: dict, column: str) -> Occurrences:
        n = used[column][rows]
        return cls(batch, np.repeat(rows, n), ragged_ranges(np.zeros(len(rows), np.int64), n), column, used)

    def position(self, ref: tuple) -> np.ndarray:
        """The place in its window [O] of the item `ref` (history, which) names."""
        column, which = ref
        if which in ("first", "last"):
            return np.zeros(len(self.row), np.int64) if which == "first" else self.used[column][self.row] - 1
        return self.q if which == "self" else self.q - 1

    def index(self, ref: tuple) -> np.ndarray:
        """The 1-based index the prompt writes for that item [O]."""
        return self.position(ref) + 1

    def item_ids(self, ref: tuple) -> np.ndarray:
        """The item ids [O] `ref` names."""
        return self.batch.item_ids(ref[0], self.row, self.position(ref), self.used)

    def codes(self) -> np.ndarray:
        """The code token ids [O, L] of each occurrence's own item."""
        ids = self.item_ids((self.column, "self"))
        tokens, known = self.batch.items.lookup(ids)
        if not known.all():
            raise ValueError(unvalidated(np.unique(self.row[~known])))
        return tokens


class Batch:
    """One batch's rows as the renderer reads them: each history (values, starts, lengths), the user fields as
    text."""

    def __init__(self, windows: dict[str, int], rows: pa.Table, items: ItemTokens):
        self.rows, self.items = rows, items
        self.histories, self.used = {}, {}  # history -> (values [T], starts [B], lengths [B]); [B] written
        for c, w in windows.items():
            if c not in rows.column_names:
                raise ValueError(f"the prompt template writes the history {c!r}, which the rows lack")
            values, starts, lengths, _ = ragged_arrays(rows.column(c))
            self.histories[c], self.used[c] = (values, starts, lengths), np.minimum(lengths, w)
            if c == "history" and (lengths == 0).any():
                raise ValueError(unvalidated(np.flatnonzero(lengths == 0)))
        self._users: dict[str, list[str]] = {}

    def item_ids(self, column: str, rows: np.ndarray, q: np.ndarray, used: dict) -> np.ndarray:
        """The item ids [O] at window place q of rows, the window being each history's last `used` items."""
        values, starts, lengths = self.histories[column]
        return values[starts[rows] + lengths[rows] - used[column][rows] + q]

    def user(self, column: str) -> list[str]:
        """A user column as the prompt writes it [B]."""
        if column not in self._users:
            if column not in self.rows.column_names:
                raise ValueError(f"the prompt template writes the column {column!r}, which the rows lack")
            self._users[column] = as_text(self.rows.column(column))
        return self._users[column]


def unvalidated(rows: np.ndarray) -> str:
    return (
        f"rows {format_rows(rows)} have an empty history or items missing from the catalog: validate them first "
        "(operators.validate)"
    )


def top_symbols(template: PromptTemplate, tokenizer, text: TextTokenizer, chat: str | None) -> list:
    """The prompt's symbols in order: atom ids (BOS, the template text's added tokens), ("t", text), BREAK, and
    the user and history placeholders (Field)."""
    if chat is not None:
        parts = chat_skeleton(template, tokenizer, chat)
    else:
        parts = parse(template.instruction) + [BREAK] * bool(template.instruction)
        parts += parse(template.prefix) + [Field("history", "history")] + parse(template.suffix)
    out = [tokenizer.bos_token_id] if template.uses_bos(tokenizer) else []
    for p in parts:
        if isinstance(p, str) and p != BREAK:
            out += [a if isinstance(a, int) else ("t", a) for a in text.atoms(p)]
        else:
            out.append(p)
    return out


def item_symbols(template: PromptTemplate, text: TextTokenizer, pattern: str) -> list:
    """Item-pattern text -> symbols: atom ids, CODES, ("t", text), ("n",) for {index}, ("i", column)."""
    out = []
    for p in parse(pattern, "item") if pattern else []:
        if isinstance(p, str):
            out += [a if isinstance(a, int) else ("t", a) for a in text.atoms(p)]
        else:
            out.append(CODES if p.kind == "codes" else ("n",) if p.kind == "index" else ("i", p.column))
    return out


def is_hard(symbol) -> bool:
    return isinstance(symbol, (int, np.integer)) or symbol == CODES


def named_item(part: tuple, column: str, which: str) -> tuple:
    """An item pattern's text part with the item it reads named: (history, which)."""
    if part[0] == "i":
        return ("i", column, which, part[1])
    if part[0] == "n":
        return ("n", column, which)
    return part


def merge_blocks(slots: list) -> list:
    """Consecutive atom Blocks joined (a Block of code tokens is joined too: its -1 - j marks stay)."""
    out = []
    for s in slots:
        if isinstance(s, Block) and out and isinstance(out[-1], Block):
            out[-1] = Block(np.concatenate([out[-1].ids, s.ids]))
        elif not (isinstance(s, Block) and not len(s.ids)):
            out.append(s)
    return out


def pieces_per_item(region: Region) -> int:
    return len(region.junction) + len(region.body)


def ragged_ids(rows: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lists of ids [O] -> (their ids back to back, starts [O], lengths [O])."""
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(lengths.sum()))
    return flat, np.cumsum(lengths) - lengths, lengths


def stack_chunks(chunks: list) -> Layout:
    """[(rows [O], pos [O], source, starts [O], lengths [O], region, q, joint)] -> one Layout."""
    size = [len(c[0]) for c in chunks]
    cat = lambda i, kind: np.concatenate([np.broadcast_to(c[i], n) for c, n in zip(chunks, size)]).astype(kind)  # noqa: E731
    src = np.repeat(np.arange(len(chunks)), size)
    arrays = [cat(0, np.int64), cat(1, np.int64), src, cat(3, np.int64), cat(4, np.int64)]
    arrays += [cat(5, np.int64), cat(6, np.int64), cat(7, bool)]
    return Layout(*arrays, [c[2] for c in chunks])


def list_array(histories) -> pa.Array:
    """Histories given as arrow lists, numpy arrays or lists -> a list<int64> array."""
    if isinstance(histories, (pa.Array, pa.ChunkedArray)):
        return histories
    values, starts, lengths, nulls = ragged_arrays(histories)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = values[ragged_ranges(starts, lengths)]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int64()), mask=pa.array(nulls))
