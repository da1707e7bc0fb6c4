"""Shared test fixtures: random catalogs, left-padded prompts, a CPU trie for `generate`, comparisons."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from decoding.catalog import Catalog
from decoding.models import TINY_BODY, tiny_model
from decoding.reference import generate_beam_search, sequence_logprob  # noqa: F401

# The inductor cache of the tests that compile (tests/conftest.py's compile_cache fixture, and the nightly actors they
# start): kept between runs and shared by every module that compiles (inductor keys its code by the CPU's ISA).
COMPILE_CACHE = str(Path(tempfile.gettempdir()) / "genrec-test-compile-cache")

SPECIALS = 4  # <pad> <bos> <eos> <unk>
EPS32 = torch.finfo(torch.float32).eps
WIDTH = TINY_BODY["hidden_size"]  # the longest inner product behind a tiny model's logit


def float32_atol(*values: torch.Tensor, terms: int = WIDTH) -> float:
    """How far two float32 computations of the same quantities may differ when their kernels accumulate in other
    orders (another batch shape, a token tree against a plain forward, another CPU kernel family): a float32 sum of
    n terms is within n eps32 / 2 of their magnitude whatever the order (Higham, Accuracy and Stability, 3.1), so
    two orders within n eps32. n: the longest sum behind each value (a tiny model's hidden width by default; a
    normaliser over V tokens sums V). The magnitude: the largest finite |value| given (a log-probability's terms are
    all <= 0, so a score's magnitude is the sum of its levels'). Measured differences sit 10-100x below."""
    finite = [v.detach()[torch.isfinite(v)].abs().max() for v in values if torch.isfinite(v).any()]
    return terms * EPS32 * float(max(finite, default=torch.tensor(1.0)))


def tiny_gemma2(vocab_size: int, **overrides):
    """A tiny random Gemma2 (sliding-window layers, eager attention; `overrides`: config fields, e.g.
    final_logit_softcapping), seeded: an architecture outside decoding/models.py's TINY."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, head_dim=16, sliding_window=64, pad_token_id=0, bos_token_id=1)
    config = AutoConfig.for_model("gemma2", vocab_size=vocab_size, eos_token_id=2, **shape, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def random_catalog(n_items: int, levels: int, codes: int, seed: int = 0, skew: float = 0.0) -> Catalog:
    """n_items distinct semantic IDs over `levels` x `codes`; token id = SPECIALS + level * codes + code.
    skew > 0 concentrates the first levels on few codes, so that some prefixes have few continuations."""
    g = torch.Generator().manual_seed(seed)
    space = codes**levels
    if n_items > space:
        raise ValueError("more items than semantic IDs")
    weights = torch.ones(space) if skew == 0 else torch.rand(space, generator=g) ** (1 + 10 * skew)
    flat = torch.multinomial(weights, n_items, replacement=False, generator=g)
    digits = torch.stack([(flat // codes ** (levels - 1 - j)) % codes for j in range(levels)], 1)
    tokens = SPECIALS + torch.arange(levels) * codes + digits
    item_ids = 1000 + torch.randperm(n_items, generator=g)
    return Catalog.from_token_ids(item_ids, tokens, SPECIALS + levels * codes)


def left_padded_prompts(batch: int, lengths, vocab_size: int, seed: int = 0):
    """Prompts of the given lengths (cycled), <bos> first, left-padded with <pad>=0 -> ids, mask [B, S]."""
    g = torch.Generator().manual_seed(seed)
    lens = [lengths[i % len(lengths)] for i in range(batch)]
    s = max(lens)
    ids = torch.zeros(batch, s, dtype=torch.int64)
    mask = torch.zeros(batch, s, dtype=torch.int64)
    for i, n in enumerate(lens):
        ids[i, s - n] = 1
        ids[i, s - n + 1 :] = torch.randint(SPECIALS, vocab_size, (n - 1,), generator=g)
        mask[i, s - n :] = 1
    return ids, mask


def hf_beam_search(model, input_ids, attention_mask, catalog: Catalog, k: int):
    """transformers' constrained beam search -> (item ids [B, k], token ids [B, k, L], scores [B, k])."""
    return generate_beam_search(model, input_ids, attention_mask, catalog, k)[:3]


def assert_same_ranking(items_a, scores_a, items_b, scores_b, atol: float | None = None):
    """Same items in the same order, scores within `atol` (default: float32_atol of the scores); items whose scores
    are within 2 atol of each other may swap (each of the two may be off by atol)."""
    assert items_a.shape == items_b.shape
    atol = float32_atol(scores_a, scores_b) if atol is None else atol
    tie = 2 * atol
    torch.testing.assert_close(scores_a, scores_b, atol=atol, rtol=0)
    for r in range(items_a.shape[0]):
        a, b, sa = items_a[r].tolist(), items_b[r].tolist(), scores_a[r].tolist()
        i = 0
        while i < len(a):  # compare groups of (near-)tied scores as sets
            j = i + 1
            while j < len(a) and abs(sa[j] - sa[i]) <= tie:
                j += 1
            assert sorted(a[i:j]) == sorted(b[i:j]), f"row {r}, ranks {i + 1}..{j}: {a[i:j]} != {b[i:j]}"
            i = j


def bpe_tokenizer(levels: int, codes: int, vocab_size: int = 600, code_tokens: bool = True):
    """A byte-level BPE trained here on instruction text (see pipeline.prepare.build_text_tokenizer)."""
    from pipeline.prepare import build_text_tokenizer

    return build_text_tokenizer(levels, codes, vocab_size, code_tokens)


def trained_model(arch: str, catalog: Catalog, input_ids, attention_mask, steps: int = 300, seed: int = 0, **kw):
    """A tiny float32 causal LM trained (Adam, `steps` steps) to continue each prompt with one of its own 8 catalog
    items, drawn with Zipf weights 1/r: peaked next-token distributions and a trained model's logit gaps (random
    weights give near-uniform scores whose ties sit below half-precision rounding)."""
    model = tiny_model(arch, catalog.vocab_size, seed=seed, **kw).train()
    g = torch.Generator().manual_seed(seed)
    b, code_len = input_ids.shape[0], catalog.code_len
    favourite = torch.randint(0, catalog.tokens.shape[0], (b, 8), generator=g)  # [B, 8] catalog rows
    weights = (1 / torch.arange(1, 9).float()).expand(b, -1)  # [B, 8]
    mask = torch.cat([attention_mask, attention_mask.new_ones(b, code_len)], 1)  # [B, S + L]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        codes = catalog.tokens[favourite.gather(1, torch.multinomial(weights, 1, generator=g))[:, 0]]  # [B, L]
        logits = model(input_ids=torch.cat([input_ids, codes], 1), attention_mask=mask, position_ids=pos).logits[
            :, -code_len - 1 : -1
        ]  # [B, L, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), codes.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def forced_scores(model, input_ids, attention_mask, tokens, head: str = "exact"):
    """Each listed item's score [B, K] by one plain forward of `model` over prompt + item (no token tree): the sum
    over its L tokens of log_softmax over the full vocabulary. head "exact": the logits of the body's hidden states
    computed in float64 (the exact product of the model's own inputs, nothing rounded after the body); "model": the
    model's own logits (rounded to its dtype, as transformers computes them). tokens [B, K, L], -1 rows -> -inf."""
    b, k, code_len = tokens.shape
    real = (tokens >= 0).all(2)  # [B, K]
    seq = torch.cat([input_ids.repeat_interleave(k, 0), tokens.clamp(min=0).reshape(b * k, code_len)], 1)
    mask = torch.cat([attention_mask.repeat_interleave(k, 0), attention_mask.new_ones(b * k, code_len)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    if head == "exact":
        hidden = model.base_model(input_ids=seq, attention_mask=mask, position_ids=pos).last_hidden_state
        out = model.get_output_embeddings()
        logits = hidden.double() @ out.weight.double().t()  # [B K, S + L, V]
        if out.bias is not None:
            logits += out.bias.double()
    else:
        logits = model(input_ids=seq, attention_mask=mask, position_ids=pos).logits.double()
    logp = logits.log_softmax(-1)[:, -code_len - 1 : -1].gather(2, seq[:, -code_len:, None]).squeeze(2)
    return torch.where(real, logp.sum(1).view(b, k), float("-inf"))


def reference_ids(pieces: list[tuple[str, str]], tokenizer) -> list[int]:
    """A prompt's ids by definition, the slow way, from its pieces (operators.text.prompt_pieces: template text, data,
    trusted data, BOS, the instruction's break): added tokens matched by the tokenizer itself in the template's text
    and in trusted data only (a piece on its own: data in between breaks a match), found by their offsets; every span
    between two of them, data included, tokenized by transformers' own pipeline without added tokens
    (`_encode_without_added_tokens`, what its `sanitize_control_tokens` uses)."""
    added, ids, span = set(tokenizer.added_tokens_decoder), [], [""]

    def flush():
        ids.extend(tokenizer._encode_without_added_tokens(span[0]) if span[0] else [])
        span[0] = ""

    for text, kind in pieces:
        if kind in ("bos", "break"):
            flush()
            ids.extend([tokenizer.bos_token_id] if kind == "bos" else [])
        elif kind == "data":
            span[0] += text
        else:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            at = 0
            for token, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]):
                if token in added:
                    span[0] += text[at:a]
                    flush()
                    ids.append(token)
                    at = b
            span[0] += text[at:]
    flush()
    return ids


LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}[ \t](DEBUG|INFO|WARNING|ERROR) (\S+: |\S+:\d+ -- )"  # ours | Ray's
    r"|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [DIWE] \d+ \d+\] \S+:\d+: "  # Ray's core (C++)
    r"|\([\w()]+ pid=\d+(, ip=[\d.]+)?\) "  # a Ray worker's line, forwarded to the driver
)


def assert_one_error_line(stderr: str, error: str) -> None:
    """A command's whole stderr: exactly one `error:` line, matching the regular expression `error` whole; every
    other line a log record (the job's, Ray's or a worker's forwarded, without a colour code before it), with no
    traceback, no Ray task header and no deprecation anywhere."""
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(error, errors[0]), errors or stderr[-3000:]
    strays = [line for line in lines if not line.startswith("error:") and not LOG_LINE.match(line)]
    assert not strays, strays[:20]
    for mark in ("Traceback", "ray::", 'File "', "deprecated"):
        assert mark not in stderr, [line for line in lines if mark in line][:5]
