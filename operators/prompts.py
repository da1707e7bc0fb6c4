"""Prompts for generative recommenders: users' rows -> left-padded token ids, written the way the model's prompt
template says (decoding/templates.py), with no tokenizer call per user for what repeats.

A `Renderer` is a template compiled against a tokenizer once (`compile`): its text cut at its atoms (added tokens,
BOS; operators/text.py), each history placeholder a repeated item pattern whose code tokens are atoms too, and every
span of text between two atoms classified by what it reads (`Span.kind`):

    const   nothing from data: tokenized at compile time (a system prompt, the text between two items)
    index   an item's index only: tokenized once per index value ("3. " in LC-Rec's numbered list)
    item    one item's catalog fields: tokenized once per catalog item, when first met, and kept (a title)
    each    a user's fields, or several items': tokenized per user, one batch call per batch (a profile, a query)

Rendering a batch assembles each user's ids from these pieces and the items' code tokens with numpy ragged ranges:
no Python loop over users' tokens. The ids equal the tokenizer's on the rendered text (operators/text.py says how text
from data stays text); compiling checks that on probe users against the tokenizer itself, so a tokenizer that would
merge text across a code token's boundary is refused, never rendered differently.

A prompt longer than `max_prompt_tokens` drops its oldest history items until it fits (`too_long: drop_oldest`: the
histories in the order the prompt writes them, `history` down to one item, the others to none), or is left out
(`reject`, or when nothing more can be dropped): `Prompts.kept` says which rows were rendered.

For the `codes` template on Amazon Beauty (L = 4, 20 items) a prompt has at most 1 + 20 * 4 = 81 tokens; for `lcrec`
about 44 + 20 * 7 tokens with a BPE tokenizer; OpenOneRec's, about 60 + 5 per history item.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from decoding.catalog import ItemTokens, argsort_ids
from decoding.codes import format_rows, ragged_ranges
from decoding.templates import Field, PromptTemplate, parse
from operators.spec import TOO_LONG
from operators.text import BREAK, TextTokenizer, chat_skeleton, chat_template_text, library_ids, prompt_pieces

CODES = "codes"  # an item's code tokens, among a template's symbols

# ---------------------------------------------------------------- ragged helpers


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


def as_text(column) -> list[str]:
    """A column of strings or numbers [B] -> each value as the prompt writes it [B] (numbers as Python writes them;
    a null: "")."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks else pa.array([], column.type)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if not is_text(column.type):
        raise ValueError(f"a {column.type} column cannot be written as text (strings, integers, floats, booleans)")
    strings = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    return [("" if v is None else v if strings else str(v)) for v in column.to_pylist()]


def is_text(kind: pa.DataType) -> bool:
    """Can a column of this type fill a {user:...} or {item:...} placeholder?"""
    t = pa.types
    if t.is_dictionary(kind):
        kind = kind.value_type
    return (
        t.is_string(kind) or t.is_large_string(kind) or t.is_integer(kind) or t.is_floating(kind) or t.is_boolean(kind)
    )


# ---------------------------------------------------------------- prompts


class Prompts(NamedTuple):
    input_ids: torch.Tensor  # [B', S] int64, left-padded with pad_id
    attention_mask: torch.Tensor  # [B', S] int64, 0 on padding
    kept: np.ndarray | None = None  # [B] bool: the input rows rendered (None: all); the others were too long
    truncated: np.ndarray | None = None  # [B'] bool: rendered after dropping their oldest history items


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


