"""Prompts for generative recommenders: user histories -> left-padded token ids, written the way the model's prompt
template says (decoding/templates.py), with no tokenizer call per user.

A `Renderer` is a template compiled against a tokenizer once: for every history length n = 1 .. max_items, the token
ids of the n-item prompt with the code tokens left out (its skeleton) and where each item's L code tokens go. The
skeletons come from tokenizing real prompts, so a batch rendered by filling code token ids into skeletons (numpy,
no Python loop over users) has exactly the ids of `[bos] + tokenizer(text, add_special_tokens=False)`. Compiling
checks that the code tokens stay tokens of their own whatever the codes: a tokenizer that would merge text across a
code token's boundary is refused, never rendered differently.

For the `codes` template on Amazon Beauty (L = 4, 20 items) a prompt has at most 1 + 20 * 4 = 81 tokens; for `lcrec`
about 44 + 20 * 7 tokens with a BPE tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from decoding.catalog import ItemTokens
from decoding.codes import format_rows, ragged_ranges
from decoding.templates import PromptTemplate

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


# ---------------------------------------------------------------- prompts


class Prompts(NamedTuple):
    input_ids: torch.Tensor  # [B, S] int64, left-padded with pad_id
    attention_mask: torch.Tensor  # [B, S] int64, 0 on padding


def history_window(histories, history_len: int):
    """The items a prompt uses: the last `history_len` of each history -> (item ids [U], row of each [U],
    items per row [B]). Histories: see `ragged_arrays`."""
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    values, starts, lengths, _ = ragged_arrays(histories)  # [T], [B], [B]
    used = np.minimum(lengths, history_len)  # [B]
    items = values[ragged_ranges(starts + lengths - used, used)]  # [U]
    return items, np.repeat(np.arange(len(lengths)), used), used


@dataclass
class Renderer:
    """A prompt template compiled against a tokenizer (`compile`), rendering batches of histories (`render`)."""

    template: PromptTemplate
    levels: int  # L code tokens per item
    pad_id: int
    skeleton: np.ndarray  # [M + 1, T] int64: row n = the n-item prompt's ids, -1 where codes go, then pad_id
    length: np.ndarray  # [M + 1] int64: tokens of the n-item prompt (BOS included)
    item_start: np.ndarray  # [M + 1, M] int64: column of item q's first code token in the n-item prompt
    answer: np.ndarray  # [T] int64: the forced tokens after an item's codes, scored (answer_ids; empty: none)

    @property
    def max_items(self) -> int:
        return self.template.max_items

    @property
    def max_len(self) -> int:
        """Tokens of the longest prompt (max_items items)."""
        return int(self.length[-1])

    @property
    def prefix_ids(self) -> np.ndarray:
        """The token ids every prompt starts with, whatever its length [P] (BOS and the template's fixed text up to
        the first item's codes: the part to prefill once, decoding.beam.Prefix)."""
        rows = [self.skeleton[n, : self.item_start[n, 0]] for n in range(1, self.max_items + 1)]
        p = min(len(r) for r in rows)
        same = np.all([r[:p] == rows[0][:p] for r in rows], axis=0)  # [p]
        return rows[0][: int(np.argmin(same)) if not same.all() else p].copy()

    @classmethod
    def compile(cls, template: PromptTemplate, tokenizer, probes: np.ndarray) -> Renderer:
        """Tokenizes the prompt of every length 1 .. max_items twice, with two different sequences of probe items
        (probes [P, L]: code token ids of real items, e.g. the catalog's), and keeps where the code tokens land.
        Refused with a message when the tokenizer does not keep the code tokens apart from the text, or when the
        template needs a BOS token the tokenizer does not have."""
        probes = np.asarray(probes, dtype=np.int64)
        pad_id = _pad_id(template, tokenizer)
        names = np.asarray(tokenizer.convert_ids_to_tokens(probes.ravel().tolist()), dtype=object).reshape(probes.shape)
        rows = [_skeleton(template, tokenizer, probes, names, n) for n in range(1, template.max_items + 1)]
        return cls(template, probes.shape[1], pad_id, *_stack(rows, pad_id), answer_ids(template, tokenizer, probes))

    def render(self, histories, items: ItemTokens, skip: int = 0) -> Prompts:
        """Histories [B] (item ids, oldest first; validated: non-empty, every item used in the catalog, see
        operators/validate.py) -> left-padded prompts of their last max_items items, without their first `skip`
        tokens (a shared prefix prefilled elsewhere: see prefix_ids). No Python loop over users."""
        item_ids, row_of, used = history_window(histories, self.max_items)  # [U], [U], [B]
        tokens, known = items.lookup(item_ids)  # [U, L]
        if (used == 0).any() or not known.all():
            bad = np.union1d(np.flatnonzero(used == 0), row_of[~known])
            raise ValueError(
                f"rows {format_rows(bad)} have an empty history or items missing from the catalog: "
                "validate them first (operators.validate)"
            )
        if items.levels != self.levels:
            raise ValueError(f"the catalog has {items.levels} code tokens per item, the renderer {self.levels}")
        b = len(used)
        t = self.length[used] - skip  # [B] tokens per prompt
        width = int(t.max()) if b else 0  # S
        left = width - t  # [B] left padding
        input_ids = np.full((b, width), self.pad_id, dtype=np.int64)  # [B, S]
        row = np.repeat(np.arange(b), t)  # [sum T] the skeleton tokens, row by row
        col = ragged_ranges(np.zeros(b, np.int64), t)  # [sum T] position within the prompt
        input_ids[row, left[row] + col] = self.skeleton[used[row], skip + col]
        q = np.arange(len(item_ids)) - np.repeat(np.cumsum(used) - used, used)  # [U] item index in its window
        cols = (left[row_of] + self.item_start[used[row_of], q] - skip)[:, None] + np.arange(self.levels)  # [U, L]
        input_ids[row_of[:, None], cols] = tokens
        mask = (np.arange(width)[None, :] >= left[:, None]).astype(np.int64)  # [B, S]
        return Prompts(torch.from_numpy(input_ids), torch.from_numpy(mask))


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


def _prompt_ids(template: PromptTemplate, tokenizer, names: np.ndarray) -> np.ndarray:
    """The n-item prompt of the items whose code tokens are named names [n, L] -> its token ids [T] (BOS when the
    template asks for it, then the tokenizer's ids of the text)."""
    items = (template.item.format(index=q + 1, codes="".join(codes)) for q, codes in enumerate(names))
    text = template.prefix + template.separator.join(items) + template.suffix
    bos = [tokenizer.bos_token_id] if template.uses_bos(tokenizer) else []
    instruction = tokenizer(template.instruction, add_special_tokens=False)["input_ids"] if template.instruction else []
    return np.asarray(bos + instruction + tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


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


def _skeleton(template: PromptTemplate, tokenizer, probes: np.ndarray, names: np.ndarray, n: int):
    """The n-item prompt, tokenized with two sequences of probe items (probes [P, L], their token names [P, L]) ->
    (skeleton [T], start of each item's codes [n]); refused unless both give the same (the text's tokens must not
    depend on the codes)."""
    shapes = []
    for shift in (0, 1):
        pick = (np.arange(n) + shift) % len(probes)  # [n] probe rows
        ids = _prompt_ids(template, tokenizer, names[pick])
        shapes.append(_code_slots(ids, probes[pick], np.unique(probes), template, n))
    if not (np.array_equal(shapes[0][0], shapes[1][0]) and np.array_equal(shapes[0][1], shapes[1][1])):
        raise ValueError(
            f"prompt template {template.name!r}: the {n}-item prompt tokenizes differently with "
            "other codes, so the tokenizer merges text across the code tokens' boundaries; the "
            "code tokens must be tokens of their own (tokenizer.add_tokens, the LC-Rec recipe)"
        )
    return shapes[0]


def _stack(rows: list[tuple[np.ndarray, np.ndarray]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The skeletons and item starts of the 1 .. M-item prompts -> (skeleton [M + 1, T] padded with pad_id, length
    [M + 1], item_start [M + 1, M]); row 0 is the empty prompt."""
    m = len(rows)
    width = max(len(skel) for skel, _ in rows)
    skeleton = np.full((m + 1, width), pad_id, dtype=np.int64)
    item_start = np.zeros((m + 1, m), dtype=np.int64)
    length = np.zeros(m + 1, dtype=np.int64)
    for n, (skel, starts) in enumerate(rows, start=1):
        skeleton[n, : len(skel)], length[n], item_start[n, :n] = skel, len(skel), starts
    return skeleton, length, item_start


def _code_slots(ids: np.ndarray, expected: np.ndarray, code_set: np.ndarray, template: PromptTemplate, n: int):
    """ids [T] of an n-item prompt whose items have code token ids expected [n, L] -> (skeleton [T] with -1 at the
    code tokens, start of each item's codes [n]); refused unless the codes are there, item by item, whole."""
    at = np.flatnonzero(np.isin(ids, code_set))  # [n * L] where code tokens are
    levels = expected.shape[1]
    starts = at[::levels]  # [n]
    whole = (
        len(at) == expected.size
        and np.array_equal(ids[at], expected.ravel())
        and np.array_equal(at.reshape(n, levels), starts[:, None] + np.arange(levels))
    )
    if not whole:
        raise ValueError(
            f"prompt template {template.name!r}: in the {n}-item prompt the tokenizer does not give each "
            f"code token its own id (expected {expected.size} code tokens in {n} runs of {levels}, found "
            f"{len(at)}); the code tokens must be tokens of their own (tokenizer.add_tokens, the LC-Rec "
            "recipe) and the template text must not touch them"
        )
    skeleton = ids.copy()
    skeleton[at] = -1
    return skeleton, starts
