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
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from decoding.beam import Prefix, Recommendations, beam_search
from decoding.catalog import Catalog
from decoding.compiled import (
    GRAPHS_PER_BUCKET,
    Bucket,
    Engine,
    compiled_beam_search,
    flex_compiles,
    prompt_bucket,
    users_bucket,
)
from decoding.metrics import same_within_ties, topk_agreement
from decoding.models import tiny_model
from decoding.stats import BASE_KEYS, PHASES
from tests.helpers import (
    assert_same_ranking,
    hf_beam_search,
    left_padded_prompts,
    random_catalog,
    sequence_logprob,
    trained_model,
)

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]  # 8 users, prompts of 3..17 tokens: bucket 8 x 24
PREFIX = Prefix([1, 9])  # Qwen2's prompts continue a shared prefix (one object: its slots are reused)
COUNTS = [key for key in BASE_KEYS if key not in PHASES] + ["kv_len", "kv_batch", "tree_tokens"]


pytestmark = pytest.mark.usefixtures("compile_cache")  # tests/conftest.py: the suite's inductor cache


@pytest.fixture(scope="module")
def catalog():
    return random_catalog(400, 4, 8, seed=11)


@pytest.fixture(scope="module")
def models(catalog):
    """One model per architecture, kept for the module: its engine (graphs, slots) is reused across tests."""
    return {
        arch: tiny_model(arch, catalog.vocab_size, seed=i)
        for i, arch in enumerate(("llama", "qwen2", "qwen3", "mistral"))
    }


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
        full[row, -len(real) :], full_mask[row, -len(real) :] = real, 1
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
    assert torch.equal(rec.item_ids[clear], ref.item_ids[clear]) and torch.equal(
        rec.token_ids[clear], ref.token_ids[clear]
    )
    assert same_within_ties(ref.item_ids, ref.scores, rec.item_ids, 2 * bound).all()
    assert torch.equal(catalog.lookup(rec.token_ids.view(-1, catalog.code_len)).view(rec.item_ids.shape), rec.item_ids)
    torch.testing.assert_close(rec.scores, ref.scores, atol=2 * bound, rtol=0)
    gap, want = rec.stats["tie_gap"], ref.stats["tie_gap"]
    assert (
        torch.equal(torch.isinf(gap), torch.isinf(want)) and ((gap - want)[~torch.isinf(want)].abs() <= 2 * bound).all()
    )
    return bound


def test_buckets():
    assert [users_bucket(n) for n in (1, 2, 3, 5, 8, 9, 200)] == [1, 2, 4, 8, 8, 16, 256]
    assert [prompt_bucket(n) for n in (1, 16, 17, 24, 25, 33, 49, 65, 97, 300)] == [
        16,
        16,
        24,
        24,
        32,
        48,
        64,
        96,
        128,
        384,
    ]
    assert Bucket.of(5, 17, 10, 4) == Bucket(8, 24, 10, 4)


# (architecture, K, attention): every architecture, K from 1 to 20, FlexAttention's block masks once (they compile
# slowest on a CPU; CUDA's default) and SDPA over the static mask (the CPU's default) elsewhere; Qwen2's prompts
# continue a shared prefix.
CASES = [("llama", 1, "flex"), ("qwen2", 10, "sdpa"), ("qwen3", 20, "sdpa"), ("mistral", 5, "sdpa")]


@pytest.mark.parametrize("arch, k, attention", CASES)
def test_equals_transformers_and_eager(models, catalog, arch, k, attention):
    model = models[arch]
    if attention == "flex" and not flex_compiles(model.device):  # ATEN_CPU_CAPABILITY=default: refused, clearly
        with pytest.raises(ValueError, match="FlexAttention compiles on a CPU with AVX2 kernels or wider"):
            Engine.of(model, "flex")
        attention = "sdpa"
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=k)
    prefix = PREFIX if arch == "qwen2" else None
    rec = compiled_beam_search(model, ids, mask, catalog, k, prefix=prefix, attention=attention)
    ref = beam_search(model, ids, mask, catalog, k, prefix=prefix)
    assert (rec.stats["bucket_users"], rec.stats["bucket_prompt"]) == (8, 24)
    assert_same_as_eager(model, ids, mask, catalog, k, rec, ref, prefix)
    full = full_prompts(prefix, ids, mask) if prefix else (ids, mask)
    items, tokens, scores = hf_beam_search(model, *full, catalog, k)
    assert_same_ranking(rec.item_ids, rec.scores, items, scores)


