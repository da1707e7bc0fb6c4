"""Per-user exclusions: every decoder is exact over the catalog minus each user's excluded items.

beam_search equals transformers' constrained beam search with a per-user trie that omits the user's excluded items;
strict speculative decoding equals beam_search; DISC's law is P_S over the user's remaining items; the closed nodes
are exactly the trie nodes with no item left."""

import math

import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog, Exclusions
from decoding.disc import constrained_sample, disc_sample
from decoding.models import tiny_model
from decoding.reference import catalog_logprob, cpu_trie, generate_beam_search
from decoding.speculative import speculative_beam_search
from tests.helpers import assert_same_ranking, left_padded_prompts, random_catalog

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]  # 8 users, all different prompt lengths: left padding
HF_PAD = -1e8  # transformers fills a user's missing beams with sequences scored about -1e9


@pytest.fixture(scope="module")
def catalog():
    return random_catalog(400, 4, 8, seed=11)


def under(cat: Catalog, item_id: int, levels: int) -> list[int]:
    """Every item sharing the first `levels` code tokens with item_id."""
    row = cat.tokens[cat.item_ids == item_id][0]
    return cat.item_ids[(cat.tokens[:, :levels] == row[:levels]).all(1)].tolist()


def exclusion_lists(cat: Catalog, top: torch.Tensor, k: int, seed: int = 0) -> list[list[int]]:
    """One list of excluded item ids per user, from the users' unrestricted top items top [8, >= 2]: none; the top-k
    themselves; every item under the top item's first-level prefix (a whole first-level subtree dead); the subtrees
    of the two best first-level prefixes plus 30 random items; all but 3 items (fewer than k left); 50 random items,
    repeats and ids the catalog does not hold; every item under the top item's second-level prefix; none."""
    g = torch.Generator().manual_seed(seed)
    ids = cat.item_ids
    rand = lambda n: ids[torch.randperm(len(ids), generator=g)[:n]].tolist()  # noqa: E731
    top = top.tolist()
    keep3 = torch.randperm(len(ids), generator=g)[:3]
    return [
        [],
        top[1][:k],
        under(cat, top[2][0], 1),
        under(cat, top[3][0], 1) + under(cat, top[3][1], 1) + rand(30),
        [i for j, i in enumerate(ids.tolist()) if j not in keep3.tolist()],
        rand(50) + rand(5) + [-7, 10**9],
        under(cat, top[6][0], 2),
        [],
    ]


