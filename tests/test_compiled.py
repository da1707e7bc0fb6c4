"""The compiled engine (decoding/compiled.py) returns what the eager engine and transformers return, and compiles
each graph once per bucket.

Compiling costs tens of seconds per graph on a CPU, so these tests are few and share their graphs: one catalog, one
bucket of 8 users x 24 prompt columns, each (architecture, K) compiled once, and one model per architecture for the
module (its engine keeps its graphs and slots); the inductor cache directory (COMPILE_CACHE) is shared by the suite
and its Ray workers and kept between runs.

Tolerances. Scores are float32 sums of log-probabilities; two float32 engines differ by rounding, whose size depends
on the machine's kernels. Each test measures it in the same run: the eager engine's largest error against the exact
(float64) log-probability of the same items is `err`; the compiled engine's error must stay within 4 x err (two
computations of the same float32 quantity in different kernel orders, with a margin), and users whose eager search
never had its k-th and (k+1)-th candidates within 2 x that bound (stats["tie_gap"]) get identical lists.
"""
import copy
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from decoding.beam import Prefix, beam_search
from decoding.compiled import Bucket, Engine, compiled_beam_search, no_recompiles, prompt_bucket, users_bucket
from decoding.metrics import same_within_ties
from decoding.models import tiny_model
from decoding.stats import BASE_KEYS, PHASES
from tests.helpers import (assert_same_ranking, hf_beam_search, left_padded_prompts, random_catalog,
                           sequence_logprob)

COMPILE_CACHE = Path(tempfile.gettempdir()) / "genrec-test-compile-cache"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE))  # before anything compiles in this process
LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]  # 8 users, prompts of 3..17 tokens: bucket 8 x 24
PREFIX = Prefix([1, 9])  # Qwen2's prompts continue a shared prefix (one object: its slots are reused)
COUNTS = [key for key in BASE_KEYS if key not in PHASES] + ["kv_len", "kv_batch", "tree_tokens"]


@pytest.fixture(scope="module")
def catalog():
    return random_catalog(400, 4, 8, seed=11)


@pytest.fixture(scope="module")
def models(catalog):
    """One model per architecture, kept for the module: its engine (graphs, slots) is reused across tests."""
    return {arch: tiny_model(arch, catalog.vocab_size, seed=i) for i, arch in
            enumerate(("llama", "qwen2", "qwen3", "mistral"))}


def exact_scores(model, ids, mask, tokens, prefix=None):
    """float64 log-probabilities of the sequences tokens [B, K, L] after the prompts [B] -> [B, K]."""
    b, k, code_len = tokens.shape
    if prefix is not None:
        ids, mask = full_prompts(prefix, ids, mask)
    model64 = copy.deepcopy(model).double()
    seq = torch.cat([ids.repeat_interleave(k, 0), tokens.reshape(b * k, code_len).clamp(min=0)], 1)
    return sequence_logprob(model64, seq, mask.repeat_interleave(k, 0), code_len).view(b, k).float()


def full_prompts(prefix: Prefix, ids, mask):
    """Prompts that continue `prefix` -> the same prompts written out in full, left-padded [B, P + S]."""
    p = len(prefix)
    full = torch.zeros(ids.shape[0], p + ids.shape[1], dtype=ids.dtype)
    full_mask = torch.zeros_like(full)
    for row in range(ids.shape[0]):
        real = torch.cat([prefix.ids, ids[row][mask[row].bool()]])
        full[row, -len(real):], full_mask[row, -len(real):] = real, 1
    return full, full_mask


def assert_same_as_eager(model, ids, mask, catalog, k, rec, ref, prefix=None):
    """rec (compiled) against ref (eager): stats counted alike; scores within the rounding measured here; identical
    lists for users clear of a near-tie, the same up to near-tie swaps for the others."""
    for key in COUNTS:
        assert rec.stats[key] == ref.stats[key], key
    assert torch.equal(rec.stats["non_finite"], ref.stats["non_finite"])
    assert rec.stats["engine"] == "compiled" and rec.scores.dtype == torch.float32
    alive = ref.item_ids >= 0
    err = (ref.scores - exact_scores(model, ids, mask, ref.token_ids, prefix))[alive].abs().max()
    bound = 4 * max(float(err), torch.finfo(torch.float32).eps * float(ref.scores[alive].abs().max()))
    got = (rec.scores - exact_scores(model, ids, mask, rec.token_ids, prefix))[rec.item_ids >= 0].abs().max()
    assert got <= bound, f"compiled scores off the exact ones by {got:.3g}, eager's rounding bound {bound:.3g}"
    clear = ref.stats["tie_gap"] > 2 * bound
    assert torch.equal(rec.item_ids[clear], ref.item_ids[clear]) and torch.equal(rec.token_ids[clear],
                                                                                   ref.token_ids[clear])
    assert same_within_ties(ref.item_ids, ref.scores, rec.item_ids, 2 * bound).all()
    assert torch.equal(catalog.lookup(rec.token_ids.view(-1, catalog.code_len)).view(rec.item_ids.shape), rec.item_ids)
    torch.testing.assert_close(rec.scores, ref.scores, atol=2 * bound, rtol=0)
    gap, want = rec.stats["tie_gap"], ref.stats["tie_gap"]
    assert torch.equal(torch.isinf(gap), torch.isinf(want)) and ((gap - want)[~torch.isinf(want)].abs() <= 2 * bound).all()
    return bound