def test_an_index_over_the_recommendable_items_runs_in_the_same_graphs(models, catalog):
    """The module's 400 items and 40 more that the unrestricted search ranks, none of them recommendable (or all
    blocked): the index over the recommendable items is the 400-item catalog's, so the compiled engine decodes it in
    the graphs it already compiled, returns what eager returns over the 400 items alone, and never an extra item.
    So does an index whose semantic IDs name several items each (duplicate_items expand), listing them as eager does."""
    model = models["qwen2"]
    taken = {tuple(row) for row in catalog.tokens.tolist()}
    codes, levels = 8, catalog.code_len
    extra = [
        row
        for row in ([4 + j * codes + (n // codes**j) % codes for j in range(levels)] for n in range(codes**levels))
        if tuple(row) not in taken
    ][:: len(taken) // 4][:40]  # unused semantic IDs, spread over the trie
    ids_all = torch.cat([catalog.item_ids, 5000 + torch.arange(len(extra))])
    tokens = torch.cat([catalog.tokens, torch.tensor(extra)])
    keep = (ids_all < 5000).numpy()
    wide = Catalog.from_token_ids(ids_all, tokens, catalog.vocab_size)
    masked = Catalog.from_token_ids(ids_all, tokens, catalog.vocab_size, recommendable=keep)
    assert all(torch.equal(getattr(masked, f), getattr(catalog, f)) for f in ("item_ids", "tokens", "node_ptr"))
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=5)
    assert (beam_search(model, ids, mask, wide, 10, prefix=PREFIX).item_ids >= 5000).any()  # they would be ranked
    with torch.compiler.set_stance("fail_on_recompile"):
        rec = beam_search(model, ids, mask, masked, 10, prefix=PREFIX, engine="compiled")
    assert not (rec.item_ids >= 5000).any() and rec.stats["graphs_compiled"] == 0
    assert_same_as_eager(model, ids, mask, catalog, 10, rec, beam_search(model, ids, mask, catalog, 10, prefix=PREFIX))
    extra = 7000 + torch.arange(60)  # items sharing semantic IDs with the 400 (duplicate_items expand): the same trie
    ids_all, tokens = torch.cat([catalog.item_ids, extra]), torch.cat([catalog.tokens, catalog.tokens[::6][:60]])
    shared = Catalog.from_token_ids(ids_all, tokens, catalog.vocab_size, on_duplicate="expand")
    with torch.compiler.set_stance("fail_on_recompile"):
        rec = beam_search(model, ids, mask, shared, 10, prefix=PREFIX, engine="compiled")
    assert torch.isin(rec.item_ids, extra).any() and rec.stats["graphs_compiled"] == 0
    ref = beam_search(model, ids, mask, shared, 10, prefix=PREFIX)
    assert_same_ranking(rec.item_ids, rec.scores, ref.item_ids, ref.scores)


def test_a_second_batch_of_the_bucket_compiles_nothing(models, catalog):
    """Other users, other prompt lengths (up to 24 tokens, fewer users): the same bucket, no new graph; and the
    compiled regions hold no graph break (fullgraph=True raises on one; traced anew, each makes one graph per shape)."""
    model = models["qwen2"]
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=5)
    first = beam_search(model, ids, mask, catalog, 10, prefix=PREFIX, engine="compiled")  # compiled by now
    ids2, mask2 = left_padded_prompts(6, [24, 2, 19, 7, 13, 21], catalog.vocab_size, seed=6)
    with torch.compiler.set_stance("fail_on_recompile"):  # a graph that would compile raises instead
        rec = beam_search(model, ids2, mask2, catalog, 10, prefix=PREFIX, engine="compiled")
    assert rec.stats["graphs_compiled"] == 0 and rec.stats["compile_s"] == 0
    assert (
        (first.stats["bucket_users"], first.stats["bucket_prompt"])
        == (8, 24)
        == (rec.stats["bucket_users"], rec.stats["bucket_prompt"])
    )
    ref = beam_search(model, ids2, mask2, catalog, 10, prefix=PREFIX)
    assert_same_as_eager(model, ids2, mask2, catalog, 10, rec, ref, PREFIX)
    engine = Engine.of(model)
    slots = engine.slots_for(model, Bucket(8, 24, 10, 4), catalog, PREFIX)
    graphs = traced_graphs(engine, catalog, slots)  # the prefill, then the step of level 1
    assert graphs == {"prefill_in": 1, "prefill_out": 1, "step_in": 1, "step_out": 1, "layer": 2}


def traced_graphs(engine: Engine, catalog, slots) -> dict:
    """The engine's prefill and one step, each compiled region traced by dynamo anew into a counting backend (the
    graphs then run as traced, graph breaks allowed) -> region -> the graphs dynamo made of it: more than one per
    shape means a graph break or a recompile (the layer runs at two shapes, the prefill's and the step's, whatever
    the number of layers)."""
    names = ("prefill_in", "prefill_out", "step_in", "step_out", "layer")
    compiled = {n: getattr(engine, n) for n in names}
    counters = {n: CompileCounter() for n in names}
    try:
        for n in names:
            traced = torch.compile(compiled[n]._torchdynamo_orig_callable, backend=counters[n], dynamic=False)
            setattr(engine, n, traced)
        with torch._dynamo.config.patch(recompile_limit=256):
            engine.prefill(catalog, slots)
            engine.step(catalog, slots)
    finally:
        for n in names:
            setattr(engine, n, compiled[n])
    return {n: c.frame_count for n, c in counters.items()}


def test_the_compile_does_not_grow_with_depth(models, catalog):
    """Regional compilation: one decoder layer is compiled (at the prefill's and the step's shapes) and every layer
    runs it, its weights being its inputs. The 2-layer Qwen3's bucket compiles GRAPHS_PER_BUCKET graphs; a 4-layer
    Qwen3 of the same width then compiles none for the same bucket (dynamo traces its layer region twice, not once per
    layer), and returns what the eager engine returns."""
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=20)
    shallow = models["qwen3"]
    compiled_beam_search(shallow, ids, mask, catalog, 20)  # its bucket (the Qwen3 case above compiled it)
    assert Engine.of(shallow).graphs == GRAPHS_PER_BUCKET
    deep = tiny_model("qwen3", catalog.vocab_size, seed=7, num_hidden_layers=4)
    rec = compiled_beam_search(deep, ids, mask, catalog, 20)
    assert rec.stats["graphs_compiled"] == 0 and rec.stats["compile_s"] == 0
    assert_same_as_eager(deep, ids, mask, catalog, 20, rec, beam_search(deep, ids, mask, catalog, 20))
    engine = Engine.of(deep)
    slots = engine.slots_for(deep, Bucket(8, 24, 20, 4), catalog, None)
    assert traced_graphs(engine, catalog, slots) == {
        "prefill_in": 1,
        "prefill_out": 1,
        "step_in": 1,
        "step_out": 1,
        "layer": 2,
    }


GROUP, CLEAR, MAX_GROUPS = 32, 8, 4


@pytest.fixture(scope="module")
def trained(catalog):
    """Groups of 32 users, each with a Mistral trained to continue their prompts with their favourite items (a
    trained model's peaked scores; at K = 5 the shapes of the Mistral case above: its compiled code is reused from
    the inductor cache), built when first asked for: the bfloat16 test draws groups until it has clear users."""
    groups = {}

    def group(g: int):
        if g not in groups:
            ids, mask = left_padded_prompts(GROUP, LENGTHS, catalog.vocab_size, seed=7 + g)
            groups[g] = trained_model("mistral", catalog, ids, mask, steps=200, seed=g), ids, mask
        return groups[g]

    return group


def in_batches(model, ids, mask, catalog, k, engine, batch=8) -> Recommendations:
    return Recommendations.concat(
        [
            beam_search(model, ids[a : a + batch], mask[a : a + batch], catalog, k, engine=engine)
            for a in range(0, ids.shape[0], batch)
        ]
    )


def bfloat16_clear_users(model, ids, mask, catalog, k) -> int:
    """One group in float32 and bfloat16, both engines: float32 exact; in bfloat16 the compiled engine within twice
    what bfloat16 costs the eager engine against float32; users clear of their own bfloat16 errors (each engine's
    score difference to float32, floored at the group's upper quartile) get the same list from both. -> how many."""
    ref, rec = (in_batches(model, ids, mask, catalog, k, engine) for engine in ("eager", "compiled"))
    assert_same_as_eager(model, ids, mask, catalog, k, rec, ref)
    low = copy.deepcopy(model).to(torch.bfloat16)
    ref_low, rec_low = (in_batches(low, ids, mask, catalog, k, engine) for engine in ("eager", "compiled"))
    assert rec_low.stats["engine"] == "compiled" and rec_low.scores.dtype == torch.float32
    diff = lambda a, b: topk_agreement(a.item_ids, a.scores, b.item_ids, b.scores)["score_diff"]  # noqa: E731 [U]
    e, e_compiled, between = diff(ref, ref_low), diff(ref, rec_low), diff(ref_low, rec_low)
    assert 0 < e.max() and between.max() <= 2 * e.max(), (
        f"bfloat16: compiled vs eager {between.max():.3g}, eager vs float32 {e.max():.3g}"
    )
    err = e + e_compiled  # [U]
    clear = ref.stats["tie_gap"] >= 2 * err.clamp(min=float(err.quantile(0.75)))  # [U] both lists are float32's
    assert torch.equal(rec_low.item_ids[clear], ref_low.item_ids[clear])
    return int(clear.sum())


def test_a_trained_model_in_float32_and_bfloat16(catalog, trained):
    """Users in batches of 8 (one bucket: its graphs compiled once per dtype, run by every batch). float32: the eager
    engine's results (the rounding bound measured as above). bfloat16: the two engines round the body differently
    (inductor keeps a fused kernel's intermediates in float32); their difference must stay within twice the largest
    that bfloat16 costs the eager engine against float32 on the same weights (measured here), and a user whose
    float32 search had no near-tie within its own two bfloat16 errors gets the same list from both. Groups of 32
    users are drawn until CLEAR users are clear (at most MAX_GROUPS): the verdict never rests on too few."""
    clear = 0
    for g in range(MAX_GROUPS):
        clear += bfloat16_clear_users(*trained(g), catalog, 5)
        if clear >= CLEAR:
            return
    raise AssertionError(f"{clear} of {GROUP * MAX_GROUPS} users clear of bfloat16's rounding: it swamps the gaps")


def test_other_models_and_sampling_run_eager_and_say_why(catalog):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma",
        vocab_size=catalog.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
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
        rec = beam_search(
            llama, ids, mask, catalog, 4, do_sample=True, engine="compiled", generator=torch.Generator().manual_seed(0)
        )
    assert rec.stats["engine"] == "eager" and "do_sample" in rec.stats["engine_note"] and seen
    with pytest.raises(ValueError, match="engine must be eager or compiled"):
        beam_search(llama, ids, mask, catalog, 4, engine="fast")


def test_config_names_a_bad_engine():
    from pipeline.config import load_config

    base = ["input=in.parquet", "catalog=items.parquet", "output=out", "models.target=m"]
    assert load_config(None, base).compute.engine == "eager"
    with pytest.raises(ValueError, match="config: compute.engine must be eager, compiled or auto, got 'fast'"):
        load_config(None, [*base, "compute.engine=fast"])
    with pytest.raises(ValueError, match="compute.engine compiled runs decoding.mode beam .* disc runs eager"):
        load_config(None, [*base, "compute.engine=compiled", "decoding.mode=disc"])


def test_bench_decode_puts_the_engines_side_by_side(models, catalog):
    """`bench decode --engines eager compiled`'s section on the Mistral case's bucket (compiled already: the warm-up
    compiles nothing): both engines timed over the same batches, the compiled engine's lists the eager ones."""
    from pipeline.bench.decode import bench_engines, markdown_decode
    from pipeline.bench.params import DecodeParams

    ids, mask = left_padded_prompts(16, LENGTHS, catalog.vocab_size, seed=9)
    p = DecodeParams(data="-", users=16, batch=8, k=5, repeats=2, engines=["eager", "compiled"])
    e = bench_engines(p, models["mistral"], catalog, ids, mask)
    assert e["bucket"] == [8, 24] and e["order"] == ["eager", "compiled", "compiled", "eager"]
    assert all(len(m["timing"]["seconds"]) == 2 for m in e["methods"].values())
    ag = e["agreement"]
    assert ag["users"] == 16 and ag["clear_users_identical"] == ag["clear_users"] and ag["same_within_ties"] == 1.0
    assert e["speedup"]["low"] <= e["speedup"]["median"] <= e["speedup"]["high"]
    from pipeline.bench.common import environment

    md = markdown_decode({"engines": e, "args": {"k": 5}, "environment": environment("cpu", "bench decode")})
    assert "## beam_search engines: eager vs compiled" in md and "compiled over eager" in md


@pytest.fixture(scope="module")
def auto_world(tmp_path_factory):
    from tests.test_nightly import make_world

    return make_world(tmp_path_factory.mktemp("engine-auto"), n_users=48)


def test_bench_gpu_auto_section_runs_the_nightly_actor_with_engine_auto(auto_world, tmp_path):
    """`bench gpu --sections auto` at smoke sizes on the CPU (on a GPU `make bench-gpu` runs it on the device): the
    nightly's actor with compute.engine auto decodes 48 users in shards of 16, trials both engines on them first,
    chooses with parity evidence, and the report says what it chose and why."""
    from pipeline.bench.gpu import run_gpu
    from pipeline.bench.params import GpuParams

    params = GpuParams(
        data=str(auto_world / "data"),
        sections=["auto"],
        smoke=True,
        device="cpu",
        target=str(auto_world / "target"),
        out=str(tmp_path),
    )
    result, md = run_gpu(params, "test")
    [a] = [r for r in result["cells"] if r["kind"] == "auto"]
    assert a["users"] == 48 and a["state"]["trial_batches"] >= 2 and a["state"]["device"] == "cpu"
    assert a["state"]["choice"] in ("eager", "compiled") and all(p["holds"] for p in a["state"]["parity"])
    assert a["users_per_s_after"]["median"] > 0  # the third shard, decoded by the choice
    assert f"choice: **{a['state']['choice']}** on cpu" in md