def as_pairs(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-user lists -> (user [M], item [M])."""
    user = torch.tensor([u for u, items in enumerate(lists) for _ in items], dtype=torch.int64)
    return user, torch.tensor([i for items in lists for i in items], dtype=torch.int64)


def remaining(cat: Catalog, lists: list[list[int]]) -> list[int]:
    return [int((~torch.isin(cat.item_ids, torch.tensor(items, dtype=torch.int64))).sum()) for items in lists]


def hf_with_tries(model, ids, mask, cat: Catalog, k: int, lists):
    """transformers with one trie per user -> (item ids, scores [B, k]); its filler beams (a user with fewer than k
    items left) become padding (-1, -inf), as beam_search returns them."""
    items, _, scores, _ = generate_beam_search(model, ids, mask, cat, k, [cpu_trie(cat, e) for e in lists])
    pad = scores < HF_PAD
    return items.masked_fill(pad, -1), scores.masked_fill(pad, float("-inf"))


def assert_respects(rec, lists, left: list[int], k: int):
    """No user gets an excluded item; each gets min(k, items left) distinct items, then padding."""
    for u, items in enumerate(lists):
        got = rec.item_ids[u]
        n = min(k, left[u])
        assert not torch.isin(got, torch.tensor(items, dtype=torch.int64)).any(), u
        assert (got[:n] >= 0).all() and (got[n:] == -1).all() and len(set(got[:n].tolist())) == n, (u, got)
        assert torch.isinf(rec.scores[u, n:]).all() and (rec.token_ids[u, n:] == -1).all()


# ------------------------------------------------------------------ the structure


def test_closed_nodes_are_exactly_the_nodes_with_no_item_left(catalog):
    cat = catalog
    top = cat.item_ids[: 8 * 20].view(8, 20)
    lists = exclusion_lists(cat, top, 5)
    ex = Exclusions.from_items(cat, *as_pairs(lists), 8)
    nodes = torch.arange(cat.num_nodes)
    paths = torch.stack([cat.node_of(cat.tokens[:, :t]) for t in range(cat.code_len + 1)], 1)  # [N, L + 1]
    for u, items in enumerate(lists):
        left = ~torch.isin(cat.item_ids, torch.tensor(items, dtype=torch.int64))  # [N] rows still allowed
        expect = set(paths[left].flatten().tolist())  # brute force: every node on a remaining item's path
        mine = ex.select(torch.full((cat.num_nodes,), u))  # row i: user u, node i
        assert set(mine.open(nodes).nonzero().flatten().tolist()) == expect, u
        under = torch.bincount(paths[~left].flatten(), minlength=cat.num_nodes)  # excluded items under each node
        assert torch.equal(mine.excluded(nodes), under), u
        assert ex.select(torch.tensor([u])).per_user().item() == len(cat) - int(left.sum())
    assert not ex.open(torch.full((8, 3), -1)).any()  # no node is no candidate


def test_leaf_of_ignores_unknown_ids_and_dropped_duplicates():
    cat = Catalog.from_token_ids(
        torch.tensor([7, 3, 9, 5]), torch.tensor([[4, 6], [4, 7], [5, 6], [4, 6]]), 8, on_duplicate="first"
    )
    assert cat.duplicates == [(5, 7)]
    leaf = cat.leaf_of(torch.tensor([3, 5, 7, 9, 11, -1]))
    assert (leaf[[1, 4, 5]] == -1).all()
    assert cat.item_of_node(leaf[[0, 2, 3]]).tolist() == [3, 7, 9]
    ex = Exclusions.from_items(cat, torch.tensor([0, 0, 1, 1]), torch.tensor([5, 11, 7, 7]), 3)
    assert ex.per_user().tolist() == [0, 1, 0]  # a dropped duplicate is not its kept twin; repeats count once
    with pytest.raises(ValueError, match=r"users must lie in \[0, 3\)"):
        Exclusions.from_items(cat, torch.tensor([3]), torch.tensor([7]), 3)


# ------------------------------------------------------------------ beam search


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_beam_search_equals_transformers_with_per_user_tries(catalog, arch, k):
    model = tiny_model(arch, catalog.vocab_size, seed=k, attn_implementation="eager")
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=k)
    top = beam_search(model, ids, mask, catalog, max(k, 2)).item_ids  # what the exclusions must bite into
    lists = exclusion_lists(catalog, top, k, seed=k)
    left = remaining(catalog, lists)
    assert left[4] == 3 and min(left) < k or k <= 3  # one user with fewer than k items left
    rec = beam_search(model, ids, mask, catalog, k, exclude=Exclusions.from_items(catalog, *as_pairs(lists), 8))
    items, scores = hf_with_tries(model, ids, mask, catalog, k, lists)
    assert_same_ranking(rec.item_ids, rec.scores, items, scores)
    assert_respects(rec, lists, left, k)
    assert not torch.equal(rec.item_ids[1:7], top[1:7, :k])  # the exclusions changed the lists


def test_no_exclusions_and_slices_are_exact(catalog):
    model = tiny_model("qwen2", catalog.vocab_size, seed=3)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=5)
    plain = beam_search(model, ids, mask, catalog, 5)
    none = beam_search(model, ids, mask, catalog, 5, exclude=Exclusions.none(catalog, 8))
    assert torch.equal(none.item_ids, plain.item_ids) and torch.equal(none.scores, plain.scores)
    lists = exclusion_lists(catalog, plain.item_ids, 5)
    ex = Exclusions.from_items(catalog, *as_pairs(lists), 8)
    whole = beam_search(model, ids, mask, catalog, 5, exclude=ex)
    rows = torch.arange(3, 7)  # a slice of the batch, as the actor decodes slices
    n = int(mask[rows].sum(1).max())
    part = beam_search(model, ids[rows, -n:], mask[rows, -n:], catalog, 5, exclude=ex.select(rows))
    assert_same_ranking(part.item_ids, part.scores, whole.item_ids[rows], whole.scores[rows])
    with pytest.raises(ValueError, match="exclude holds 8 users"):
        beam_search(model, ids[:2], mask[:2], catalog, 5, exclude=ex)


def test_exclusions_move_to_another_device_whole(catalog):
    """Exclusions.to (the precision audit's float32 copies on the CPU of a GPU actor): every tensor moves (the meta
    device shows a field left behind), the rest is kept, and the copy excludes what the original does."""
    model = tiny_model("qwen2", catalog.vocab_size, seed=3)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=5)
    lists = exclusion_lists(catalog, beam_search(model, ids, mask, catalog, 5).item_ids, 5)
    ex = Exclusions.from_items(catalog, *as_pairs(lists), 8).select(torch.arange(2, 8))
    moved = ex.to("meta")
    assert {t.device.type for t in [moved.leaves, *moved.closed, moved.rows, moved.parent, moved.items]} == {"meta"}
    assert (moved.nodes, moved.level_start, moved.positions) == (ex.nodes, ex.level_start, ex.positions)
    copy, rows = ex.to("cpu"), torch.arange(2, 8)
    n = int(mask[rows].sum(1).max())
    a = beam_search(model, ids[rows, -n:], mask[rows, -n:], catalog, 5, exclude=ex)
    b = beam_search(model, ids[rows, -n:], mask[rows, -n:], catalog, 5, exclude=copy)
    assert torch.equal(a.item_ids, b.item_ids) and torch.equal(a.scores, b.scores)


# ------------------------------------------------------------------ speculative decoding


@pytest.mark.parametrize("draft_seed, k", [(99, 5), (5, 20)])
def test_strict_speculative_equals_beam_search_with_exclusions(catalog, draft_seed, k):
    target = tiny_model("llama", catalog.vocab_size, seed=1)
    draft = tiny_model("qwen2", catalog.vocab_size, seed=draft_seed, num_hidden_layers=1, hidden_size=32, head_dim=8)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=3)
    lists = exclusion_lists(catalog, beam_search(target, ids, mask, catalog, k).item_ids, k, seed=1)
    ex = Exclusions.from_items(catalog, *as_pairs(lists), 8)
    ref = beam_search(target, ids, mask, catalog, k, exclude=ex)
    assert_respects(ref, lists, remaining(catalog, lists), k)
    for n, gamma in ((k, 1), (2 * k, 2), (40, catalog.code_len)):
        rec = speculative_beam_search(
            target, draft, ids, mask, catalog, k, draft_beams=max(n, k), gamma=gamma, exclude=ex
        )
        assert_same_ranking(rec.item_ids, rec.scores, ref.item_ids, ref.scores)
        assert len(set(rec.stats["rounds"].tolist())) > 1 or gamma == catalog.code_len  # users left at other rounds


def test_sampling_decoders_never_return_an_excluded_item(catalog):
    target = tiny_model("llama", catalog.vocab_size, seed=1)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=3)
    lists = exclusion_lists(catalog, beam_search(target, ids, mask, catalog, 5).item_ids, 5, seed=2)
    ex, left = Exclusions.from_items(catalog, *as_pairs(lists), 8), remaining(catalog, lists)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert_respects(
        beam_search(target, ids, mask, catalog, 5, do_sample=True, generator=g(), exclude=ex), lists, left, 5
    )
    assert_respects(
        speculative_beam_search(
            target, target, ids, mask, catalog, 5, verification="relaxed", generator=g(), exclude=ex
        ),
        lists,
        left,
        5,
    )
    for sampler in (constrained_sample, disc_sample):
        rec = sampler(target, ids, mask, catalog, 5, generator=g(), exclude=ex)
        assert_respects(rec, lists, left, 5)
        rec = sampler(target, ids, mask, catalog, 5, top_m=6, generator=g(), exclude=ex)  # PPV candidates
        assert not any(
            torch.isin(rec.item_ids[u], torch.tensor(e, dtype=torch.int64)).any() for u, e in enumerate(lists)
        )


# ------------------------------------------------------------------ DISC's law


def chi2_z(counts: torch.Tensor, law: torch.Tensor, draws: int, pool: float = 10.0) -> tuple[float, int]:
    """Pearson's chi-square of item counts [N] against a law [N] (items expected fewer than `pool` times pooled into
    one bin), as a standard normal deviate by the Wilson-Hilferty transform -> (z, degrees of freedom)."""
    expected = draws * law
    small = expected < pool
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2, df = float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1
    return wilson_hilferty(chi2, df), df


def wilson_hilferty(chi2: float, df: int) -> float:
    """A chi-square value with df degrees of freedom -> an approximately standard normal deviate."""
    return ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def test_disc_law_is_p_s_over_the_remaining_items():
    """One user on an enumerable catalog (100 of the 125 semantic IDs over a 5-token vocabulary, so the model's mass
    is mostly on items), excluding every item under its most likely first code and its 3 most likely items. DISC's
    exact law with R rounds is (1 - p_b^R) P_S + p_b^R (importance resampling), p_b the mass outside the remaining
    items: R is chosen so that p_b^R < 1e-4, below the test's resolution. DRAWS independent draws (k = 1): Pearson's
    chi-square against P_S over the remaining items must stay below z = 4.5 (Wilson-Hilferty; a correct sampler fails
    with probability about 3e-6). Power: against the law of plain constrained sampling over the same items (the
    trie-renormalised Q, computed exactly), the chi-square's noncentrality lambda = DRAWS * sum (Q - P_S)^2 / P_S is
    computed here and must put the rejection probability above 0.99; constrained_sample's own draws must then fail
    the same test, and match Q."""
    from tests.test_disc import T, constrained_law, next_token_logprobs

    draws, codes = 3000, 5
    g = torch.Generator().manual_seed(0)
    flat = torch.randperm(codes**3, generator=g)[:100]
    cat = Catalog.from_token_ids(100 + torch.arange(100), torch.stack([flat // 25, flat // 5 % 5, flat % 5], 1), codes)
    model = tiny_model("llama", codes, seed=0)
    ids = torch.tensor([[1, 4, 0, 2, 3]])
    mask = torch.ones_like(ids)
    p = catalog_logprob(model, ids, mask, cat, temperature=T, chunk=128).exp()  # [N] tempered p of every item
    rows = set((cat.tokens[:, 0] == cat.tokens[p.argmax(), 0]).nonzero().flatten().tolist()) | set(
        p.argsort(descending=True)[:3].tolist()
    )
    left = torch.ones(len(cat), dtype=torch.bool)
    left[sorted(rows)] = False
    p_s = torch.where(left, p, 0) / p[left].sum()  # [N] P_S over the remaining items
    q = constrained_law(next_token_logprobs(model, ids, cat), cat, rows)  # [N] constrained sampling's law
    p_b = 1 - float(p[left].sum())
    rounds = math.ceil(math.log(1e-4) / math.log(p_b))
    assert 0.2 < p_b < 0.7 and rounds <= 16

    df = int((draws * p_s[left] >= 10).sum())  # the bins, about (pooling may merge a few)
    lam = draws * float(((q - p_s)[left] ** 2 / p_s[left]).sum())
    mean, sd = df + lam, math.sqrt(2 * (df + 2 * lam))  # the noncentral chi-square under Q
    assert wilson_hilferty(mean - 2.33 * sd, df) > 4.5, (lam, df)  # P(reject Q) > 0.99

    user = torch.zeros(len(rows), dtype=torch.int64)
    ex = Exclusions.from_items(cat, user, cat.item_ids[sorted(rows)], 1).select(torch.zeros(draws, dtype=torch.int64))
    batch = ids.repeat(draws, 1), mask.repeat(draws, 1)
    rec = disc_sample(
        model, *batch, cat, 1, rounds=rounds, temperature=T, generator=torch.Generator().manual_seed(1), exclude=ex
    )
    counts = (rec.item_ids[:, 0, None] == cat.item_ids).sum(0).double()  # [N]
    assert counts.sum() == draws and counts[~left].sum() == 0
    z, _ = chi2_z(counts, p_s, draws)
    assert z < 4.5, z
    base = constrained_sample(
        model, *batch, cat, 1, temperature=T, generator=torch.Generator().manual_seed(2), exclude=ex
    )
    counts = (base.item_ids[:, 0, None] == cat.item_ids).sum(0).double()
    assert chi2_z(counts, p_s, draws)[0] > 4.5 and chi2_z(counts, q, draws)[0] < 4.5


# ------------------------------------------------------------------ input rows, the nightly job, evaluation


def test_bad_exclusion_rows_are_rejected_with_a_reason():
    import pyarrow as pa

    from decoding.catalog import ItemTokens
    from operators.validate import validate

    items = ItemTokens.from_arrays([1, 2, 3], [[4, 5], [4, 6], [5, 5]])
    batch = pa.table(
        {
            "user_id": [1, 2, 3, 4, 5, 6, 7],
            "history": [[1], [2], [3], [1, 2], [3], [1], [2]],
            "skip": pa.array([[1], None, [1.5], [1, None], [], [2.0, 99], [3]]),
        }
    )
    good, rejects = validate(batch, items, 20, exclude_column="skip")
    assert good.column_names == ["user_id", "history", "skip"] and good["user_id"].to_pylist() == [1, 2, 5, 6, 7]
    assert good["skip"].to_pylist() == [[1], None, [], [2, 99], [3]]  # unknown ids stay: the actor ignores them
    assert rejects.to_pylist() == [
        {"user_id": 3, "reason": "bad_exclude_items", "detail": "skip must be a list of integer item ids, got '[1.5]'"},
        {
            "user_id": 4,
            "reason": "bad_exclude_items",
            "detail": "skip must be a list of integer item ids, got '[1.0, None]'",
        },
    ]
    nulls = pa.table(
        {"user_id": [1, 2], "history": [[1], [2]], "skip": pa.array([[1, None], [2]], pa.list_(pa.int64()))}
    )
    assert validate(nulls, items, 20, "skip")[1].to_pylist() == [
        {"user_id": 1, "reason": "bad_exclude_items", "detail": "skip holds a null item id"}
    ]
    plain = validate(batch.drop_columns(["skip"]), items, 20, "skip")[0]  # no column: nothing to check or carry
    assert plain.column_names == ["user_id", "history"] and plain.num_rows == 7


@pytest.fixture(scope="module")
def ray_world(tmp_path_factory):
    import ray

    from tests.test_nightly import make_world

    world = make_world(tmp_path_factory.mktemp("exclusions"), n_users=48)
    ray.init(num_cpus=2, include_dashboard=False)
    yield world
    ray.shutdown()


def test_nightly_with_exclude_history_and_an_exclusion_column(ray_world, tmp_path):
    """decoding.exclude=history with a prompt window of 3 items (the history holds up to 8: the whole history is
    excluded, not the window) and an exclude_items column (strings: numeric ones cast, others are bad rows): no user
    gets an item of its history or its list, each good user gets exactly beam_search's top-k over its remaining
    items, bad rows are rejected with bad_exclude_items, every input row is a recommended user or a reject, and the
    manifest, metrics and evaluation state the exclusions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.evaluate import evaluate
    from pipeline.nightly import run_nightly
    from tests.test_nightly import config, direct_beam_search, read_run

    world = ray_world
    users = pq.read_table(world / "data" / "test.parquet")
    catalog_ids = pq.read_table(world / "data" / "items.parquet")["item_id"].to_numpy()
    n = users.num_rows
    lists = [[str(i) for i in catalog_ids[(7 * u) % 140 : (7 * u) % 140 + u % 9]] for u in range(n)]  # 0-8 items
    lists[1] += ["123456789"]  # an id the catalog does not hold: ignored, counted
    lists[2], lists[3], lists[4] = ["12", "abc"], None, []  # a bad row, no list, an empty list
    pq.write_table(
        users.append_column("exclude_items", pa.array(lists, pa.list_(pa.string()))), tmp_path / "in.parquet"
    )
    cfg = config(
        world,
        tmp_path / "out",
        f"input={tmp_path / 'in.parquet'}",
        "decoding.exclude=history",
        "decoding.history_len=3",
    )
    manifest = run_nightly(cfg)
    _, t = read_run(cfg)
    rejects = dict(zip(t["rejects"]["user_id"].to_pylist(), t["rejects"]["reason"].to_pylist()))
    bad = users["user_id"][2].as_py()
    assert rejects == {bad: "bad_exclude_items"}
    recs = t["recommendations"].to_pandas()
    assert sorted(set(recs.user_id)) == sorted(set(users["user_id"].to_pylist()) - {bad})  # nothing lost
    assert (recs.groupby("user_id").size() == 5).all()

    good = [u for u in range(n) if u != 2]
    excluded = [set(users["history"][u].as_py()) | {int(i) for i in lists[u] or []} for u in good]
    for u, items in zip(good, excluded):
        assert not set(recs[recs.user_id == users["user_id"][u].as_py()].item_id) & items, u
    from decoding.models import load_model, load_tokenizer

    cat = Catalog.from_table(
        pq.read_table(world / "data" / "items.parquet"), load_tokenizer(world / "target"), on_duplicate="first"
    )
    ex = Exclusions.from_items(
        cat,
        torch.tensor([r for r, items in enumerate(excluded) for _ in items]),
        torch.tensor([i for items in excluded for i in items]),
        len(good),
    )
    _, p = direct_beam_search(world, [h[-3:] for h in users.take(good)["history"].to_pylist()])  # the 3-item prompts
    ref = beam_search(load_model(world / "target"), p.input_ids, p.attention_mask, cat, 5, exclude=ex)
    want = dict(zip(users.take(good)["user_id"].to_pylist(), ref.item_ids.tolist()))
    got = recs.sort_values(["user_id", "rank"]).groupby("user_id").item_id.apply(list)
    assert all(want[u] == items for u, items in got.items())

    per_user = ex.per_user()
    assert manifest["exclusions"] == {
        "mode": "history",
        "column": "exclude_items",
        "users": len(good),
        "excluded_per_user_mean": pytest.approx(per_user.float().mean().item()),
        "excluded_per_user_max": int(per_user.max()),
        "unknown_ids_ignored": 1,
    }
    assert t["metrics"]["excluded_items"].to_numpy().sum() == per_user.sum().item()
    from pipeline.report import summarize, summary_rows
    from pipeline.runs import load_run

    rows = dict((r[0], r[1]) for r in summary_rows([summarize(load_run(str(tmp_path / "out"), cfg.storage), 2.5)]))
    assert rows["exclusions (decoding.exclude; items excluded per user)"] == (
        f"history, column `exclude_items`: mean {per_user.float().mean().item():,.1f}, max {int(per_user.max())}, "
        "1 unknown ids ignored"
    )
    for targets in ("all", "unseen"):
        ev = evaluate(f"{tmp_path / 'out'}", cfg.storage, targets=targets, out=str(tmp_path / f"ev-{targets}"))
        assert ev["exclusions"] == manifest["exclusions"] and ev["targets"]["mode"] == targets
        assert "decoding.exclude: history" in (tmp_path / f"ev-{targets}" / "evaluation.md").read_text()


