"""The baselines genrec-batch is measured against: `transformers` constrained beam search with a CPU trie, and
exact sequence / whole-catalog log-probabilities from plain `transformers` forwards (no token tree).

Used by the exactness tests, by `python -m jobs.bench decode` and by the DISC bias benchmark.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from decoding.catalog import Catalog
from decoding.models import returned_cache, with_cache


def cpu_trie(catalog: Catalog, exclude=()) -> dict:
    """prefix tuple -> sorted list of allowed next tokens (what users hand to `prefix_allowed_tokens_fn`), over the
    catalog's semantic IDs that still list an item outside the item ids `exclude` (one user's trie: a prefix none of
    whose items is left is absent)."""
    ptr, listed = catalog.group_ptr.tolist(), catalog.listed.tolist()
    groups = {tuple(row): listed[ptr[r] : ptr[r + 1]] for r, row in enumerate(catalog.tokens.tolist())}
    return sid_trie(groups, exclude)


def sid_trie(groups: dict, exclude=()) -> dict:
    """Semantic ID (token tuple) -> its items: the trie (`cpu_trie`) over those with an item outside `exclude`."""
    trie: dict = {}
    skip = {int(i) for i in exclude}
    for row, items in groups.items():
        if all(i in skip for i in items):
            continue
        for t in range(len(row)):
            trie.setdefault(tuple(row[:t]), set()).add(row[t])
    return {p: sorted(v) for p, v in trie.items()}


def sid_groups(item_ids, token_ids, value=None, served=None) -> dict:
    """The duplicate policies `by:COLUMN` and `expand[:COLUMN]` in plain Python: item ids [N], their semantic IDs
    (token rows) [N] -> {semantic ID tuple: its items a list may hold (`served`: a set of ids, None: all), highest
    `value` first (value [N]: numbers, None or NaN lowest; None: none), ties by item id, lowest first}."""
    value = [None] * len(item_ids) if value is None else list(value)
    groups: dict = {}
    for item, row, v in zip(item_ids, token_ids, value):
        if served is None or item in served:
            groups.setdefault(tuple(row), []).append((v is None or v != v, 0 if v is None or v != v else -v, item))
    return {sid: [item for *_, item in sorted(entries)] for sid, entries in groups.items()}


def listed_items(tokens, scores, groups: dict, exclude=(), k: int = 0, expand: bool = False) -> tuple[list, list]:
    """One user's semantic IDs, best first (tokens: token tuples, scores: numbers), in plain Python -> the user's
    list (items, scores): each semantic ID's first item outside `exclude` (`by`), or every such item, one entry
    each (`expand`), each with its semantic ID's score, cut at k entries (0: no cut)."""
    items, out = [], []
    for sid, score in zip(tokens, scores):
        left = [i for i in groups[tuple(sid)] if i not in set(exclude)]
        for item in left if expand else left[:1]:
            items.append(item)
            out.append(score)
    return (items[:k], out[:k]) if k else (items, out)


def with_answer(trie: dict, answer: list[int]) -> dict:
    """A catalog trie whose items continue with the forced `answer` tokens (a template's answer suffix and EOS): the
    constraint MiniOneRec's evaluate.py builds from "### Response:\n" + codes + "\n" and EOS."""
    depth = max(map(len, trie)) + 1  # L: prefixes of 0 .. L - 1 tokens are keys
    leaves = {p + (t,) for p, ts in trie.items() if len(p) == depth - 1 for t in ts}
    out = dict(trie)
    for leaf in leaves:
        for j, t in enumerate(answer):
            out[leaf + tuple(answer[:j])] = [t]
    return out


@torch.no_grad()
def generate_beam_search(
    model,
    input_ids,
    attention_mask,
    catalog: Catalog,
    k: int,
    trie: dict | list | None = None,
    answer: list[int] | None = None,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
):
    """`model.generate(num_beams=k, num_return_sequences=k, max_new_tokens=L, length_penalty=0.0,
    prefix_allowed_tokens_fn=<CPU trie>)` -> (item ids [B, k], token ids [B, k, L], scores [B, k], kv tokens held).
    trie: one for every user, or a list of one per user (per-user exclusions: `cpu_trie(catalog, exclude)`).
    answer: forced tokens after the codes (ending with eos_token_id when the template adds EOS), generated and
    scored: max_new_tokens = L + len(answer)."""
    tries = trie if isinstance(trie, list) else [cpu_trie(catalog) if trie is None else trie] * input_ids.shape[0]
    answer = list(answer or [])
    if answer:
        tries = [with_answer(t, answer) for t in tries]
    s, code_len = input_ids.shape[1], catalog.code_len

    def allowed(batch_id, sent):
        # a dead beam (prefix not in the user's trie) still needs a non-empty list; its score is already -inf
        return tries[batch_id].get(tuple(sent[s:].tolist()), [0])

    beam_args = dict(length_penalty=0.0) if k > 1 else {}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        num_beams=k,
        num_return_sequences=k,
        max_new_tokens=code_len + len(answer),
        min_new_tokens=code_len,
        do_sample=False,
        prefix_allowed_tokens_fn=allowed,
        return_dict_in_generate=True,
        output_scores=k > 1,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=1,
        top_k=None,
        top_p=None,
        temperature=None,
        **beam_args,
    )
    b = input_ids.shape[0]
    tokens = out.sequences[:, s : s + code_len].reshape(b, k, code_len)
    items = catalog.lookup(tokens.reshape(-1, code_len)).view(b, k)
    cache = returned_cache(out)
    kv_tokens = cache.layers[0].keys.shape[0] * cache.get_seq_length()
    if k == 1:  # generate() runs greedy search, which returns no sequence scores: score the sequences
        scores = sequence_logprob(model, out.sequences, attention_mask, code_len + len(answer)).view(b, 1)
    else:
        scores = out.sequences_scores.view(b, k).float()
    return items, tokens, scores, kv_tokens


