"""One stats contract (decoding/stats.py): every decoder returns the same base keys, with counts that follow from
its algorithm and phases that add up to its wall time."""

import time

import pytest
import torch

from decoding.beam import beam_search
from decoding.disc import constrained_sample, disc_sample
from decoding.models import tiny_model
from decoding.speculative import speculative_beam_search
from decoding.stats import BASE_KEYS, PHASES
from tests.helpers import left_padded_prompts, random_catalog

K = 4


@pytest.fixture(scope="module")
def setup():
    cat = random_catalog(300, 3, 8, seed=2)
    target = tiny_model("llama", cat.vocab_size, seed=1)
    draft = tiny_model("qwen2", cat.vocab_size, seed=2, num_hidden_layers=1)
    ids, mask = left_padded_prompts(5, [4, 9, 6, 2, 7], cat.vocab_size, seed=1)
    return cat, target, draft, ids, mask


def decoders(cat, target, draft):
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    return {
        "beam": lambda i, m: beam_search(target, i, m, cat, K),
        "beam-sample": lambda i, m: beam_search(target, i, m, cat, K, do_sample=True, generator=g()),
        "atspeed-strict": lambda i, m: speculative_beam_search(target, draft, i, m, cat, K, draft_beams=8),
        "atspeed-relaxed": lambda i, m: speculative_beam_search(
            target, draft, i, m, cat, K, verification="relaxed", generator=g()
        ),
        "disc": lambda i, m: disc_sample(target, i, m, cat, K, rounds=2, generator=g()),
        "constrained": lambda i, m: constrained_sample(target, i, m, cat, K, generator=g()),
    }


@pytest.mark.parametrize("name", ["beam", "beam-sample", "atspeed-strict", "atspeed-relaxed", "disc", "constrained"])
def test_every_decoder_returns_the_base_keys(setup, name):
    cat, target, draft, ids, mask = setup
    b, s, code_len = *ids.shape, cat.code_len
    t0 = time.perf_counter()
    st = decoders(cat, target, draft)[name](ids, mask).stats
    wall = time.perf_counter() - t0
    assert set(BASE_KEYS) <= set(st)
    assert all(isinstance(st[p], float) and st[p] >= 0 for p in PHASES)
    assert all(type(st[c]) is int for c in BASE_KEYS if c not in PHASES)
    assert st["prefill_s"] > 0 and st["decode_s"] > 0
    assert 0.5 * wall < sum(st[p] for p in PHASES) <= wall  # the phases are the decoder's wall time
    assert st["kv_tokens_beam_batch"] == b * K * (s + code_len - 1)
    if name.startswith("atspeed"):
        assert st["draft_s"] > 0 and st["verify_s"] > 0
        assert st["target_forwards"] == 1 + int(st["rounds"].max())
        assert st["draft_forwards"] >= 2  # the prefill, the pending beams (the last drafted step is not run)
        # the prefill, then per round one block of K pending beams + N nodes per drafted step for every user left
        assert st["target_tokens"] > b * s + int(st["rounds"].max()) * K and st["draft_tokens"] > b * s
        assert st["kv_tokens"] > 2 * b * s  # target and draft each hold every prompt once, plus their trees
        return
    assert st["draft_s"] == st["verify_s"] == 0.0 and st["draft_forwards"] == st["draft_tokens"] == 0
    if name.startswith("beam"):  # one prefill, then L - 1 forwards of K tree tokens per user
        assert st["target_forwards"] == code_len
        assert st["target_tokens"] == b * s + (code_len - 1) * b * K
        assert st["kv_tokens"] == b * (s + st["tree_tokens"]) and st["tree_tokens"] <= K * (code_len - 1)
    else:  # k draws of P proposals (DISC: 2 * rounds, constrained: 1) of L - 1 levels after the prefill, each trie
        # node run once per user however many proposals reach it: at most one forward per draw and level
        proposals = 4 if name == "disc" else 1
        assert code_len <= st["target_forwards"] <= 1 + K * (code_len - 1)
        tree_tokens = st["target_tokens"] - b * s
        assert b * (code_len - 1) <= tree_tokens <= K * (code_len - 1) * b * proposals
        assert st["kv_tokens"] <= b * (s + K * (code_len - 1) * proposals)  # the tree keeps every scored node
        assert (st["expanded_nodes"] >= code_len).all()  # the root and at least one node per level