@dataclass
class Renderer:
    """A prompt template compiled against a tokenizer (`compile`), rendering batches of rows (`render`)."""

    template: PromptTemplate
    levels: int  # L code tokens per item
    pad_id: int
    answer: np.ndarray  # [T] int64: the forced tokens after an item's codes, scored (answer_ids; empty: none)
    text: TextTokenizer
    top: list  # the prompt's symbols: atom ids, BREAK, ("t", text), Field (user, history)
    regions: dict[str, Region]
    item_texts: ItemTexts
    max_prompt_tokens: int | None = None  # None: no bound
    too_long: str = "drop_oldest"
    chat: str | None = None  # the chat template the messages are written with (None: a plain template)
    max_len: int = 0  # tokens of the longest prompt (max_prompt_tokens where the template writes text from data)
    plans: dict = field(default_factory=dict)  # which histories are written -> the prompt's slots
    cache: dict = field(default_factory=dict)  # Span -> what it has tokenized (`_evaluate`)

    @property
    def max_items(self) -> int:
        return self.template.max_items

    @property
    def windows(self) -> dict[str, int]:
        """{history column: its window}, `history` first."""
        return {c: r.window for c, r in self.regions.items()}

    @property
    def user_columns(self) -> list[str]:
        return self.template.user_columns

    @property
    def prefix_ids(self) -> np.ndarray:
        """The token ids every prompt starts with (BOS and the template's fixed text up to the first item's codes or
        the first text from data: the part to prefill once, decoding.beam.Prefix)."""
        heads = [self._leading(self._plan(p)) for p in self._patterns()]
        p = min(len(h) for h in heads)
        same = np.all([h[:p] == heads[0][:p] for h in heads], axis=0) if p else np.ones(0, bool)
        return heads[0][: int(np.argmin(same)) if not same.all() else p].copy()

    @classmethod
    def compile(
        cls,
        template: PromptTemplate,
        tokenizer,
        probes: np.ndarray,
        catalog: pa.Table | None = None,
        model_dir=None,
        max_prompt_tokens: int | None = None,
        too_long: str = "drop_oldest",
    ) -> Renderer:
        """The template against the tokenizer: its chat template rendered once (a file in `model_dir`, else the
        tokenizer's), its text cut at atoms, its catalog columns read from `catalog`; checked on probe users (probes
        [P, L]: code token ids of real items) against the tokenizer on the written text. Refused with a message when
        the tokenizer does not keep the code tokens apart from the text, the template needs a BOS token the tokenizer
        lacks, or the chat template changes message content."""
        if too_long not in TOO_LONG:
            raise ValueError(f"too_long must be one of {TOO_LONG}, got {too_long!r}")
        probes = np.asarray(probes, dtype=np.int64)
        text = TextTokenizer(tokenizer)
        chat = chat_template_text(template, tokenizer, model_dir)
        r = cls(
            template,
            probes.shape[1],
            _pad_id(template, tokenizer),
            answer_ids(template, tokenizer, probes),
            text,
            _top(template, tokenizer, text, chat),
            {},
            ItemTexts.from_table(catalog, template.item_columns),
            max_prompt_tokens,
            too_long,
            chat,
        )
        r.regions = {c: r._region(c, w) for c, w in template.histories.items()}
        r.max_len = r._check(tokenizer, chat, probes)
        return r

    def _region(self, column: str, window: int) -> Region:
        """A history placeholder: the item pattern's symbols cut at its first and last atom (codes included)."""
        item = _item_symbols(self.template, self.text, self.template.item)
        hard = [k for k, x in enumerate(item) if _hard(x)]
        head, body, tail = item[: hard[0]], item[hard[0] : hard[-1] + 1], item[hard[-1] + 1 :]
        sep = _item_symbols(self.template, self.text, self.template.separator)
        junction = [_ref(p, column, "prev") for p in tail] + sep + [_ref(p, column, "self") for p in head]
        body = [x if _hard(x) else _ref(x, column, "self") for x in body]
        return Region(column, window, head, self._pieces_of(body), self._pieces_of(junction), tail)

    def _pieces_of(self, symbols: list) -> list:
        """Symbols -> Blocks (atoms and code tokens back to back) and Spans (text between them)."""
        out, span = [], []
        for x in symbols:
            if _hard(x):
                if span:
                    out.append(self._span(tuple(span)))
                    span = []
                ids = np.arange(-1, -1 - self.levels, -1) if x == CODES else np.array([x])
                out.append(Block(ids.astype(np.int64)))
            else:
                span.append(x)
        return _merge(out + ([self._span(tuple(span))] if span else []))

    # ---------------------------------------------------------------- rendering

    def render(self, rows, items: ItemTokens, skip: int = 0) -> Prompts:
        """Rows (a table with `history`, the template's other history columns and its user columns; or just the
        histories, item ids oldest first) validated first (operators/validate.py: `history` non-empty, every item a
        prompt uses in the catalog) -> left-padded prompts of their windows, without their first `skip` tokens (a
        shared prefix prefilled elsewhere: see prefix_ids); rows too long left out (`Prompts.kept`)."""
        if items.levels != self.levels:
            raise ValueError(f"the catalog has {items.levels} code tokens per item, the renderer {self.levels}")
        rows = rows if isinstance(rows, pa.Table) else pa.table({"history": _list_array(rows)})
        batch = Batch(self, rows, items)
        used = {c: u.copy() for c, u in batch.used.items()}  # [B] items written, per history
        layout = self._layout(batch, np.arange(rows.num_rows), used)
        tokens = layout.tokens(rows.num_rows)
        kept, truncated = np.ones(rows.num_rows, bool), np.zeros(rows.num_rows, bool)
        if self.max_prompt_tokens is not None:
            layout, tokens, kept, truncated = self._fit(batch, layout, tokens, used)
        return self._prompts(layout, tokens, kept, truncated, skip)

    def _prompts(self, layout: Layout, tokens: np.ndarray, kept, truncated, skip: int) -> Prompts:
        """The chunks of the kept rows -> left-padded ids [B', S] and mask (their first `skip` tokens left out)."""
        rows = np.flatnonzero(kept)
        t = tokens[rows] - skip  # [B'] tokens written per row
        if (t < 0).any():
            raise ValueError(f"skip {skip} is longer than a prompt ({int(tokens[rows].min())} tokens)")
        width = int(t.max()) if len(rows) else 0
        order = np.lexsort((layout.pos, layout.user))  # [C] chunks row by row, in order
        order = order[kept[layout.user[order]]]
        user, start, length, src = layout.user[order], layout.start[order], layout.length[order], layout.src[order]
        new_row = np.cumsum(kept) - 1  # [B] each kept row's place among them
        at = np.cumsum(length) - length  # [C'] each chunk's first token among the kept rows' tokens, back to back
        at -= (np.cumsum(tokens[rows]) - tokens[rows])[new_row[user]]  # ... within its row
        cut = np.clip(skip - at, 0, length)  # [C'] its tokens inside the skipped prefix
        start, length, at = start + cut, length - cut, at + cut - skip
        dest = new_row[user] * width + (width - t)[new_row[user]] + at  # [C'] where its first token goes
        ids = np.full((len(rows), width), self.pad_id, np.int64)
        flat = ids.reshape(-1)
        for s, source in enumerate(layout.sources):
            mine = (src == s) & (length > 0)
            if mine.any():
                flat[ragged_ranges(dest[mine], length[mine])] = source[ragged_ranges(start[mine], length[mine])]
        mask = (np.arange(width)[None, :] >= (width - t)[:, None]).astype(np.int64)
        return Prompts(torch.from_numpy(ids), torch.from_numpy(mask), kept, truncated[rows])

    def _fit(self, batch: Batch, layout: Layout, tokens: np.ndarray, used: dict):
        """Rows longer than max_prompt_tokens: their oldest history items dropped until they fit (drop_oldest), the
        rest left out -> (layout, tokens, kept [B], truncated [B])."""
        limit, b = self.max_prompt_tokens, len(tokens)
        kept, truncated = np.ones(b, bool), np.zeros(b, bool)
        over = np.flatnonzero(tokens > limit)
        while len(over):
            if self.too_long == "reject":
                kept[over] = False
                break
            dropped = self._drop(layout, over, tokens[over] - limit, used)
            kept[over[~dropped]] = False
            over = over[dropped]
            truncated[over] = True
            if not len(over):
                break
            redone = self._layout(batch, over, used)
            layout = layout.without(over).plus(redone)
            tokens[over] = redone.tokens(b)[over]
            over = over[tokens[over] > limit]
        return layout, tokens, kept, truncated

    def _drop(self, layout: Layout, rows: np.ndarray, excess: np.ndarray, used: dict) -> np.ndarray:
        """The rows' [R] oldest items dropped, history by history in prompt order (`history` keeps one), the fewest
        whose tokens (with the text joining the next) cover `excess` [R] -> [R] bool: a row dropped something. The
        text around the first and last items is not counted: the caller renders again and drops more if needed."""
        left, dropped = excess.astype(np.int64), np.zeros(len(rows), bool)
        for h, c in enumerate(self.regions):
            n = used[c][rows]  # [R]
            can = np.where(left > 0, n - int(c == "history"), 0)  # [R] items that may go
            most = int(n.max()) if len(n) else 0
            if most == 0 or not can.any():
                continue
            if self.regions[c].fused:
                whole, joint = np.full((len(rows), most), self.regions[c].item_width()), np.zeros((len(rows), most))
            else:
                whole, joint = layout.item_tokens(rows, h, most)  # [R, most]
            after = np.concatenate([joint[:, 1:], np.zeros((len(rows), 1))], 1)  # the text joining the next item
            gain = (np.cumsum(whole, axis=1) + after).astype(np.int64)  # [R, most]: tokens the first d + 1 free
            enough = gain >= left[:, None]
            d = np.where(enough.any(1), np.argmax(enough, axis=1) + 1, most)
            cut = np.minimum(d, can)
            used[c][rows] = n - cut
            dropped |= cut > 0
            left = np.where(cut > 0, left - gain[np.arange(len(rows)), np.maximum(cut - 1, 0)], left)
        return dropped

    # ---------------------------------------------------------------- layout

    def _patterns(self) -> list[tuple]:
        """Every combination of written histories (the `history` column always holds an item)."""
        options = [(True,) if c == "history" else (False, True) for c in self.regions]
        return list(itertools.product(*options))

    def _plan(self, pattern: tuple) -> list:
        """The prompt's slots when the histories `pattern` says are written (the others write nothing): Block (atoms),
        Span (text) and Region pieces, in order."""
        if pattern in self.plans:
            return self.plans[pattern]
        out, span = [], []

        def flush():
            if span:
                out.append(self._span(tuple(span)))
                span.clear()

        written = dict(zip(self.regions, pattern))
        for el in self.top:
            if isinstance(el, (int, np.integer)):
                flush()
                out.append(Block(np.array([el], np.int64)))
            elif el == BREAK:
                flush()
            elif not isinstance(el, Field):
                span.append(el)
            elif el.kind == "user":
                span.append(("u", el.column))
            elif written[el.column]:
                r = self.regions[el.column]
                span += [_ref(p, el.column, "first") for p in r.head]
                flush()
                out.append(r)
                span += [_ref(p, el.column, "last") for p in r.tail]
        flush()
        self.plans[pattern] = out = _merge(out)
        return out

    def _span(self, parts: tuple) -> Span | Block:
        """A span of text: tokenized now when it reads nothing from data (a Block of its ids)."""
        merged = []
        for p in parts:
            if p[0] == "n" and p[2] == "first":
                p = ("t", "1")  # the first item's index
            if merged and p[0] == merged[-1][0] == "t":
                merged[-1] = ("t", merged[-1][1] + p[1])
            else:
                merged.append(p)
        s = Span(tuple(merged))
        if s.kind == "const":
            return Block(np.asarray(self.text.encode([s.parts[0][1]])[0] if s.parts else [], np.int64))
        return s

    def _leading(self, plan: list) -> np.ndarray:
        """The ids a plan starts with whatever the rows: its leading atoms and constant text, and the atoms before
        the first item's codes."""
        out = []
        for slot in plan:
            if isinstance(slot, Region):
                slot = slot.body[0] if slot.body and isinstance(slot.body[0], Block) else None
            if not isinstance(slot, Block):
                break
            fixed = slot.ids if (slot.ids >= 0).all() else slot.ids[: int(np.argmax(slot.ids < 0))]
            out.append(fixed)
            if len(fixed) < len(slot.ids):
                break
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _layout(self, batch: Batch, rows: np.ndarray, used: dict) -> Layout:
        """The chunks of `rows` (their histories' last `used` items)."""
        written = np.stack([used[c][rows] > 0 for c in self.regions], axis=1) if self.regions else None
        parts = []
        for pattern in self._patterns():
            group = rows[(written == np.array(pattern)).all(1)] if written is not None else rows
            if len(group):
                parts.append(self._group_layout(batch, group, used, self._plan(pattern)))
        out = parts[0] if parts else Layout(*(np.zeros(0, np.int64),) * 7, np.zeros(0, bool))
        for p in parts[1:]:
            out = out.plus(p)
        return out

    def _group_layout(self, batch: Batch, rows: np.ndarray, used: dict, plan: list) -> Layout:
        """The chunks of rows [G] sharing one plan: per slot, one chunk per row, or per written item and piece."""
        counts = np.stack(
            [np.ones(len(rows), np.int64) if not isinstance(s, Region) or s.fused else used[s.column][rows] * _pieces(s)
             for s in plan], axis=1,
        )  # fmt: skip  # [G, S] chunks per row and slot
        base = np.cumsum(counts, axis=1) - counts  # [G, S] each slot's first chunk's place in its row
        chunks = []
        for k, slot in enumerate(plan):
            if isinstance(slot, Region):
                chunks += self._region_chunks(batch, rows, used, slot, base[:, k])
            else:
                src, start, length = self._evaluate(slot, Occurrences.top(batch, rows, used))
                chunks.append((rows, base[:, k], src, start, length, -1, -1, False))
        return _stack(chunks)

    def _region_chunks(self, batch: Batch, rows: np.ndarray, used: dict, region: Region, base: np.ndarray) -> list:
        """A history's items in rows [G]: for each written item q, its junction (none before the first) and body
        pieces."""
        occ = Occurrences.items(batch, rows, used, region.column)  # [O]
        n = used[region.column][rows]  # [G]
        local = np.repeat(np.arange(len(rows)), n)  # [O] each occurrence's row in the group
        per, h = _pieces(region), list(self.regions).index(region.column)
        if region.fused:  # every item the same atoms around its codes: one chunk per row, its items back to back
            src, _, w = self._evaluate(region.body[0], occ)
            first = np.cumsum(n) - n  # [G] each row's first occurrence
            return [(rows, base, src, first * w[:1].sum(), n * w[:1].sum(), h, -1, False)]
        out = []
        for p, piece in enumerate([*region.junction, *region.body]):
            src, start, length = self._evaluate(piece, occ)
            joint = p < len(region.junction)
            if joint:
                length = np.where(occ.q == 0, 0, length)
            out.append((occ.row, base[local] + occ.q * per + p, src, start, length, h, occ.q, joint))
        return out

    def _evaluate(self, piece, occ: Occurrences):
        """A piece at its occurrences [O] -> (source array, starts [O], lengths [O])."""
        n = len(occ.row)
        if isinstance(piece, Block):
            if (piece.ids >= 0).all():
                return piece.ids, np.zeros(n, np.int64), np.full(n, len(piece.ids), np.int64)
            matrix = np.repeat(piece.ids[None, :], n, axis=0)  # [O, W]
            slots = np.flatnonzero(piece.ids < 0)
            matrix[:, slots] = occ.codes()[:, -1 - piece.ids[slots]]
            w = matrix.shape[1]
            return matrix.ravel(), np.arange(n, dtype=np.int64) * w, np.full(n, w, np.int64)
        if piece.kind == "item":
            return self._cached(piece, occ)
        if piece.kind == "index":
            return self._indexed(piece, occ)
        return _ragged(self.text.encode_spans(self._strings(piece, lambda p: self._part(p, occ), n)))

    def _part(self, p: tuple, occ: Occurrences) -> str | list[str]:
        """One part of a span at its occurrences: a text, or the texts [O] it takes there."""
        if p[0] == "t":
            return p[1]
        if p[0] == "u":
            values = occ.batch.user(p[1])
            return [values[r] for r in occ.row]
        if p[0] == "n":
            return [str(i) for i in occ.index((p[1], p[2])).tolist()]
        return self.item_texts.values(p[3], self.item_texts.rows(occ.item_ids((p[1], p[2]))))

    def _strings(self, span: Span, part, n: int) -> list[list[tuple[str, bool]]]:
        """A span's parts at n occurrences, as [(text, trusted)] each; `part(p)` gives a part's text or texts [n]."""
        trusted = set(self.template.trusted)
        columns = [(part(p), p[0] in "ui" and p[-1] in trusted) for p in span.parts]
        return [[(v if isinstance(v, str) else v[i], t) for v, t in columns] for i in range(n)]

    def _cached(self, span: Span, occ: Occurrences):
        """A span that reads one item's fields: tokenized once per catalog item, kept."""
        (ref,) = span.refs
        rows = self.item_texts.rows(occ.item_ids(ref))  # [O] catalog rows
        n_items = len(self.item_texts.item_ids)
        start, length, pool = self.cache.get(span) or (np.full(n_items, -1), np.zeros(n_items, np.int64), [])
        new = np.unique(rows[start[rows] < 0])
        if len(new):
            values = lambda p: self.item_texts.values(p[3], new) if p[0] == "i" else p[1]  # noqa: E731
            src, at, n = _ragged(self.text.encode_spans(self._strings(span, values, len(new))))
            start[new], length[new] = sum(len(x) for x in pool) + at, n
            pool = [np.concatenate([*pool, src])]
        self.cache[span] = (start, length, pool)
        return (pool[0] if pool else np.zeros(0, np.int64)), start[rows], length[rows]

    def _indexed(self, span: Span, occ: Occurrences):
        """A span that reads items' indexes only: tokenized once per index value."""
        refs = sorted(span.refs)
        keys = np.stack([occ.index(ref) for ref in refs], axis=1)  # [O, R]
        known = self.cache.setdefault(span, {})
        for key in {tuple(k) for k in np.unique(keys, axis=0).tolist()} - set(known):
            values = dict(zip(refs, key))
            text = "".join(p[1] if p[0] == "t" else str(values[(p[1], p[2])]) for p in span.parts)
            known[key] = self.text.encode([text])[0]
        order = sorted(known)
        src, at, n = _ragged([known[k] for k in order])
        where = {k: i for i, k in enumerate(order)}
        pick = np.array([where[tuple(k)] for k in keys.tolist()], np.int64)
        return src, at[pick], n[pick]

    # ---------------------------------------------------------------- checks

    def _check(self, tokenizer, chat: str | None, probes: np.ndarray) -> int:
        """Probe users (1, 2 and 3 items from `probes`, shifted by one for other codes; every combination of written
        histories; "probe" in every text field) rendered here and written out for the tokenizer: refused unless the
        ids are equal -> the longest prompt: max_prompt_tokens where the template writes text from data, else the
        longest probe with every window full."""
        names = np.asarray(tokenizer.convert_ids_to_tokens(probes.ravel().tolist()), dtype=object).reshape(probes.shape)
        item_ids = np.arange(len(probes), dtype=np.int64)
        items = ItemTokens.from_arrays(item_ids, probes)
        table = {"item_id": item_ids, **{c: ["probe"] * len(probes) for c in self.template.item_columns}}
        probe = Renderer(**{**self.__dict__, "plans": {}, "cache": {}, "max_prompt_tokens": None})
        probe.item_texts = ItemTexts.from_table(pa.table(table), self.template.item_columns)
        longest = 0
        for pattern in self._patterns():
            for n, shift in ((1, 0), (2, 0), (3, 0), (3, 1)):
                histories = {
                    c: [int(i) for i in (np.arange(min(n, w)) + shift + k) % len(probes)] if on else []
                    for k, ((c, w), on) in enumerate(zip(self.windows.items(), pattern))
                }
                got = probe.render(self._probe_rows(histories), items).input_ids[0].tolist()
                want = self._written(tokenizer, chat, histories, names)
                if got != want:
                    raise ValueError(
                        f"prompt template {self.template.name!r}: the tokenizer does not keep the code tokens (or the "
                        f"template's added tokens) apart from the text around them ({n}-item probe: rendered "
                        f"{got[:40]}..., the tokenizer {want[:40]}...); the code tokens must be tokens of their own "
                        "(tokenizer.add_tokens, the LC-Rec recipe)"
                    )
            most = max(self.windows.values(), default=1)
            full = ItemTokens.from_arrays(np.arange(most), probes[[0]].repeat(most, 0))
            rows = self._probe_rows(
                {c: list(range(w)) if on else [] for (c, w), on in zip(self.windows.items(), pattern)}
            )
            longest = max(longest, int(probe.render(rows, full).attention_mask.sum()))
        if self.max_prompt_tokens is None:
            return longest
        reads = self.template.user_columns or self.template.item_columns
        return self.max_prompt_tokens if reads else min(longest, self.max_prompt_tokens)

    def _probe_rows(self, histories: dict) -> pa.Table:
        """One probe user: these histories, "probe" in every user field."""
        columns = {c: pa.array([h], pa.list_(pa.int64())) for c, h in histories.items()}
        return pa.table(columns | {c: pa.array(["probe"]) for c in self.user_columns if c not in columns})

    def _written(self, tokenizer, chat, histories: dict, names: np.ndarray) -> list[int]:
        """A probe user's prompt written out as text (operators/text.py) and tokenized by the tokenizer."""
        probe = {k: "probe" for k in self.template.item_columns}
        written = {
            c: [self.template.item_text(q + 1, "".join(names[i]), probe) for q, i in enumerate(items)]
            for c, items in histories.items()
        }
        users = {c: "probe" for c in self.user_columns}
        return library_ids(prompt_pieces(self.template, tokenizer, chat, written, users), tokenizer)


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

    def __init__(self, renderer: Renderer, rows: pa.Table, items: ItemTokens):
        self.renderer, self.rows, self.items = renderer, rows, items
        self.histories, self.used = {}, {}  # history -> (values [T], starts [B], lengths [B]); [B] written
        for c, w in renderer.windows.items():
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


