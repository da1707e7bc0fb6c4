"""A prompt template's program (operators/prompts.py compiles it): which pieces a prompt is written from, for each
combination of written histories (`plan`), and a batch's chunks of ids (`layout`), every span of text tokenized by
what it reads (`Span.kind`): at compile time, once per index value, once per catalog item (kept), or per user in one
batch call."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from decoding.templates import Field, PromptTemplate
from operators.prompt_parts import (
    CODES,
    Batch,
    Block,
    ItemTexts,
    Layout,
    Occurrences,
    Region,
    Span,
    is_hard,
    item_symbols,
    merge_blocks,
    named_item,
    pieces_per_item,
    ragged_ids,
    stack_chunks,
)
from operators.text import BREAK, TextTokenizer


@dataclass
class Program:
    """The template's symbols and histories, compiled against a tokenizer; its plans and what its spans tokenized."""

    template: PromptTemplate
    levels: int  # L code tokens per item
    text: TextTokenizer
    top: list  # the prompt's symbols: atom ids, BREAK, ("t", text), Field (user, history)
    item_texts: ItemTexts
    regions: dict = field(default_factory=dict)  # history column -> Region, in prompt order
    plans: dict = field(default_factory=dict)  # which histories are written -> the prompt's slots
    cache: dict = field(default_factory=dict)  # Span -> what it has tokenized (`_cached`, `_indexed`)
    bos: bool = False  # top[0] is BOS, which the tokenizer adds before the text (not an added token in it)

    @property
    def windows(self) -> dict[str, int]:
        """{history column: its window}, `history` first."""
        return {c: r.window for c, r in self.regions.items()}

    @property
    def prefix_ids(self) -> np.ndarray:
        """The token ids every prompt starts with (BOS and the template's fixed text up to the first item's codes or
        the first text from data: the part to prefill once, decoding.beam.Prefix)."""
        heads = [self._leading(self.plan(p)) for p in self.patterns()]
        p = min(len(h) for h in heads)
        same = np.all([h[:p] == heads[0][:p] for h in heads], axis=0) if p else np.ones(0, bool)
        return heads[0][: int(np.argmin(same)) if not same.all() else p].copy()

    def compile_regions(self) -> None:
        self.regions = {c: self._region(c, w) for c, w in self.template.histories.items()}

    def _region(self, column: str, window: int) -> Region:
        """A history placeholder: the item pattern's symbols cut at its first and last atom (codes included)."""
        item = item_symbols(self.template, self.text, self.template.item)
        hard = [k for k, x in enumerate(item) if is_hard(x)]
        head, body, tail = item[: hard[0]], item[hard[0] : hard[-1] + 1], item[hard[-1] + 1 :]
        sep = item_symbols(self.template, self.text, self.template.separator)
        junction = [named_item(p, column, "prev") for p in tail] + sep + [named_item(p, column, "self") for p in head]
        body = [x if is_hard(x) else named_item(x, column, "self") for x in body]
        return Region(column, window, head, self._pieces_of(body), self._pieces_of(junction), tail)

    def _pieces_of(self, symbols: list) -> list:
        """Symbols -> Blocks (atoms and code tokens back to back) and Spans (text between them)."""
        out, span = [], []
        for x in symbols:
            if is_hard(x):
                if span:
                    out.append(self._span(tuple(span)))
                    span = []
                ids = np.arange(-1, -1 - self.levels, -1) if x == CODES else np.array([x])
                out.append(Block(ids.astype(np.int64)))
            else:
                span.append(x)
        return merge_blocks(out + ([self._span(tuple(span))] if span else []))

    def patterns(self) -> list[tuple]:
        """Every combination of written histories (the `history` column always holds an item)."""
        options = [(True,) if c == "history" else (False, True) for c in self.regions]
        return list(itertools.product(*options))

    def plan(self, pattern: tuple) -> list:
        """The prompt's slots when the histories `pattern` says are written (the others write nothing): Block (atoms),
        Span (text) and Region pieces, in order."""
        if pattern in self.plans:
            return self.plans[pattern]
        out, span, leading = [], [], [True]  # leading: no atom yet in the text the tokenizer is given

        def flush():
            if span:
                out.append(self._span(tuple(span), leading[0]))
                span.clear()
            leading[0] = False

        written = dict(zip(self.regions, pattern))
        for k, el in enumerate(self.top):
            if isinstance(el, (int, np.integer)):
                if not (k == 0 and self.bos):
                    flush()
                out.append(Block(np.array([el], np.int64)))
            elif el == BREAK:  # the instruction ends: the rest is tokenized on its own
                flush()
                leading[0] = True
            elif not isinstance(el, Field):
                span.append(el)
            elif el.kind == "user":
                span.append(("u", el.column))
            elif written[el.column]:
                r = self.regions[el.column]
                span += [named_item(p, el.column, "first") for p in r.head]
                flush()
                out.append(r)
                span += [named_item(p, el.column, "last") for p in r.tail]
        flush()
        self.plans[pattern] = out = merge_blocks(out)
        return out

    def _span(self, parts: tuple, leading: bool = False) -> Span | Block:
        """A span of text (`leading`: it starts the text the tokenizer is given) -> tokenized now when it reads nothing
        from data (a Block of its ids), else a Span."""
        merged = []
        for p in parts:
            if p[0] == "n" and p[2] == "first":
                p = ("t", "1")  # the first item's index
            if merged and p[0] == merged[-1][0] == "t":
                merged[-1] = ("t", merged[-1][1] + p[1])
            else:
                merged.append(p)
        s = Span(tuple(merged), leading)
        if s.kind == "const":
            return Block(np.asarray(self.text.encode([s.parts[0][1]], leading)[0] if s.parts else [], np.int64))
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

    def layout(self, batch: Batch, rows: np.ndarray, used: dict) -> Layout:
        """The chunks of `rows` (their histories' last `used` items)."""
        written = np.stack([used[c][rows] > 0 for c in self.regions], axis=1) if self.regions else None
        parts = []
        for pattern in self.patterns():
            group = rows[(written == np.array(pattern)).all(1)] if written is not None else rows
            if len(group):
                parts.append(self._group_layout(batch, group, used, self.plan(pattern)))
        out = parts[0] if parts else Layout(*(np.zeros(0, np.int64),) * 7, np.zeros(0, bool))
        for p in parts[1:]:
            out = out.plus(p)
        return out

    def _group_layout(self, batch: Batch, rows: np.ndarray, used: dict, plan: list) -> Layout:
        """The chunks of rows [G] sharing one plan: per slot, one chunk per row, or per written item and piece."""
        one = np.ones(len(rows), np.int64)
        counts = np.stack(
            [one if not isinstance(s, Region) or s.fused else used[s.column][rows] * pieces_per_item(s) for s in plan],
            axis=1,
        )  # [G, S] chunks per row and slot
        base = np.cumsum(counts, axis=1) - counts  # [G, S] each slot's first chunk's place in its row
        chunks = []
        for k, slot in enumerate(plan):
            if isinstance(slot, Region):
                chunks += self._region_chunks(batch, rows, used, slot, base[:, k])
            else:
                src, start, length = self._evaluate(slot, Occurrences.top(batch, rows, used))
                chunks.append((rows, base[:, k], src, start, length, -1, -1, False))
        return stack_chunks(chunks)

    def _region_chunks(self, batch: Batch, rows: np.ndarray, used: dict, region: Region, base: np.ndarray) -> list:
        """A history's items in rows [G]: for each written item q, its junction (none before the first) and body
        pieces."""
        occ = Occurrences.items(batch, rows, used, region.column)  # [O]
        n = used[region.column][rows]  # [G]
        local = np.repeat(np.arange(len(rows)), n)  # [O] each occurrence's row in the group
        per, h = pieces_per_item(region), list(self.regions).index(region.column)
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
        return ragged_ids(self.text.encode_spans(self._strings(piece, lambda p: self._part(p, occ), n), piece.leading))

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
        """A span that reads one item's fields: tokenized once per catalog item, kept (ItemCache)."""
        (ref,) = span.refs
        rows = self.item_texts.rows(occ.item_ids(ref))  # [O] catalog rows
        cache = self.cache.setdefault(span, ItemCache.empty(len(self.item_texts.item_ids)))
        new = np.unique(rows[cache.start[rows] < 0])
        if len(new):
            values = lambda p: self.item_texts.values(p[3], new) if p[0] == "i" else p[1]  # noqa: E731
            cache.add(new, *ragged_ids(self.text.encode_spans(self._strings(span, values, len(new)), span.leading)))
        return cache.ids, cache.start[rows], cache.length[rows]

    def _indexed(self, span: Span, occ: Occurrences):
        """A span that reads items' indexes only: tokenized once per index value."""
        refs = sorted(span.refs)
        keys = np.stack([occ.index(ref) for ref in refs], axis=1)  # [O, R]
        known = self.cache.setdefault(span, {})
        for key in {tuple(k) for k in np.unique(keys, axis=0).tolist()} - set(known):
            values = dict(zip(refs, key))
            text = "".join(p[1] if p[0] == "t" else str(values[(p[1], p[2])]) for p in span.parts)
            known[key] = self.text.encode([text], span.leading)[0]
        order = sorted(known)
        src, at, n = ragged_ids([known[k] for k in order])
        where = {k: i for i, k in enumerate(order)}
        pick = np.array([where[tuple(k)] for k in keys.tolist()], np.int64)
        return src, at[pick], n[pick]


@dataclass
class ItemCache:
    """A span's ids for each catalog item it has met: back to back in a buffer that doubles when full (a night's
    batches add the items they meet first; nothing is copied per batch)."""

    start: np.ndarray  # [N] where each item's ids begin (-1: not met yet)
    length: np.ndarray  # [N]
    buffer: np.ndarray  # [capacity] int64
    used: int = 0

    @classmethod
    def empty(cls, items: int) -> ItemCache:
        return cls(np.full(items, -1, np.int64), np.zeros(items, np.int64), np.zeros(1024, np.int64))

    @property
    def ids(self) -> np.ndarray:
        return self.buffer[: self.used]

    def add(self, rows: np.ndarray, ids: np.ndarray, at: np.ndarray, lengths: np.ndarray) -> None:
        """Items `rows` [R] with their ids back to back (starting at `at` [R], `lengths` [R])."""
        if self.used + len(ids) > len(self.buffer):
            grown = np.zeros(max(2 * len(self.buffer), self.used + len(ids)), np.int64)
            grown[: self.used] = self.buffer[: self.used]
            self.buffer = grown
        self.buffer[self.used : self.used + len(ids)] = ids
        self.start[rows], self.length[rows] = self.used + at, lengths
        self.used += len(ids)
