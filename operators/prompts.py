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

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from decoding.catalog import ItemTokens
from decoding.codes import ragged_ranges
from decoding.templates import PromptTemplate, as_text, is_text
from operators.prompt_parts import (
    Batch,
    ItemTexts,
    Layout,
    history_window,
    list_array,
    ragged_arrays,
    top_symbols,
)
from operators.prompt_program import Program
from operators.spec import TOO_LONG
from operators.text import TextTokenizer, chat_template_text, library_ids, prompt_pieces

PROBES = ("probe", "", " \n probe\t\n ")  # the text of the probe users' fields (`Renderer._check`)
__all__ = ["Prompts", "Renderer", "answer_ids", "as_text", "catalog_probes", "history_window", "is_text"]
__all__ += ["ragged_arrays"]  # homes: operators/prompt_parts.py (as_text, is_text: decoding/templates.py)


class Prompts(NamedTuple):
    input_ids: torch.Tensor  # [B', S] int64, left-padded with pad_id
    attention_mask: torch.Tensor  # [B', S] int64, 0 on padding
    kept: np.ndarray | None = None  # [B] bool: the input rows rendered (None: all); the others were too long
    truncated: np.ndarray | None = None  # [B'] bool: rendered after dropping their oldest history items

    def fit_counts(self) -> dict:
        """The metrics' users_prompted, users_truncated and users_too_long."""
        kept = self.kept if self.kept is not None else np.ones(len(self.input_ids), bool)
        truncated = int(self.truncated.sum()) if self.truncated is not None else 0
        return {
            "users_prompted": len(self.input_ids),
            "users_truncated": truncated,
            "users_too_long": int((~kept).sum()),
        }