# ---------------------------------------------------------------- compiling


def _top(template: PromptTemplate, tokenizer, text: TextTokenizer, chat: str | None) -> list:
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


def _item_symbols(template: PromptTemplate, text: TextTokenizer, pattern: str) -> list:
    """Item-pattern text -> symbols: atom ids, CODES, ("t", text), ("n",) for {index}, ("i", column)."""
    out = []
    for p in parse(pattern, "item") if pattern else []:
        if isinstance(p, str):
            out += [a if isinstance(a, int) else ("t", a) for a in text.atoms(p)]
        else:
            out.append(CODES if p.kind == "codes" else ("n",) if p.kind == "index" else ("i", p.column))
    return out


def _hard(symbol) -> bool:
    return isinstance(symbol, (int, np.integer)) or symbol == CODES


def _ref(part: tuple, column: str, which: str) -> tuple:
    """An item pattern's text part with the item it reads named: (history, which)."""
    if part[0] == "i":
        return ("i", column, which, part[1])
    if part[0] == "n":
        return ("n", column, which)
    return part


def _merge(slots: list) -> list:
    """Consecutive atom Blocks joined (a Block of code tokens is joined too: its -1 - j marks stay)."""
    out = []
    for s in slots:
        if isinstance(s, Block) and out and isinstance(out[-1], Block):
            out[-1] = Block(np.concatenate([out[-1].ids, s.ids]))
        elif not (isinstance(s, Block) and not len(s.ids)):
            out.append(s)
    return out


