"""Tree attention: every tree node gets the logits of its unshared sequence; compaction keeps them."""

import pytest
import torch

from decoding.beam import beam_search, forward, head_of, prefill
from decoding.models import tiny_model
from decoding.tree import TokenTree
from tests.helpers import WIDTH, float32_atol, left_padded_prompts, random_catalog

V = 40


def tree_forward(model, tree, cache, tokens, parent, block_depth=1):
    """Tree nodes into the cache -> their next-token log-probs over the full vocabulary [B, Q, V]."""
    hidden = forward(model, tree, cache, tokens, parent, block_depth)
    return head_of(model).chunk_logits(hidden.flatten(0, 1), 0, V).log_softmax(-1).view(*tokens.shape, V)


def unshared_logp(model, ids, mask, path):
    """Next-token logprobs after prompt + path, computed the plain way (one sequence per row, no cache)."""
    seq = torch.cat([ids, path], 1)
    full = torch.cat([mask, torch.ones_like(path)], 1)
    pos = (full.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=seq, attention_mask=full, position_ids=pos).logits[:, -1].float().log_softmax(-1)


def assert_logp(got, want):
    """Next-token log-probabilities [B, V] by two kernels: within float32_atol (each logit sums WIDTH products, the
    normaliser V exponentials)."""
    torch.testing.assert_close(got, want, atol=float32_atol(got, want, terms=WIDTH + V), rtol=0)


def test_mask_and_positions_of_a_small_tree():
    tree = TokenTree.from_prompt(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    mask, pos = tree.add(torch.tensor([[-1, -1], [-1, -1]]), torch.float32)
    assert pos.tolist() == [[2, 2], [3, 3]]
    mask, pos = tree.add(torch.tensor([[1, 1, 2], [0, 0, 3]]), torch.float32, block_depth=2)  # nodes 2, 3, 4
    allowed = mask[:, 0] == 0  # [B, Q, S + T]
    assert allowed[0].int().tolist() == [
        [0, 1, 1, 0, 1, 1, 0, 0],  # node 2: prompt, node 1, itself
        [0, 1, 1, 0, 1, 0, 1, 0],  # node 3: node 1, itself
        [0, 1, 1, 0, 1, 1, 0, 1],
    ]  # node 4: nodes 1, 2, itself
    assert allowed[1, 2].int().tolist() == [1, 1, 1, 1, 0, 0, 1, 1]  # node 4 of user 1: 0 -> 3 -> 4
    assert pos.tolist() == [[3, 3, 4], [4, 4, 5]]
    assert tree.depth.tolist() == [[1, 1, 2, 2, 3], [1, 1, 2, 2, 3]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_unshared_sequences(arch, attn):
    model = tiny_model(arch, V, seed=1, attn_implementation=attn)
    ids, mask = left_padded_prompts(3, [4, 9, 6], V, seed=0)
    cache, _ = prefill(model, ids, mask)
    tree = TokenTree.from_prompt(mask)
    g = torch.Generator().manual_seed(0)
    # block 1: three children of the prompt; block 2: two levels at once (nodes 3, 4 under 0 and 2; 5 under 3)
    tok1 = torch.randint(4, V, (3, 3), generator=g)
    lp1 = tree_forward(model, tree, cache, tok1, torch.full((3, 3), -1))
    tok2 = torch.randint(4, V, (3, 3), generator=g)
    lp2 = tree_forward(model, tree, cache, tok2, torch.tensor([[0, 2, 3]] * 3), block_depth=2)
    for j in range(3):
        assert_logp(lp1[:, j], unshared_logp(model, ids, mask, tok1[:, j : j + 1]))
    paths = [
        torch.stack([tok1[:, 0], tok2[:, 0]], 1),
        torch.stack([tok1[:, 2], tok2[:, 1]], 1),
        torch.stack([tok1[:, 0], tok2[:, 0], tok2[:, 2]], 1),
    ]
    for j, path in enumerate(paths):
        assert_logp(lp2[:, j], unshared_logp(model, ids, mask, path))

    # compaction: keep the path of node 5 only; the cache shrinks and the logits below it stay the same
    before = cache.get_seq_length()
    new = tree.keep_paths(torch.tensor([[5]] * 3), cache)
    assert new.tolist() == [[2]] * 3 and cache.get_seq_length() == before - 3 == ids.shape[1] + 3
    tok3 = torch.randint(4, V, (3, 1), generator=g)
    lp3 = tree_forward(model, tree, cache, tok3, new)
    assert_logp(lp3[:, 0], unshared_logp(model, ids, mask, torch.cat([paths[2], tok3], 1)))


def test_compaction_pads_users_with_fewer_kept_nodes():
    model = tiny_model("llama", V, seed=2)
    ids, mask = left_padded_prompts(2, [5, 3], V, seed=1)
    cache, _ = prefill(model, ids, mask)
    tree = TokenTree.from_prompt(mask)
    tok = torch.randint(4, V, (2, 4), generator=torch.Generator().manual_seed(3))
    tree_forward(model, tree, cache, tok, torch.full((2, 4), -1))
    new = tree.keep_paths(torch.tensor([[1, 3], [2, -1]]), cache)  # user 0 keeps 2 nodes, user 1 keeps 1
    assert new.tolist() == [[0, 1], [0, -1]] and tree.num_nodes == 2
    lp = tree_forward(model, tree, cache, tok[:, :1], new[:, :1])
    assert_logp(lp[1, 0], unshared_logp(model, ids[1:], mask[1:], torch.stack([tok[1, 2], tok[1, 0]])[None])[0])


def test_prompt_kv_is_held_once():
    cat = random_catalog(500, 4, 6, seed=0)
    model = tiny_model("llama", cat.vocab_size, seed=0)
    ids, mask = left_padded_prompts(8, [7, 12, 20, 3], cat.vocab_size, seed=0)
    k = 20
    rec = beam_search(model, ids, mask, cat, k)
    st = rec.stats
    assert st["kv_batch"] == 8  # one cache row per user, not per beam
    assert st["kv_len"] == ids.shape[1] + st["tree_tokens"]  # padded prompt + tree tokens
    assert st["tree_tokens"] <= k * (cat.code_len - 1)
    assert st["kv_tokens"] == 8 * st["kv_len"] < 8 * k * ids.shape[1]


@pytest.mark.parametrize("arch, attn", [("llama", "eager"), ("qwen2", "sdpa")])
def test_chain_forward_equals_unshared_sequences(arch, attn):
    from decoding.tree import chain_forward

    model = tiny_model(arch, V, seed=5, attn_implementation=attn)
    ids, mask = left_padded_prompts(3, [4, 9, 6], V, seed=2)
    chains = torch.randint(4, V, (3, 2, 4), generator=torch.Generator().manual_seed(1))
    logits = chain_forward(model, ids, mask, chains).float().log_softmax(-1)  # [B, C, T, V]
    for c in range(2):
        for j in range(4):
            want = unshared_logp(model, ids, mask, chains[:, c, :j])
            assert_logp(logits[:, c, j], want)
    out = chain_forward(model, ids, mask, chains[:, :, :1])  # T = 1: only the prompt's prediction
    assert_logp(out[:, 0, 0].float().log_softmax(-1), unshared_logp(model, ids, mask, chains[:, 0, :0]))