@dataclass
class Renderer:
    """A prompt template compiled against a tokenizer (`compile`), rendering batches of rows (`render`)."""

    template: PromptTemplate
    levels: int  # L code tokens per item
    pad_id: int
    answer: np.ndarray  # [T] int64: the forced tokens after an item's codes, scored (answer_ids; empty: none)
    program: Program  # the template's pieces, plans and what its spans tokenized (operators/prompt_program.py)
    max_prompt_tokens: int | None = None  # None: no bound
    too_long: str = "drop_oldest"
    chat: str | None = None  # the chat template the messages are written with (None: a plain template)
    max_len: int = 0  # tokens of the longest prompt (max_prompt_tokens where the template writes text from data)
    full_len: int = 0  # tokens of a prompt with every window full and a short text in each field (the compiled
    # engine's warm bucket: a template's text from data has no length until it is read)

    @property
    def max_items(self) -> int:
        return self.template.max_items

    @property
    def windows(self) -> dict[str, int]:
        """{history column: its window}: `history` first (validated and hashed whether the template writes it or
        not), then the other histories the template writes."""
        return {"history": self.template.max_items, **self.program.windows}

    @property
    def user_columns(self) -> list[str]:
        return self.template.user_columns

    @property
    def prefix_ids(self) -> np.ndarray:
        """The token ids every prompt starts with (BOS and the template's fixed text up to the first item's codes or
        the first text from data: the part to prefill once, decoding.beam.Prefix)."""
        return self.program.prefix_ids

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
        _check_plain_text(template, tokenizer, text, probes)
        chat = chat_template_text(template, tokenizer, model_dir)
        top = top_symbols(template, tokenizer, text, chat)
        texts = ItemTexts.from_table(catalog, template.item_columns)
        program = Program(template, probes.shape[1], text, top, texts, bos=template.uses_bos(tokenizer))
        program.compile_regions()
        answer = answer_ids(template, tokenizer, probes)
        r = cls(
            template, probes.shape[1], _pad_id(template, tokenizer), answer, program, max_prompt_tokens, too_long, chat
        )
        full = r._check(tokenizer, chat, probes)
        reads = template.user_columns or template.item_columns  # text from data: no length until it is read
        bound = max_prompt_tokens if max_prompt_tokens is not None else full
        r.max_len, r.full_len = bound if reads else min(full, bound), min(full, bound)
        return r

    def render(self, rows, items: ItemTokens, skip: int = 0) -> Prompts:
        """Rows (a table with `history`, the template's other history columns and its user columns; or just the
        histories, item ids oldest first) validated first (operators/validate.py: `history` non-empty, every item a
        prompt uses in the catalog) -> left-padded prompts of their windows, without their first `skip` tokens (a
        shared prefix prefilled elsewhere: see prefix_ids); rows too long left out (`Prompts.kept`)."""
        if items.levels != self.levels:
            raise ValueError(f"the catalog has {items.levels} code tokens per item, the renderer {self.levels}")
        rows = rows if isinstance(rows, pa.Table) else pa.table({"history": list_array(rows)})
        batch = Batch(self.program.windows, rows, items)
        used = {c: u.copy() for c, u in batch.used.items()}  # [B] items written, per history
        layout = self.program.layout(batch, np.arange(rows.num_rows), used)
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
            redone = self.program.layout(batch, over, used)
            layout = layout.without(over).plus(redone)
            tokens[over] = redone.tokens(b)[over]
            over = over[tokens[over] > limit]
        layout = self._give_back(batch, layout, tokens, used, np.flatnonzero(truncated & kept))
        return layout, tokens, kept, truncated

    def _give_back(self, batch: Batch, layout: Layout, tokens: np.ndarray, used: dict, rows: np.ndarray) -> Layout:
        """Rows [R] that dropped items and fit -> the last dropped items given back, one at a time, while the row
        still fits (`_drop` can overshoot: an item's text before its codes joins the text before the history, which
        it does not count) -> the layout; `tokens` and `used` updated in place."""
        limit, b = self.max_prompt_tokens, len(tokens)
        while len(rows):
            back, left = {c: u.copy() for c, u in used.items()}, np.ones(len(rows), bool)
            for c in reversed(self.program.regions):  # the last history `_drop` took from, first
                can = left & (back[c][rows] < batch.used[c][rows])
                back[c][rows[can]] += 1
                left &= ~can
            rows = rows[~left]
            redone = self.program.layout(batch, rows, back)
            fits = redone.tokens(b)[rows] <= limit
            if not fits.any():
                break
            redone, rows = redone.without(rows[~fits]), rows[fits]
            for c in used:
                used[c][rows] = back[c][rows]
            layout = layout.without(rows).plus(redone)
            tokens[rows] = redone.tokens(b)[rows]
        return layout

    def _drop(self, layout: Layout, rows: np.ndarray, excess: np.ndarray, used: dict) -> np.ndarray:
        """The rows' [R] oldest items dropped, history by history in prompt order (`history` keeps one), the fewest
        whose tokens (with the text joining the next) cover `excess` [R] -> [R] bool: a row dropped something. The
        text around the first and last items is not counted: the caller renders again and drops more if needed."""
        left, dropped = excess.astype(np.int64), np.zeros(len(rows), bool)
        for h, c in enumerate(self.program.regions):
            n = used[c][rows]  # [R]
            can = np.where(left > 0, n - int(c == "history"), 0)  # [R] items that may go
            most = int(n.max()) if len(n) else 0
            if most == 0 or not can.any():
                continue
            region = self.program.regions[c]
            if region.fused:
                whole, joint = np.full((len(rows), most), region.item_width()), np.zeros((len(rows), most))
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

    def _check(self, tokenizer, chat: str | None, probes: np.ndarray) -> int:
        """Probe users (1, 2 and 3 items from `probes`, shifted by one for other codes; every combination of written
        histories; in every text field "probe", nothing, or "probe" between whitespace: an added token that strips
        the whitespace beside it, lstrip or rstrip, would take it from the data) rendered here and written out for
        the tokenizer: refused unless the ids are equal -> the tokens of the longest "probe" probe, every window
        full."""
        names = np.asarray(tokenizer.convert_ids_to_tokens(probes.ravel().tolist()), dtype=object).reshape(probes.shape)
        item_ids = np.arange(len(probes), dtype=np.int64)
        items = ItemTokens.from_arrays(item_ids, probes)
        longest, reads = 0, bool(self.template.user_columns or self.template.item_columns)
        for value in PROBES:
            table = {"item_id": item_ids, **{c: [value] * len(probes) for c in self.template.item_columns}}
            texts = ItemTexts.from_table(pa.table(table), self.template.item_columns)
            program = replace(self.program, item_texts=texts, plans={}, cache={})
            probe = replace(self, program=program, max_prompt_tokens=None)
            for pattern in self.program.patterns():
                for n, shift in ((1, 0), (2, 0), (3, 0), (3, 1))[: 4 if value == PROBES[0] else 2]:
                    histories = {
                        c: [int(i) for i in (np.arange(min(n, w)) + shift + k) % len(probes)] if on else []
                        for k, ((c, w), on) in enumerate(zip(self.windows.items(), pattern))
                    }
                    got = probe.render(self._probe_rows(histories, value), items).input_ids[0].tolist()
                    want = self._written(tokenizer, chat, histories, names, value)
                    if got != want:
                        raise ValueError(
                            _apart(self.template, f"{n}-item probe" + f", text {value!r}" * reads, got, want)
                        )
                if value == PROBES[0]:
                    most = max(self.windows.values(), default=1)
                    full = ItemTokens.from_arrays(np.arange(most), probes[[0]].repeat(most, 0))
                    rows = self._probe_rows(
                        {c: list(range(w)) if on else [] for (c, w), on in zip(self.windows.items(), pattern)}, value
                    )
                    longest = max(longest, int(probe.render(rows, full).attention_mask.sum()))
            if not reads:
                break  # no text from data: one value says it all
        return longest

    def _probe_rows(self, histories: dict, value: str) -> pa.Table:
        """One probe user: these histories, `value` in every user field."""
        columns = {c: pa.array([h], pa.list_(pa.int64())) for c, h in histories.items()}
        return pa.table(columns | {c: pa.array([value]) for c in self.user_columns if c not in columns})

    def _written(self, tokenizer, chat, histories: dict, names: np.ndarray, value: str) -> list[int]:
        """A probe user's prompt written out as text (operators/text.py) and tokenized by the tokenizer."""
        probe = {k: value for k in self.template.item_columns}
        written = {
            c: [self.template.item_text(q + 1, "".join(names[i]), probe) for q, i in enumerate(items)]
            for c, items in histories.items()
        }
        users = {c: value for c in self.user_columns}
        return library_ids(prompt_pieces(self.template, tokenizer, chat, written, users), tokenizer)