@torch.no_grad()
def sequence_logprob(model, sequences, prompt_mask, n_new: int, temperature: float = 1.0):
    """Full forward over [B, S + n] sequences -> sum of log_softmax(logits / temperature) (full vocabulary) of the
    last n tokens [B]."""
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], n_new)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=mask, position_ids=pos).logits.float()
    logp = (logits / temperature).log_softmax(-1)
    picked = logp[:, -n_new - 1 : -1].gather(2, sequences[:, -n_new:, None]).squeeze(2)
    return picked.sum(1)


@torch.no_grad()
def catalog_logprob(
    model,
    input_ids,
    attention_mask,
    catalog: Catalog,
    temperature: float = 1.0,
    chunk: int = 1024,
    valid_mass: bool = False,
):
    """One left-padded prompt [1, S] -> log p, the exact tempered log-probability of every catalog item [N] float64,
    in the order of catalog.tokens: sum over the L levels of log_softmax(logits / temperature) over the FULL
    vocabulary. exp(log p) sums to 1 - p_b (p_b: the mass of invalid sequences); softmax(log p) over the catalog is
    P_S, the distribution DISC samples from. valid_mass=True returns (log p, log x) [N], x(a) = the product over the
    levels of the tempered mass of the tokens valid after a's prefix: constrained decoding draws a with probability
    Q(a) = p(a) / x(a). The prompt is prefilled once; each chunk of items continues a copy of that cache with its
    first L - 1 code tokens ([C, L - 1], one plain forward)."""
    if input_ids.shape[0] != 1 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"need one prompt [1, S], got input_ids {tuple(input_ids.shape)}, "
            f"attention_mask {tuple(attention_mask.shape)}"
        )
    if not temperature > 0 or chunk < 1:
        raise ValueError(f"need temperature > 0 and chunk >= 1, got {temperature}, {chunk}")
    if catalog.device != input_ids.device:
        raise ValueError(f"catalog is on {catalog.device} but input_ids on {input_ids.device}: use catalog.to(...)")
    code_len, dev = catalog.code_len, input_ids.device
    cache = DynamicCache(config=model.config)
    first = with_cache(
        model,
        cache,
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=True,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=1,
    ).logits  # [1, 1, V]
    start = int(attention_mask.sum())  # position of the first code token
    log_p, log_x = [], []
    for a in range(0, len(catalog), chunk):
        tokens = catalog.tokens[a : a + chunk]  # [C, L]
        c = tokens.shape[0]
        logits = first.expand(c, 1, -1)  # [C, 1, V]: level a, from the prompt
        if code_len > 1:
            rows = copy.deepcopy(cache)
            rows.batch_repeat_interleave(c)  # [C] copies of the prompt's KV
            mask = torch.cat([attention_mask.expand(c, -1), attention_mask.new_ones(c, code_len - 1)], 1)
            pos = (start + torch.arange(code_len - 1, device=dev)).expand(c, -1)  # [C, L - 1]
            later = with_cache(
                model, rows, input_ids=tokens[:, :-1], attention_mask=mask, position_ids=pos, use_cache=True
            ).logits  # [C, L - 1, V]: levels b.. from the item's own prefix
            logits = torch.cat([logits, later], 1)  # [C, L, V]
        logp = (logits.double() / temperature).log_softmax(-1)  # [C, L, V]
        log_p.append(logp.gather(2, tokens[:, :, None]).squeeze(2).sum(1))  # [C]
        if valid_mass:
            valid = torch.stack([catalog.allowed_next(tokens[:, :t]) for t in range(code_len)], 1)  # [C, L, V]
            log_x.append(logp.masked_fill(~valid, float("-inf")).logsumexp(-1).sum(1))  # [C]
    return (torch.cat(log_p), torch.cat(log_x)) if valid_mass else torch.cat(log_p)