def _pieces(region: Region) -> int:
    return len(region.junction) + len(region.body)


def _ragged(rows: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lists of ids [O] -> (their ids back to back, starts [O], lengths [O])."""
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(lengths.sum()))
    return flat, np.cumsum(lengths) - lengths, lengths


def _stack(chunks: list) -> Layout:
    """[(rows [O], pos [O], source, starts [O], lengths [O], region, q, joint)] -> one Layout."""
    size = [len(c[0]) for c in chunks]
    cat = lambda i, kind: np.concatenate([np.broadcast_to(c[i], n) for c, n in zip(chunks, size)]).astype(kind)  # noqa: E731
    src = np.repeat(np.arange(len(chunks)), size)
    arrays = [cat(0, np.int64), cat(1, np.int64), src, cat(3, np.int64), cat(4, np.int64)]
    arrays += [cat(5, np.int64), cat(6, np.int64), cat(7, bool)]
    return Layout(*arrays, [c[2] for c in chunks])


def _list_array(histories) -> pa.Array:
    """Histories given as arrow lists, numpy arrays or lists -> a list<int64> array."""
    if isinstance(histories, (pa.Array, pa.ChunkedArray)):
        return histories
    values, starts, lengths, nulls = ragged_arrays(histories)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = values[ragged_ranges(starts, lengths)]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int64()), mask=pa.array(nulls))


def catalog_probes(items: ItemTokens, count: int = 3) -> np.ndarray:
    """Code token ids [P, L] of a few items spread over the catalog (first, middle, last), to compile a Renderer."""
    rows = np.unique(np.linspace(0, len(items.item_ids) - 1, count).astype(np.int64))
    return items.token_ids[rows]


def _pad_id(template: PromptTemplate, tokenizer) -> int:
    """The token that left-pads prompts (pad, else eos); refused when the tokenizer lacks it, or lacks the BOS token
    the template starts prompts with."""
    if template.bos is True and tokenizer.bos_token_id is None:
        raise ValueError(
            f"prompt template {template.name!r} starts prompts with BOS (bos: true), but the tokenizer "
            'has no BOS token: set bos to false (or "auto": where the tokenizer has one) in the template'
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to left-pad prompts with")
    return pad_id


def answer_ids(template: PromptTemplate, tokenizer, probes: np.ndarray) -> np.ndarray:
    """The forced tokens after an item's codes [T]: the tokenizer's ids of `answer_suffix` written after the codes (as
    MiniOneRec's evaluate.py tokenizes "### Response:\n" + codes + "\n"), then EOS with answer_eos; refused unless
    every probe item (probes [P, L]) gets the same ones."""
    if not template.scores_answer:
        return np.zeros(0, np.int64)
    if template.answer_eos and tokenizer.eos_token_id is None:
        raise ValueError(f"prompt template {template.name!r}: answer_eos, but the tokenizer has no EOS token")
    found = set()
    for row in probes:
        names = tokenizer.convert_ids_to_tokens(row.tolist())
        ids = tokenizer("".join(names) + template.answer_suffix, add_special_tokens=False)["input_ids"]
        if ids[: len(row)] != row.tolist():
            raise ValueError(
                f"prompt template {template.name!r}: the answer suffix {template.answer_suffix!r} merges with the "
                "code tokens before it"
            )
        found.add(tuple(ids[len(row) :]))
    if len(found) != 1:
        raise ValueError(
            f"prompt template {template.name!r}: the answer suffix {template.answer_suffix!r} tokenizes differently "
            f"after different items: {sorted(found)}"
        )
    eos = [tokenizer.eos_token_id] if template.answer_eos else []
    return np.asarray([*found.pop(), *eos], dtype=np.int64)
