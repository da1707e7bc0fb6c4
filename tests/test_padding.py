"""Length-ordered batches through the actor (operators/recommender.py, compute.order_by_length): beam search lists
that do not depend on the users' order, sampled items that do not depend on the batch, the recorded padding equal to
one computed from the prompts, and the read side's ordering (pipeline/units.py)."""

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from decoding.catalog import Catalog
from decoding.models import load_tokenizer
from decoding.templates import PRESETS
from operators.prompts import Renderer, catalog_probes
from pipeline.units import by_length
from tests.helpers import float32_atol
from tests.test_nightly import config, make_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("padding"), n_users=40)


@pytest.fixture(scope="module")
def users(world):
    return pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"]).slice(0, 24)


def actor(world, *settings, **spec):
    from operators.recommender import Recommender
    from pipeline.plan import plan_run

    return Recommender(replace(plan_run(config(world, world / "unused", *settings)).spec, **spec))


def recs(out: pa.Table) -> pd.DataFrame:
    t = out.filter(pc.equal(out["kind"], "rec")).to_pandas()
    return t[["user_id", "rank", "item_id", "score"]].reset_index(drop=True)


def metric(out: pa.Table) -> dict:
    return json.loads(out.filter(pc.equal(out["kind"], "metric"))["metrics"][0].as_py())


def by_user(t: pd.DataFrame) -> pd.DataFrame:
    return t.sort_values(["user_id", "rank"]).reset_index(drop=True)


def test_beam_lists_do_not_depend_on_the_users_order(world, users):
    """The same 24 users in input order and in three permutations, decoded in slices of 5 ordered by prompt length:
    every user the same list and scores, bit for bit (the slices are cut from the same order: prompt length, then
    user id), and the output rows in the order the users came. Against the actor that decodes in input order (other
    slices, other padding): the same lists, scores within float32's rounding of other summation orders."""
    ordered = actor(world, decode_batch=5)
    base = recs(ordered(users))
    assert list(dict.fromkeys(base.user_id)) == users["user_id"].to_pylist()
    rng = np.random.default_rng(0)
    for _ in range(3):
        perm = rng.permutation(users.num_rows)
        got = recs(ordered(users.take(pa.array(perm))))
        assert list(dict.fromkeys(got.user_id)) == users["user_id"].take(pa.array(perm)).to_pylist()
        pd.testing.assert_frame_equal(by_user(got), by_user(base), check_exact=True)
    plain = recs(actor(world, decode_batch=5, order_by_length=False)(users))
    assert plain.item_id.tolist() == base.item_id.tolist()
    atol = float32_atol(torch.tensor(base.score.to_numpy()))
    pd.testing.assert_frame_equal(plain, base, check_exact=False, atol=atol, rtol=0)


@pytest.mark.parametrize("mode", ["disc", "atspeed-relaxed"])
def test_a_users_sampled_items_do_not_depend_on_its_batch(world, users, mode):
    """A sampling mode's items per user: the 24 users decoded together in slices of 5, each of six users decoded
    alone, and after a restart (a fresh actor) in another shard (other users, another order, slices of 3): the same
    items, whatever the batch."""
    together = by_user(recs(actor(world, f"decoding.mode={mode}", decode_batch=5)(users)))
    want = {u: g.item_id.tolist() for u, g in together.groupby("user_id")}
    single = actor(world, f"decoding.mode={mode}")
    for i in range(0, 24, 4):
        got = recs(single(users.slice(i, 1)))
        assert got.item_id.tolist() == want[users["user_id"][i].as_py()]
    other = pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"]).slice(24, 16)
    shard = pa.concat_tables([other.slice(0, 8), users.slice(8, 10), other.slice(8, 8)])
    shard = shard.take(pa.array(np.random.default_rng(1).permutation(shard.num_rows)))
    resumed = recs(actor(world, f"decoding.mode={mode}", decode_batch=3)(shard))
    got = {u: g.item_id.tolist() for u, g in resumed.groupby("user_id")}
    assert all(got[u] == want[u] for u in users["user_id"].to_pylist()[8:18])
    assert len({tuple(v) for v in want.values()}) > 1  # the users' draws differ


def prompt_lengths(world, users: pa.Table) -> np.ndarray:
    """Each user's prompt tokens after the shared prefix, from prompts rendered here (the whole prompt, counted
    from its attention mask, less the template's fixed prefix)."""
    tok = load_tokenizer(world / "target")
    cat = Catalog.from_table(pq.read_table(world / "data" / "items.parquet"), tok, on_duplicate="first")
    renderer = Renderer.compile(PRESETS["codes"].with_max_items(8), tok, catalog_probes(cat.item_tokens))
    full = renderer.render(users["history"], cat.item_tokens).attention_mask.sum(1).numpy()
    return full - len(renderer.prefix_ids)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("mode", ["beam", "atspeed-strict"])
def test_recorded_padding_equals_the_prompts(world, users, ordered, mode):
    """prompt_positions, prompt_padding, its fraction and kv_padding_tokens of a shard of 24 users decoded in slices
    of 5 equal what the prompts give: slices cut from the users sorted by prompt length (or in input order), each
    slice its users x its longest prompt, padding the rest; KV padding the largest slice's padding times the models
    that hold the prompts (the target, and the draft in speculative decoding). The tree's tokens are the same
    either way: target_tokens less the prompt positions."""
    lengths = prompt_lengths(world, users)
    cut = np.sort(lengths) if ordered else lengths
    slices = [cut[a : a + 5] for a in range(0, len(cut), 5)]
    positions = sum(len(s) * s.max() for s in slices)
    padding = positions - lengths.sum()
    models = 2 if mode == "atspeed-strict" else 1
    m = metric(actor(world, f"decoding.mode={mode}", decode_batch=5, order_by_length=ordered)(users))
    assert m["prompt_positions"] == positions and m["prompt_padding"] == padding
    assert m["prompt_padding_fraction"] == padding / positions
    assert m["kv_padding_tokens"] == models * max(len(s) * s.max() - s.sum() for s in slices)
    assert m["prompt_tokens"] == lengths.sum() + m["prefix_tokens_saved"]
    assert 0 < padding < positions  # these users' prompts differ in length


def test_ordering_leaves_less_padding(world, users):
    """The same shard in slices of 5: ordered by length, fewer prompt positions and the same tree tokens."""
    on, off = (metric(actor(world, decode_batch=5, order_by_length=o)(users)) for o in (True, False))
    assert on["prompt_positions"] < off["prompt_positions"] and on["prompt_padding"] < off["prompt_padding"]
    tree = lambda m: m["target_tokens"] - m["prompt_positions"]  # noqa: E731
    assert tree(on) == tree(off)


def test_a_read_task_orders_its_rows_by_history_length():
    """by_length: rows by history length, then position; a history that is not a list leaves the rows as they are."""
    t = pa.table(
        {"user_id": [1, 2, 3, 4, 5], "history": [[1, 2, 3], [4], None, [5, 6], [7]], "pos": [10, 11, 12, 13, 14]}
    )
    got = by_length(t)
    assert got["user_id"].to_pylist() == [3, 2, 5, 4, 1] and got["pos"].to_pylist() == [12, 11, 14, 13, 10]
    odd = pa.table({"user_id": [1, 2], "history": ["a", "bb"], "pos": [0, 1]})
    assert by_length(odd).equals(odd)