def test_an_input_folder_reads_the_exclusion_column_of_every_file(ray_world, tmp_path):
    """A folder whose first file lacks the exclusion column and whose second holds it: the second file's users never
    get an item they excluded (each excludes the 5 items beam search gives it), the first file's get beam search's
    lists, and the manifest records the column. The same column with two types in two files is refused, naming both
    files and both types (exit 2), before any work."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.nightly import exit_code, run_nightly
    from pipeline.plan import plan_run
    from tests.test_nightly import config, direct_beam_search, read_run

    world = ray_world
    users = pq.read_table(world / "data" / "test.parquet").select(["user_id", "history"])
    ref, _ = direct_beam_search(world, users["history"].to_pylist())
    half = users.num_rows // 2
    excluded = pa.array([None] * half + ref.item_ids[half:].tolist(), pa.list_(pa.int64()))
    (tmp_path / "in").mkdir()
    pq.write_table(users.slice(0, half), tmp_path / "in" / "part-0.parquet")
    pq.write_table(users.append_column("exclude_items", excluded).slice(half), tmp_path / "in" / "part-1.parquet")
    cfg = config(world, tmp_path / "out", f"input={tmp_path / 'in'}")
    manifest = run_nightly(cfg)
    assert manifest["exclusions"]["column"] == "exclude_items" and manifest["exclusions"]["users"] == users.num_rows
    recs = read_run(cfg)[1]["recommendations"].to_pandas().sort_values(["user_id", "rank"])
    got = recs.groupby("user_id").item_id.apply(list).to_dict()
    ids = users["user_id"].to_pylist()
    assert all(got[u] == ref.item_ids[i].tolist() for i, u in enumerate(ids[:half]))
    assert all(
        len(got[u]) == 5 and not set(got[u]) & set(ref.item_ids[i].tolist()) for i, u in enumerate(ids) if i >= half
    )

    texts = pa.array([None] * users.num_rows, pa.string())
    pq.write_table(users.append_column("exclude_items", texts).slice(half), tmp_path / "in" / "part-1.parquet")
    pq.write_table(users.append_column("exclude_items", excluded).slice(0, half), tmp_path / "in" / "part-0.parquet")
    with pytest.raises(ValueError) as e:
        plan_run(cfg)
    parts = [tmp_path / "in" / f"part-{i}.parquet" for i in (0, 1)]
    assert exit_code(e.value) == 2 and str(e.value) == (
        f"input {tmp_path / 'in'}: column 'exclude_items' is list<element: int64> in {parts[0]} and string in "
        f"{parts[1]}; its files must hold one type (cast it where they are written)"
    )
