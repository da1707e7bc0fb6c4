"""Per-user draws (decoding/draws.py): a user's numbers, and so its sampled items in DISC and relaxed speculative
decoding, depend on its seed only, never on the batch it is decoded in: alone, in a batch, in another order, beside
other users."""

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from decoding.disc import disc_sample
from decoding.draws import GOLDEN, UserDraws, mix, mix_int, uniform, user_seeds
from decoding.models import tiny_model
from decoding.speculative import speculative_beam_search
from tests.helpers import left_padded_prompts, random_catalog

LENGTHS = [3, 9, 5, 12, 4, 7, 6, 10]  # one prompt length per user: every batch pads them differently


def test_the_finaliser_on_tensors_equals_the_one_on_ints():
    x = torch.tensor([0, 1, -1, 2**62, -(2**63), 123456789], dtype=torch.int64)
    assert mix(x).tolist() == [mix_int(v) for v in x.tolist()]
    assert mix_int(GOLDEN) == 0xE220A8397B1DCDAF - 2**64  # SplitMix64's first output from seed 0


def test_user_seeds_are_stable_and_distinct():
    a = user_seeds(7, [1, 2, "2", "u-3"])
    assert torch.equal(a, user_seeds(7, [1, 2, "2", "u-3"]))  # a pure function of (seed, id)
    assert len(set(a.tolist())) == 4  # the int 2 and the string "2" are other users
    assert not set(a.tolist()) & set(user_seeds(8, [1, 2, "2", "u-3"]).tolist())  # another run seed: other seeds


def test_uniforms_stay_inside_the_open_interval_and_ids_are_canonical():
    """The extreme bit patterns give uniforms strictly inside (0, 1) (a Gumbel of them is finite); an int and its
    numpy twin share a seed, an int and its string differ, anything else is refused."""
    import numpy as np

    from decoding.draws import unit

    u = unit(torch.tensor([-1, 0, (1 << 63) - 1, -(1 << 63)], dtype=torch.int64))
    assert bool(((u > 0) & (u < 1)).all()) and torch.isfinite(-torch.log(-torch.log(u))).all()
    assert user_seeds(3, [5]).tolist() == user_seeds(3, [np.int64(5)]).tolist() != user_seeds(3, ["5"]).tolist()
    with pytest.raises(TypeError):
        user_seeds(3, [5.0])


def test_a_rows_numbers_follow_its_user_not_its_row():
    seeds = user_seeds(0, range(6))
    draws = UserDraws(seeds).at(3, 1)
    u = draws.uniform((6, 5, 4))  # [B, 5, 4]
    assert ((u > 0) & (u < 1)).all()
    perm = torch.tensor([4, 0, 5, 2])
    assert torch.equal(draws.select(perm).uniform((4, 5, 4)), u[perm])  # rows reordered and dropped
    assert not torch.equal(UserDraws(seeds).at(3, 2).uniform((6, 5, 4)), u)  # another call site: other numbers
    index = torch.tensor([[7, 2]]).expand(6, 2)
    assert torch.equal(draws.uniform((6, 2), index), u.view(6, 20)[:, [7, 2]])  # elements keyed by their index
    with pytest.raises(ValueError, match="3 rows"):
        uniform((3, 2), draws, "cpu")


def test_per_user_uniforms_are_uniform_and_independent():
    """20,000 users x 50 numbers: the mean and the lag-1 correlation within rows and across neighbouring users are
    within 5 standard errors of a uniform's (se of the mean sqrt(1/12 / 1e6) = 2.9e-4, of a correlation 1e-3)."""
    u = UserDraws(user_seeds(1, range(20_000))).uniform((20_000, 50))
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
    c = lambda a, b: float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])  # noqa: E731
    assert abs(c(u[:, 1:], u[:, :-1])) < 5e-3 and abs(c(u[1:], u[:-1])) < 5e-3


@pytest.fixture(scope="module")
def models():
    cat = random_catalog(60, 3, 5, seed=2)
    target = tiny_model("llama", cat.vocab_size, seed=1)
    draft = tiny_model("llama", cat.vocab_size, seed=2)
    with torch.no_grad():  # peaked but not deterministic: draws differ between users
        target.lm_head.weight.mul_(4)
        draft.lm_head.weight.mul_(4)
    return cat, target, draft


def decode(mode, models, ids, mask, seeds):
    cat, target, draft = models
    if mode == "disc":
        return disc_sample(target, ids, mask, cat, 5, rounds=3, generator=UserDraws(seeds)).item_ids
    return speculative_beam_search(
        target, draft, ids, mask, cat, 5, verification="relaxed", generator=UserDraws(seeds)
    ).item_ids


def trimmed(ids, mask):
    first = int(mask.any(0).nonzero()[0])
    return ids[:, first:], mask[:, first:]


