"""The baseline genrec-batch is measured against: `transformers` constrained beam search with a CPU trie.

Used by the exactness tests and by `python -m jobs.bench decode`.
"""
from __future__ import annotations

import torch

from decoding.catalog import Catalog


def cpu_trie(catalog: Catalog) -> dict:
    """prefix tuple -> sorted list of allowed next tokens (what users hand to `prefix_allowed_tokens_fn`)."""
    trie: dict = {}
    for row in catalog.tokens.tolist():
        for t in range(len(row)):
            trie.setdefault(tuple(row[:t]), set()).add(row[t])
    return {p: sorted(v) for p, v in trie.items()}


@torch.no_grad()
def generate_beam_search(model, input_ids, attention_mask, catalog: Catalog, k: int, trie: dict | None = None):
    """`model.generate(num_beams=k, num_return_sequences=k, max_new_tokens=L, length_penalty=0.0,
    prefix_allowed_tokens_fn=<CPU trie>)` -> (item ids [B, k], token ids [B, k, L], scores [B, k], kv tokens held)."""
    trie = cpu_trie(catalog) if trie is None else trie
    s, code_len = input_ids.shape[1], catalog.code_len

    def allowed(batch_id, sent):
        # a dead beam (prefix not in the catalog) still needs a non-empty list; its score is already -inf
        return trie.get(tuple(sent[s:].tolist()), [0])

    beam_args = dict(length_penalty=0.0) if k > 1 else {}
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, num_beams=k, num_return_sequences=k,
                         max_new_tokens=code_len, min_new_tokens=code_len, do_sample=False,
                         prefix_allowed_tokens_fn=allowed, return_dict_in_generate=True, output_scores=k > 1,
                         pad_token_id=0, eos_token_id=2, bos_token_id=1, top_k=None, top_p=None, temperature=None,
                         **beam_args)
    b = input_ids.shape[0]
    tokens = out.sequences[:, s:].reshape(b, k, code_len)
    items = catalog.lookup(tokens.reshape(-1, code_len)).view(b, k)
    cache = out.past_key_values
    kv_tokens = cache.layers[0].keys.shape[0] * cache.get_seq_length()
    if k == 1:  # generate() runs greedy search, which returns no sequence scores: score the sequences
        scores = sequence_logprob(model, out.sequences, attention_mask, code_len).view(b, 1)
    else:
        scores = out.sequences_scores.view(b, k).float()
    return items, tokens, scores, kv_tokens


@torch.no_grad()
def sequence_logprob(model, sequences, prompt_mask, n_new: int):
    """Full forward over [B, S + n] sequences -> sum of log_softmax (full vocabulary) of the last n tokens [B]."""
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], n_new)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logp = model(input_ids=sequences, attention_mask=mask, position_ids=pos).logits.float().log_softmax(-1)
    picked = logp[:, -n_new - 1:-1].gather(2, sequences[:, -n_new:, None]).squeeze(2)
    return picked.sum(1)
