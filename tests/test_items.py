"""The items a run serves from (pipeline/items.py): the item index renders every history, the recommendable set less
the block list is all a list may hold, in every mode and engine, exactly as a catalog of those items alone would be;
lists shorter than k where fewer items are left; dated paths; a resume refused when the sets changed."""

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog, Exclusions
from decoding.disc import disc_sample
from decoding.draws import UserDraws, user_seeds
from decoding.models import load_model, load_tokenizer, tiny_model
from decoding.speculative import speculative_beam_search
from decoding.templates import PRESETS
from operators.prompts import Renderer, catalog_probes
from tests.helpers import assert_same_ranking, left_padded_prompts, random_catalog

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]  # 8 users, every prompt length different: left padding
INDEX_KEYS = ("item_ids", "tokens", "node_ptr", "edge_tok", "edge_key", "leaf_count")


@pytest.fixture(scope="module")
def catalog():
    return random_catalog(400, 4, 8, seed=11)


def subset(cat: Catalog, keep: torch.Tensor) -> tuple[Catalog, Catalog]:
    """The catalog's items with a recommendable mask keep [N] -> (its index over them, a catalog of them alone)."""
    masked = Catalog.from_token_ids(cat.item_ids, cat.tokens, cat.vocab_size, recommendable=keep.numpy())
    alone = Catalog.from_token_ids(cat.item_ids[keep], cat.tokens[keep], cat.vocab_size)
    return masked, alone


def test_the_index_over_the_recommendable_items_is_the_catalog_of_those_items_alone(catalog):
    keep = torch.rand(len(catalog), generator=torch.Generator().manual_seed(0)) < 0.7
    masked, alone = subset(catalog, keep)
    for key in INDEX_KEYS:
        assert torch.equal(getattr(masked, key), getattr(alone, key)), key
    assert masked.level_start == alone.level_start and masked.max_children == alone.max_children
    assert masked.item_tokens.lookup(catalog.item_ids.numpy())[1].all()  # every item still renders
    assert not alone.item_tokens.lookup(catalog.item_ids[~keep].numpy())[1].any()
    tokens, known = masked.item_tokens.lookup(catalog.item_ids.numpy())
    assert known.all() and tokens.dtype == np.int64 and np.array_equal(tokens, catalog.tokens.numpy())
    with pytest.raises(ValueError, match="none of the catalog's 400 items is recommendable"):
        Catalog.from_token_ids(catalog.item_ids, catalog.tokens, catalog.vocab_size, recommendable=np.zeros(400, bool))
    with pytest.raises(ValueError, match="recommendable has 3 entries but the catalog 400 items"):
        Catalog.from_token_ids(catalog.item_ids, catalog.tokens, catalog.vocab_size, recommendable=np.ones(3, bool))


def test_a_semantic_id_goes_to_its_first_recommendable_item():
    """Items 7 and 5 share a semantic ID; 7 comes first but is not recommendable: 5 holds it, nothing is dropped."""
    ids, tokens = torch.tensor([7, 3, 9, 5]), torch.tensor([[4, 6], [4, 7], [5, 6], [4, 6]])
    cat = Catalog.from_token_ids(ids, tokens, 8, on_duplicate="first", recommendable=np.array([0, 1, 1, 1], bool))
    assert cat.duplicates == [] and cat.lookup(torch.tensor([[4, 6]])).tolist() == [5]
    both = Catalog.from_token_ids(ids, tokens, 8, on_duplicate="first")
    assert both.duplicates == [(5, 7)]
    for keep in ([1, 0, 1, 1], [0, 1, 1, 0]):  # "error" is the catalog's policy, whichever items are listed tonight
        with pytest.raises(ValueError, match=r"input rows \[3\] repeat rows \[0\]"):
            Catalog.from_token_ids(ids, tokens, 8, recommendable=np.array(keep, bool))