@pytest.mark.parametrize("mode", ["disc", "atspeed-relaxed"])
def test_a_users_items_do_not_depend_on_its_batch(models, mode):
    """Eight users of eight prompt lengths: each user's items decoded alone (no padding), all together, in another
    order and beside four other users are the same; users with other seeds draw other items (the same prompt given
    to eight user ids does not give eight equal lists)."""
    cat = models[0]
    ids, mask = left_padded_prompts(8, LENGTHS, cat.vocab_size, seed=0)
    seeds = user_seeds(5, range(8))
    together = decode(mode, models, ids, mask, seeds)
    assert (together >= 0).all()
    alone = torch.cat(
        [decode(mode, models, *trimmed(ids[i : i + 1], mask[i : i + 1]), seeds[i : i + 1]) for i in range(8)]
    )
    assert torch.equal(alone, together)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    assert torch.equal(decode(mode, models, ids[perm], mask[perm], seeds[perm]), together[perm])
    others, others_mask = left_padded_prompts(4, [15, 2, 8, 11], cat.vocab_size, seed=9)
    mixed_ids, mixed_mask = torch.zeros(8, 15, dtype=torch.int64), torch.zeros(8, 15, dtype=torch.int64)
    mixed_ids[:4, 3:], mixed_mask[:4, 3:] = ids[:4], mask[:4]
    mixed_ids[4:], mixed_mask[4:] = others, others_mask
    mixed = decode(mode, models, mixed_ids, mixed_mask, torch.cat([seeds[:4], user_seeds(5, range(100, 104))]))
    assert torch.equal(mixed[:4], together[:4])  # more padding, other neighbours: the same items
    same_prompt = decode(mode, models, ids[:1].repeat(8, 1), mask[:1].repeat(8, 1), seeds)
    assert len({tuple(sorted(r)) for r in same_prompt.tolist()}) > 1


ID_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.uint64(), pa.string(), pa.large_string(), pa.binary()]
ID_TYPES += [pa.large_binary(), pa.binary(4)]  # fixed-size binary (Parquet's UUIDs) is bytes as the others


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.test_nightly import make_world

    return make_world(tmp_path_factory.mktemp("ids"), n_users=12)


def test_every_mode_decodes_every_id_type_the_input_admits(world):
    """Integers of any width and sign, strings and binary: every mode lists every user, and a sampling mode draws for
    a user what it draws for the same id in another type's batch whenever the canonical id is the same (an int8 5 is
    an int64 5; the string "5" is another user)."""
    from operators.recommender import Recommender
    from pipeline.config import load_config
    from pipeline.plan import direct_spec

    users = pq.read_table(world / "data" / "test.parquet").select(["user_id", "history"])
    lists = {}
    for mode in ("beam", "atspeed-strict", "atspeed-relaxed", "disc", "auto"):
        cfg = load_config(
            None,
            [
                f"input={world / 'data' / 'test.parquet'}",
                f"catalog={world / 'data' / 'items.parquet'}",
                f"output={world / 'out'}",
                f"models.target={world / 'target'}",
                f"models.draft={world / 'draft'}",
                f"decoding.mode={mode}",
                "decoding.k=5",
            ],
        )
        actor = Recommender(direct_spec(cfg))
        for kind in ID_TYPES:
            ids = pa.array(
                [
                    f"{u % 100:04d}".encode()
                    if pa.types.is_fixed_size_binary(kind)
                    else str(u % 100).encode()
                    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                    else (str(u % 100) if pa.types.is_string(kind) or pa.types.is_large_string(kind) else u % 100)
                    for u in range(users.num_rows)
                ],
                kind,
            )
            out = actor(users.set_column(0, "user_id", ids))
            recs = out.filter(pc.equal(out["kind"], "rec"))
            assert recs.num_rows == 5 * users.num_rows and recs["user_id"].type == kind, (mode, kind)
            lists[(mode, str(kind))] = recs["item_id"].to_pylist()
    for mode in ("atspeed-relaxed", "disc"):  # the same canonical id, the same draws
        ints = [lists[(mode, str(k))] for k in ID_TYPES[:4]]
        assert all(x == ints[0] for x in ints), mode
        texts = [lists[(mode, str(k))] for k in ID_TYPES[4:]]
        assert texts[0] == texts[1] and texts[2] == texts[3], mode