def _apart(template: PromptTemplate, probe: str, got: list[int], want: list[int]) -> str:
    """The refusal of a template whose probe's ids differ from the tokenizer's."""
    return (
        f"prompt template {template.name!r}: the tokenizer does not keep the code tokens (or the template's added "
        f"tokens) apart from the text around them ({probe}: rendered {got[:40]}..., the tokenizer {want[:40]}...); "
        "the code tokens must be tokens of their own (tokenizer.add_tokens, the LC-Rec recipe), and added tokens "
        "beside text from data must not strip its whitespace (lstrip, rstrip)"
    )


def catalog_probes(items: ItemTokens, count: int = 3) -> np.ndarray:
    """Code token ids [P, L] of a few items spread over the catalog (first, middle, last), to compile a Renderer."""
    rows = np.unique(np.linspace(0, len(items.item_ids) - 1, count).astype(np.int64))
    return items.token_ids[rows]


def _check_plain_text(template: PromptTemplate, tokenizer, text: TextTokenizer, probes: np.ndarray) -> None:
    """Refused when the template writes text from data that it does not trust and the tokenizer reads code tokens
    (those of `probes` [P, L]) or its added tokens (but unk) out of plain text: its vocabulary holds them as words, so
    a title or a profile holding `<a_12>` would write that token, not text."""
    untrusted = [c for c in (*template.user_columns, *template.item_columns) if c not in template.trusted]
    if not untrusted:
        return
    ids = {int(i) for i in np.unique(probes)}
    tokens = {i: t for i, t in zip(sorted(ids), tokenizer.convert_ids_to_tokens(sorted(ids)))}
    tokens |= {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.content.strip()}
    tokens.pop(tokenizer.unk_token_id, None)  # what unknown text becomes anyway: no control
    forged = text.reads_as_tokens(tokens)
    if forged:
        raise ValueError(
            f"prompt template {template.name!r} writes text from data ({', '.join(untrusted)}), but the tokenizer "
            f"reads {', '.join(forged[:3])} out of plain text (its vocabulary holds them as words): that text could "
            "write code or control tokens. Use a tokenizer with the code tokens added (tokenizer.add_tokens), or list "
            "the columns in `trusted`"
        )


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