@pytest.mark.numerics
def test_no_mode_recommends_a_blocked_item(catalog):
    """Block every user's unrestricted top-3 items and a random tenth: beam search and strict speculation return
    exactly beam search over a catalog of the remaining items alone; relaxed speculation and DISC draw only remaining
    items, each distinct, the same draws as over that catalog. (The compiled engine over such an index:
    tests/test_compiled.py, in the graphs it compiled already.)"""
    model = tiny_model("qwen2", catalog.vocab_size, seed=3)
    draft = tiny_model("qwen2", catalog.vocab_size, seed=4, num_hidden_layers=1)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=2)
    top = beam_search(model, ids, mask, catalog, 3).item_ids
    g = torch.Generator().manual_seed(1)
    blocked = torch.cat([top.flatten(), catalog.item_ids[torch.rand(len(catalog), generator=g) < 0.1]])
    keep = ~torch.isin(catalog.item_ids, blocked)
    masked, alone = subset(catalog, keep)
    ref = beam_search(model, ids, mask, alone, 5)
    seeds = user_seeds(0, list(range(8)), ids.device)
    for name, run in {
        "beam": lambda c: beam_search(model, ids, mask, c, 5),
        "atspeed-strict": lambda c: speculative_beam_search(model, draft, ids, mask, c, 5, gamma=2),
        "atspeed-relaxed": lambda c: speculative_beam_search(
            model, draft, ids, mask, c, 5, verification="relaxed", generator=UserDraws(seeds)
        ),
        "disc": lambda c: disc_sample(model, ids, mask, c, 5, rounds=2, generator=UserDraws(seeds)),
    }.items():
        got, direct = run(masked), run(alone)
        assert not torch.isin(got.item_ids, blocked).any(), name
        assert ((got.item_ids >= 0).sum(1) == 5).all(), name
        assert all(len(set(row.tolist())) == 5 for row in got.item_ids), name
        assert torch.equal(got.item_ids, direct.item_ids), name  # an index over them is a catalog of them alone
        if name in ("beam", "atspeed-strict"):
            assert_same_ranking(got.item_ids, got.scores, ref.item_ids, ref.scores)


@pytest.mark.numerics
@pytest.mark.parametrize("n", [3, 6])
def test_every_mode_lists_what_is_left_once_when_fewer_than_k_items_are(n):
    """An index of n items (3: fewer than k = 5; 6: fewer than k under some prefixes): every mode gives each user
    min(n, k) distinct items, then padding; none repeats an item to fill its list."""
    base = random_catalog(60, 3, 4, seed=5)
    pick = torch.randperm(60, generator=torch.Generator().manual_seed(100 * n))[:n]
    cat = Catalog.from_token_ids(base.item_ids[pick], base.tokens[pick], base.vocab_size)
    model = tiny_model("qwen2", base.vocab_size, seed=3)
    draft = tiny_model("qwen2", base.vocab_size, seed=4, num_hidden_layers=1)
    ids, mask = left_padded_prompts(8, [3, 7, 5, 9, 4, 6, 8, 2], base.vocab_size, seed=2)
    seeds = user_seeds(0, list(range(8)), ids.device)
    for name, rec in {
        "beam": beam_search(model, ids, mask, cat, 5),
        "atspeed-strict": speculative_beam_search(model, draft, ids, mask, cat, 5),
        "atspeed-relaxed": speculative_beam_search(
            model, draft, ids, mask, cat, 5, verification="relaxed", generator=UserDraws(seeds)
        ),
        "disc": disc_sample(model, ids, mask, cat, 5, rounds=2, generator=UserDraws(seeds)),
    }.items():
        for row in rec.item_ids.tolist():
            got = [i for i in row if i >= 0]
            assert len(got) == len(set(got)) == min(n, 5) and row[len(got) :] == [-1] * (5 - len(got)), (name, row)