def test_buckets():
    assert [users_bucket(n) for n in (1, 2, 3, 5, 8, 9, 200)] == [1, 2, 4, 8, 8, 16, 256]
    assert [prompt_bucket(n) for n in (1, 16, 17, 24, 25, 33, 49, 65, 97, 300)] == [16, 16, 24, 24, 32, 48, 64, 96,
                                                                                    128, 384]
    assert Bucket.of(5, 17, 10, 4) == Bucket(8, 24, 10, 4)


# (architecture, K, attention): every architecture, K from 1 to 20, FlexAttention's block masks once (they compile
# slowest on a CPU; CUDA's default) and SDPA over the static mask (the CPU's default) elsewhere; Qwen2's prompts
# continue a shared prefix.
CASES = [("llama", 1, "flex"), ("qwen2", 5, "sdpa"), ("qwen3", 20, "sdpa"), ("mistral", 10, "sdpa")]


@pytest.mark.parametrize("arch, k, attention", CASES)
def test_equals_transformers_and_eager(models, catalog, arch, k, attention):
    model = models[arch]
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=k)
    prefix = PREFIX if arch == "qwen2" else None
    rec = compiled_beam_search(model, ids, mask, catalog, k, prefix=prefix, attention=attention)
    ref = beam_search(model, ids, mask, catalog, k, prefix=prefix)
    assert (rec.stats["bucket_users"], rec.stats["bucket_prompt"]) == (8, 24)
    assert_same_as_eager(model, ids, mask, catalog, k, rec, ref, prefix)
    full = full_prompts(prefix, ids, mask) if prefix else (ids, mask)
    items, tokens, scores = hf_beam_search(model, *full, catalog, k)
    assert_same_ranking(rec.item_ids, rec.scores, items, scores)


def test_a_second_batch_of_the_bucket_compiles_nothing(models, catalog):
    """Other users, other prompt lengths (up to 24 tokens, fewer users): the same bucket, no new graph; and the
    graphs hold no graph break (fullgraph=True raises on one; dynamo's explain counts none)."""
    model = models["qwen2"]
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=5)
    first = beam_search(model, ids, mask, catalog, 5, prefix=PREFIX, engine="compiled")  # compiled by now
    ids2, mask2 = left_padded_prompts(6, [24, 2, 19, 7, 13, 21], catalog.vocab_size, seed=6)
    with no_recompiles():
        rec = beam_search(model, ids2, mask2, catalog, 5, prefix=PREFIX, engine="compiled")
    assert rec.stats["graphs_compiled"] == 0 and rec.stats["compile_s"] == 0
    assert (first.stats["bucket_users"], first.stats["bucket_prompt"]) == (8, 24) == (rec.stats["bucket_users"],
                                                                                     rec.stats["bucket_prompt"])
    ref = beam_search(model, ids2, mask2, catalog, 5, prefix=PREFIX)
    assert_same_as_eager(model, ids2, mask2, catalog, 5, rec, ref, PREFIX)
    engine = Engine.of(model)
    slots = engine.slots_for(model, Bucket(8, 24, 5, 4), catalog, PREFIX)
    for graph in (engine.prefill, engine.step):  # prefill, then the step of level 1
        explained = torch._dynamo.explain(graph._torchdynamo_orig_callable)(engine.body, catalog, slots)
        assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_other_models_and_sampling_run_eager_and_say_why(catalog):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma", vocab_size=catalog.vocab_size, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gemma = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = left_padded_prompts(3, LENGTHS, catalog.vocab_size, seed=2)
    with pytest.warns(UserWarning, match="model_type 'gemma'"):
        rec = beam_search(gemma, ids, mask, catalog, 4, engine="compiled")
    ref = beam_search(gemma, ids, mask, catalog, 4)
    assert rec.stats["engine"] == "eager" and "llama, qwen2, qwen3, mistral" in rec.stats["engine_note"]
    assert torch.equal(rec.item_ids, ref.item_ids) and torch.equal(rec.scores, ref.scores)
    llama = tiny_model("llama", catalog.vocab_size)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rec = beam_search(llama, ids, mask, catalog, 4, do_sample=True, engine="compiled",
                          generator=torch.Generator().manual_seed(0))
    assert rec.stats["engine"] == "eager" and "do_sample" in rec.stats["engine_note"] and seen
    with pytest.raises(ValueError, match="engine must be eager or compiled"):
        beam_search(llama, ids, mask, catalog, 4, engine="fast")