@pytest.mark.parametrize(
    "kind", [pa.float64(), pa.decimal128(10, 0), pa.date32(), pa.dictionary(pa.int32(), pa.string()), pa.null()]
)
def test_the_plan_refuses_an_id_type_no_mode_can_key_a_user_by(world, tmp_path, kind):
    import datetime as dt
    from decimal import Decimal

    from pipeline.config import load_config
    from pipeline.plan import plan_run

    users = pq.read_table(world / "data" / "test.parquet")
    n = users.num_rows
    values = {
        "double": lambda: pa.array([float(i) for i in range(n)]),
        "decimal128(10, 0)": lambda: pa.array([Decimal(i) for i in range(n)], kind),
        "date32[day]": lambda: pa.array([dt.date(2026, 1, 1) + dt.timedelta(days=i) for i in range(n)]),
        "dictionary<values=string, indices=int32, ordered=0>": lambda: pa.array(
            [str(i) for i in range(n)]
        ).dictionary_encode(),
        "null": lambda: pa.nulls(n),
    }[str(kind)]()
    pq.write_table(users.set_column(0, "user_id", values), tmp_path / "in.parquet")
    cfg = load_config(
        None,
        [
            f"input={tmp_path / 'in.parquet'}",
            f"catalog={world / 'data' / 'items.parquet'}",
            f"output={tmp_path / 'out'}",
            f"models.target={world / 'target'}",
        ],
    )
    with pytest.raises(ValueError, match=r"column user_id is .*; user ids must be integers, strings or binary"):
        plan_run(cfg)
    (tmp_path / "two").mkdir()  # a folder whose first file is fine: every file's footer is checked
    pq.write_table(users, tmp_path / "two" / "a.parquet")
    pq.write_table(users.set_column(0, "user_id", values), tmp_path / "two" / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet: column user_id is .*; user ids must be integers"):
        plan_run(load_config(None, [f"input={tmp_path / 'two'}", *cfg_rest(world, tmp_path)]))


def cfg_rest(world, tmp_path) -> list[str]:
    return [
        f"catalog={world / 'data' / 'items.parquet'}",
        f"output={tmp_path / 'out'}",
        f"models.target={world / 'target'}",
    ]


def test_one_kind_of_user_id_in_every_file(world, tmp_path):
    """Integer ids in one file and string ids in another: the same user would be two; refused, naming both."""
    from pipeline.config import load_config
    from pipeline.plan import plan_run

    users = pq.read_table(world / "data" / "test.parquet")
    (tmp_path / "mixed").mkdir()
    pq.write_table(users, tmp_path / "mixed" / "a.parquet")
    pq.write_table(users.set_column(0, "user_id", pc.cast(users["user_id"], pa.string())), tmp_path / "mixed" / "b.pq")
    with pytest.raises(ValueError, match=r"user_id is integer in .*a.parquet; string in .*b.pq: one kind of id"):
        plan_run(load_config(None, [f"input={tmp_path / 'mixed'}", *cfg_rest(world, tmp_path)]))


def test_a_folder_of_two_integer_id_widths_reads_as_one(world, tmp_path):
    """int32 ids in one file and int64 in another, one user in both: the input's ids are int64, every file's rows are
    read as int64 (the read tasks, the duplicate search, which finds the user seen twice); uint64 ids beside int64
    ones are refused, naming both files (no integer type holds both)."""
    import json

    from pipeline.config import load_config
    from pipeline.plan import plan_run
    from pipeline.units import find_duplicates, read_units, todo

    users = pq.read_table(world / "data" / "test.parquet").select(["user_id", "history"])
    (tmp_path / "in").mkdir()
    narrow = users.slice(0, 6).set_column(0, "user_id", pc.cast(users["user_id"][:6], pa.int32()))
    pq.write_table(narrow, tmp_path / "in" / "a.parquet")
    pq.write_table(pa.concat_tables([users.slice(6), users.slice(0, 1)]), tmp_path / "in" / "b.parquet")
    plan = plan_run(load_config(None, [f"input={tmp_path / 'in'}", *cfg_rest(world, tmp_path)]))
    assert plan.user_type == pa.int64()
    found, _ = find_duplicates(plan.units, plan.fs, schema=plan.data.schema)
    assert found.to_pylist() == [{"user_id": users["user_id"][0].as_py(), "first": 0}]
    batch = pa.Table.from_pylist([{**u, "done": json.dumps(u["done"])} for u in todo(plan.units, [])])
    rows = read_units(batch, plan.fs, {"user_id": "user_id", "history": "history"}, found, schema=plan.data.schema)
    assert rows.schema.field("user_id").type == pa.int64() and rows["duplicate"].to_pylist() == [False] * 12 + [True]
    pq.write_table(
        users.set_column(0, "user_id", pc.cast(users["user_id"], pa.uint64())), tmp_path / "in" / "a.parquet"
    )
    with pytest.raises(ValueError, match=r"column 'user_id' is uint64 in .*a.parquet and int64 in .*b.parquet"):
        plan_run(load_config(None, [f"input={tmp_path / 'in'}", *cfg_rest(world, tmp_path)]))