def test_the_items_are_read_with_their_sets_and_counts(tmp_path):
    """read_items: the index whole, the recommendable set from a file or a boolean column, blocks from a file and the
    config, ids the index lacks counted; the record partitions the index; bad files are named."""
    from pipeline.items import Sources, ids_sha256, read_items
    from pipeline.storage import Storage

    st = Storage()
    ids = np.arange(100, 110)
    codes = [[i % 3, i % 5] for i in range(10)]
    listed = [True] * 7 + [False, None, False]  # 100..106 recommendable, 107..109 not (null: not)
    pq.write_table(pa.table({"item_id": ids, "semantic_id": codes, "in_stock": listed}), tmp_path / "items.parquet")
    pq.write_table(pa.table({"item_id": [100, 101, 102, 103, 104, 105, 106, 999]}), tmp_path / "rec.parquet")
    pq.write_table(pa.table({"item_id": pa.array([101, 107, 555], pa.int32())}), tmp_path / "blocked.parquet")
    index = str(tmp_path / "items.parquet")
    by_file = read_items(
        Sources(index, str(tmp_path / "rec.parquet"), None, str(tmp_path / "blocked.parquet"), (102, 101, 777)), st
    )
    by_column = read_items(Sources(index, None, "in_stock", str(tmp_path / "blocked.parquet"), (102, 101, 777)), st)
    served = ~np.isin(ids, [101, 102]) & (ids < 107)
    for items in (by_file, by_column):
        assert items.table.column_names == ["item_id", "semantic_id"] and items.table.num_rows == 10
        assert np.array_equal(items.served, served)
        info = items.info
        assert (info["items"], info["recommendable"], info["blocked"], info["not_recommendable"]) == (10, 5, 2, 3)
        assert info["recommendable_set"]["items"] == 7 and info["recommendable_set"]["sha256"] == ids_sha256(ids[:7])
        assert info["block_list"] == {
            "source": f"{tmp_path / 'blocked.parquet'} + blocked_items (3)",
            "ids": 5,
            "sha256": ids_sha256(np.array([101, 102, 107, 555, 777])),
            "unknown_ids": 2,
        }
    assert by_file.info["recommendable_set"]["unknown_ids"] == 1 and by_file.info["sha256"] == by_column.info["sha256"]
    assert read_items(Sources(index), st).served is None  # neither set nor blocks: every item
    pq.write_table(pa.table({"id": [1]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"recommendable .*bad.parquet: missing column\(s\) \['item_id'\]"):
        read_items(Sources(index, str(tmp_path / "bad.parquet")), st)
    with pytest.raises(FileNotFoundError, match="blocked .*nowhere.parquet not found"):
        read_items(Sources(index, blocked=str(tmp_path / "nowhere.parquet")), st)
    with pytest.raises(ValueError, match="recommendable_column 'item_id' must be boolean"):
        read_items(Sources(index, recommendable_column="item_id"), st)
    pq.write_table(pa.table({"item_id": [1.5]}), tmp_path / "floats.parquet")
    with pytest.raises(ValueError, match="column 'item_id' must hold integer item ids, got double"):
        read_items(Sources(index, blocked=str(tmp_path / "floats.parquet")), st)


def test_a_catalog_and_item_sets_written_as_folders(tmp_path):
    """A catalog, a recommendable set and a block list each written as a folder of parquet files, as Spark writes
    them (part files and a _SUCCESS; item ids int32 in one file, int64 in the other): each reads as one table, and
    the catalog is identified by its files' contents: `--check` passes, an actor finds what the driver recorded, and
    a rewritten file is a changed catalog, which an actor and a resume refuse."""
    from pipeline.config import load_config
    from pipeline.items import ItemsRef, Sources
    from pipeline.nightly import check_run
    from pipeline.plan import plan_run
    from tests.test_nightly import make_world

    world = make_world(tmp_path / "world", n_users=8)
    items = pq.read_table(world / "data" / "items.parquet")
    ids = items["item_id"].to_numpy()
    for name, parts in {
        "catalog": [items.slice(0, 50), items.slice(50)],
        "recommendable": [pa.table({"item_id": ids[:60].astype(np.int32)}), pa.table({"item_id": ids[60:100]})],
        "blocked": [pa.table({"item_id": ids[:2]}), pa.table({"item_id": pa.array([ids[-1]], pa.int32())})],
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "_SUCCESS").write_text("")
        for i, part in enumerate(parts):
            pq.write_table(part, tmp_path / name / f"part-{i:05d}.parquet")
    cfg = load_config(
        None,
        [
            f"input={world / 'data' / 'test.parquet'}",
            f"output={tmp_path / 'out'}",
            f"models.target={world / 'target'}",
            *(f"{name}={tmp_path / name}" for name in ("catalog", "recommendable", "blocked")),
        ],
    )
    assert check_run(cfg)["items"] == {"items": 150, "recommendable": 98, "blocked": 2, "not_recommendable": 50}
    plan = plan_run(cfg)
    assert plan.identity["catalog"].startswith("folder:")
    ref = ItemsRef(Sources.of(cfg), plan.identity["catalog"], plan.items.identity)
    assert ref.read(cfg.storage).table.num_rows == 150
    pq.write_table(items.slice(50).take([1, 0, *range(2, 100)]), tmp_path / "catalog" / "part-00001.parquet")
    with pytest.raises(ValueError, match=f"catalog {tmp_path / 'catalog'} changed during the run"):
        ref.read(cfg.storage)
    state = {"identity": plan.identity, "config": cfg.to_dict()}
    assert plan_run(cfg).changes(state) == [f"the catalog {tmp_path / 'catalog'}"]


# ---------------------------------------------------------------- the nightly


@pytest.fixture(scope="module")
def ray_world(tmp_path_factory):
    import ray

    from tests.test_nightly import make_world

    world = make_world(tmp_path_factory.mktemp("items"), n_users=48)
    ray.init(num_cpus=2, include_dashboard=False)
    yield world
    ray.shutdown()


def night(world: Path, root: Path, date: str) -> dict:
    """The night's inputs under dated paths: the item index (the world's items, 6 new ones, and 40 more that share
    a semantic ID with one of the world's, with a `popularity` column), a recommendable set that delists a third of
    the items the histories use (and lists an id the index lacks), a block list (a file with an unknown id, and ids
    in the config, one of them the most popular of a shared semantic ID), an exclusion column that leaves user 0 two
    items and user 1 none."""
    items = pq.read_table(world / "data" / "items.parquet")
    users = pq.read_table(world / "data" / "test.parquet")
    taken = np.unique(np.concatenate([np.asarray(h[-8:]) for h in users["history"].to_pylist()]))
    rng = np.random.default_rng(3)
    delisted = rng.choice(taken, len(taken) // 3, replace=False)
    used = {tuple(s) for s in items["semantic_id"].to_pylist()}
    fresh = [s for s in ([a, b, c] for a in range(6) for b in range(6) for c in range(6)) if tuple(s) not in used][:6]
    new_ids = np.arange(9_000_000, 9_000_006)
    twins = rng.choice(items.num_rows, 40, replace=False)  # the world's items whose semantic ID a new item shares
    sids = pa.array(
        fresh + [items["semantic_id"][int(i)].as_py() for i in twins], items.schema.field("semantic_id").type
    )
    index = pa.concat_tables(
        [
            items.select(["item_id", "semantic_id"]),
            pa.table({"item_id": np.append(new_ids, 8_000_000 + np.arange(40)), "semantic_id": sids}),
        ]
    )
    index = index.append_column("popularity", pa.array(rng.integers(0, 3, index.num_rows)))  # ties: lowest id first
    ids = index["item_id"].to_numpy()
    recommendable = np.append(np.setdiff1d(ids, delisted), 123456789)  # an id the index lacks
    blocked_file = np.array([*rng.choice(np.setdiff1d(ids, delisted), 4, replace=False), 55555555])
    top_twin = 8_000_000 + int(np.argmax(index["popularity"].to_numpy()[-40:]))  # the best item of its semantic ID
    blocked_config = [int(new_ids[0]), int(rng.choice(np.setdiff1d(ids, delisted))), top_twin]
    served = np.setdiff1d(np.setdiff1d(ids, delisted), np.concatenate([blocked_file, blocked_config]))
    excluded = [None] * users.num_rows
    excluded[0] = np.setdiff1d(served, served[:2]).tolist()  # two items left
    excluded[1] = served.tolist()  # none left
    day = root / date
    day.mkdir(parents=True)
    pq.write_table(users.append_column("exclude_items", pa.array(excluded, pa.list_(pa.int64()))), day / "h.parquet")
    pq.write_table(index, day / "items.parquet")
    pq.write_table(pa.table({"item_id": recommendable}), day / "recommendable.parquet")
    pq.write_table(pa.table({"item_id": blocked_file}), root / f"blocked-{date}.parquet")
    return {
        "users": users,
        "index": index,
        "delisted": delisted,
        "served": served,
        "blocked_config": blocked_config,
        "excluded": excluded,
        "twins": dict(zip(8_000_000 + np.arange(40), items["item_id"].to_numpy()[twins])),  # new item -> its twin
    }


def expected_lists(world: Path, n: dict, k: int = 5) -> dict:
    """Beam search over a catalog of the served items alone (`by:popularity`), prompts rendered from the whole index
    (delisted items included), user 0's exclusions applied -> {user_id: item ids}."""
    tok = load_tokenizer(world / "target")
    full = Catalog.from_table(n["index"], tok, "first")
    keep = np.isin(n["index"]["item_id"].to_numpy(), n["served"])
    alone = Catalog.from_table(n["index"].filter(pa.array(keep)), tok, "by:popularity")
    users = n["users"]
    p = Renderer.compile(PRESETS["codes"].with_max_items(8), tok, catalog_probes(full.item_tokens)).render(
        users["history"], full.item_tokens
    )
    lists = n["excluded"][:1]
    ex = Exclusions.from_items(alone, torch.zeros(len(lists[0]), dtype=torch.int64), torch.tensor(lists[0]), 1)
    model = load_model(world / "target")
    rec = beam_search(model, p.input_ids[2:], p.attention_mask[2:], alone, k)
    first = beam_search(model, p.input_ids[:1], p.attention_mask[:1], alone, k, exclude=ex)
    ids = users["user_id"].to_pylist()
    want = {ids[0]: [i for i in first.item_ids[0].tolist() if i >= 0]}
    want.update({u: row for u, row in zip(ids[2:], rec.item_ids.tolist())})
    return want


def test_a_night_with_delisted_blocked_and_added_items(ray_world, tmp_path):
    """Histories that name delisted items are decoded (no unknown_item), every list is drawn from the recommendable
    set less the blocks and equals beam search over a catalog of those items alone; a user with two items left gets
    two, one with none is rejected as no_items; {run_date} fills every path; the manifest and `show` record the
    index, the sets and their counts; a resume is refused once the recommendable set or the block list changed."""
    from pipeline.config import load_config
    from pipeline.nightly import run_nightly
    from pipeline.output import describe, open_run
    from pipeline.plan import plan_run
    from pipeline.report import catalog_text
    from tests.test_nightly import killed_run

    world, date = ray_world, "2026-11-26"
    n = night(world, tmp_path, date)
    cfg = load_config(
        None,
        [
            f"input={tmp_path / '{run_date}' / 'h.parquet'}",
            f"catalog={tmp_path / '{run_date}' / 'items.parquet'}",
            f"recommendable={tmp_path / '{run_date}' / 'recommendable.parquet'}",
            f"blocked={tmp_path / 'blocked-{run_date}.parquet'}",
            f"blocked_items={json.dumps(n['blocked_config'])}",
            f"output={tmp_path / 'out' / '{run_date}'}",
            f"models.target={world / 'target'}",
            "decoding.k=5",
            "compute.batch_size=16",
            f"run_date={date}",
            "duplicate_items=by:popularity",
        ],
    )
    assert cfg.input == str(tmp_path / date / "h.parquet") and cfg.output == str(tmp_path / "out" / date)
    manifest = run_nightly(cfg)
    run = open_run(cfg.output, cfg.storage)
    recs, rejects = run.table("recommendations").to_pandas(), run.table("rejects").to_pydict()
    users = n["users"]["user_id"].to_pylist()
    assert rejects["user_id"] == [users[1]] and rejects["reason"] == ["no_items"]  # no unknown_item at all
    assert set(recs.item_id) <= set(n["served"].tolist()) and not set(recs.item_id) & set(n["delisted"].tolist())
    got = recs.sort_values(["user_id", "rank"]).groupby("user_id").item_id.apply(list).to_dict()
    assert got == expected_lists(world, n)
    assert len(got[users[0]]) == 2 and manifest["counts"]["users_short"] == 1
    assert manifest["counts"]["users_ok"] == len(users) - 1 and manifest["counts"]["users_rejected"] == 1
    info = manifest["catalog"]
    served, items = len(n["served"]), n["index"].num_rows
    listed = np.isin(n["index"]["item_id"].to_numpy(), n["served"])
    per_id = np.array(
        list(Counter(map(tuple, n["index"].filter(pa.array(listed))["semantic_id"].to_pylist())).values())
    )
    assert (info["items"], info["recommendable"], info["indexed"]) == (items, served, len(per_id))
    shared = {"shared_semantic_ids": int((per_id > 1).sum()), "items_sharing": int(per_id[per_id > 1].sum())}
    assert info["duplicates"] == {"policy": "by:popularity", **shared, "dropped": 0, "items": []}
    ahead = {new for new, was in n["twins"].items() if was in set(n["served"].tolist())}  # ahead of a listed twin
    assert shared["shared_semantic_ids"] > 10 and set(recs.item_id) & ahead  # where `first` would list the old one
    said = catalog_text({"mode": "beam", "run_id": manifest["run_id"], "catalog": info})  # the report's words
    assert f"`by:popularity`: {shared['shared_semantic_ids']} semantic IDs name {shared['items_sharing']}" in said
    assert info["blocked"] + info["recommendable"] + info["not_recommendable"] == items
    assert info["not_recommendable"] == len(n["delisted"]) and info["recommendable_set"]["unknown_ids"] == 1
    assert info["block_list"]["ids"] == 8 and info["block_list"]["unknown_ids"] == 1
    assert len(info["sha256"]) == 64 and info["uri"] == cfg.catalog
    shown = describe(run)
    assert f"items     {items:,} in the index" in shown and f"{served:,} recommendable" in shown

    state = json.loads((Path(run.uri) / "_RUN.json").read_text())
    rec_file = tmp_path / date / "recommendable.parquet"
    pq.write_table(pq.read_table(rec_file).slice(1), rec_file)  # one more item delisted
    assert plan_run(cfg).changes(state) == [f"the recommendable items ({rec_file})"]
    blocks = tmp_path / f"blocked-{date}.parquet"
    pq.write_table(pa.table({"item_id": [1]}), blocks)
    assert plan_run(cfg).changes(state)[1] == f"the blocked items ({blocks} + blocked_items (3))"
    old = killed_run(cfg, keep=1)
    with pytest.raises(ValueError, match=f"--resume {old}: the recommendable items .* changed since the run started"):
        run_nightly(cfg, resume=old)
    before = plan_run(cfg).lineage["catalog"]
    pop = pc.subtract(2, n["index"]["popularity"])  # the popularity reversed: shared semantic IDs list other items
    pq.write_table(n["index"].set_column(2, "popularity", pop), tmp_path / date / "items.parquet")
    plan = plan_run(cfg)
    assert plan.lineage["catalog"]["index"] == before["index"] and plan.lineage["catalog"]["listed"] != before["listed"]
    assert f"the catalog {cfg.catalog}" in plan.changes(state)  # a resume is refused
    shutil.rmtree(tmp_path / "out")
