"""genrec-batch as a library: `import genrec_batch` (a light, documented surface) and the processor, its decode as a
step of a user's own Ray Data pipeline, on a local Ray: its lists are the nightly's for the same users (beam, strict
speculation, DISC with a seed; from a Delta table, parquet and pandas), every row comes out with its list or the
nightly's reject reason, exclusions come from a column, and docs/library.md's example runs as written."""

from __future__ import annotations

import ast
import importlib
import logging
import re
import subprocess
import sys
import tomllib
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers import float32_atol

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "pyarrow", "transformers", "pandas", "decoding", "operators", "pipeline")


def test_import_genrec_batch_is_light_and_names_its_surface():
    """`import genrec_batch` loads none of the packages it re-exports from (nor torch, Ray, pyarrow); `__all__` is
    the surface, every name in it is its module's own object, type checkers see the same names, and docs/library.md's
    table names exactly them."""
    import genrec_batch as gb

    code = "import genrec_batch, sys; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = ast.literal_eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    assert "genrec_batch" in loaded and not set(HEAVY) & set(loaded), loaded
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert gb.__version__ == version("genrec-batch") == pyproject["project"]["version"]
    assert set(gb.__all__) == {"__version__", *gb._SURFACE} and sorted(dir(gb)) == sorted(gb.__all__)
    for name, module in gb._SURFACE.items():
        assert getattr(gb, name) is getattr(importlib.import_module(module), name), name
    tree = ast.parse((ROOT / "genrec_batch" / "__init__.py").read_text())
    typed = {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body
        for alias in node.names
    }
    assert typed == gb._SURFACE
    with pytest.raises(AttributeError, match="no attribute 'plan_run'"):
        gb.plan_run  # noqa: B018 -- internal, not re-exported
    api = (ROOT / "docs" / "library.md").read_text().split("## The public API", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`.*?) \|", api, re.M)  # the table's first column
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert documented == set(gb.__all__), documented ^ set(gb.__all__)  # docs/library.md's table is the surface


# --- the processor -------------------------------------------------------------------------------------------------

K = 5
BAD = {  # rows every mode must hand back with the nightly's reason
    9001: ("empty_history", []),
    9002: ("empty_history", None),
    9003: ("unknown_item", [10**12]),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.test_nightly import make_world

    return make_world(tmp_path_factory.mktemp("library"), n_users=24)


@pytest.fixture(scope="module")
def histories(world):
    """The world's users and bad rows (a null id, empty and null histories, an unknown item, a null exclusion id), an
    extra column a user keeps, and an exclusion column: every second user excludes its beam search top item ->
    (the table, each user's excluded item), written as parquet and as a Delta table beside the world."""
    import deltalake

    from tests.test_nightly import direct_beam_search

    good = pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"])
    top = direct_beam_search(world, good["history"].to_pylist(), k=K)[0].item_ids[:, 0].tolist()
    excluded = {u: top[i] for i, u in enumerate(good["user_id"].to_pylist()) if i % 2}
    users = good["user_id"].to_pylist() + [None, *BAD, 9004]
    table = pa.table(
        {
            "user_id": pa.array(users, pa.int64()),
            "history": pa.array(good["history"].to_pylist() + [[1], *(h for _, h in BAD.values()), [1]]),
            "exclude_items": pa.array([[excluded[u]] if u in excluded else None for u in users[:-1]] + [[None]]),
            "segment": [f"arm-{i % 3}" for i in range(len(users))],
        }
    )
    pq.write_table(table, world / "histories.parquet")
    deltalake.write_deltalake(world / "histories.delta", table)
    return table, excluded


def nightly_lists(world, out: Path, *settings) -> tuple[dict, dict, dict]:
    """A nightly run of the world's config with these settings -> ({user: items}, {user: scores}, {user: reason})."""
    from pipeline.nightly import run_nightly
    from tests.test_nightly import config, read_run

    cfg = config(world, out, *settings)
    run_nightly(cfg)
    recs, rejects = (read_run(cfg)[1][t].to_pandas() for t in ("recommendations", "rejects"))
    by_user = recs.sort_values(["user_id", "rank"]).groupby("user_id")
    reasons = {None if pd.isna(u) else int(u): r for u, r in zip(rejects.user_id, rejects.reason)}
    return by_user.item_id.apply(list).to_dict(), by_user.score.apply(list).to_dict(), reasons


def processor_config(world, mode: str, *settings):
    """The processor's config of the world, in each of the ways a user can write one."""
    import genrec_batch as gb
    from tests.test_nightly import config

    if mode == "beam":  # the nightly's own config: its processor fields
        return config(world, world / "unused", *settings)
    overrides = [f"catalog={world / 'data' / 'items.parquet'}", f"models.target={world / 'target'}", *settings]
    if mode == "atspeed-strict":  # the nightly's YAML fields and overrides
        return gb.load_processor_config(None, [*overrides, f"models.draft={world / 'draft'}", f"decoding.k={K}"])
    return gb.ProcessorConfig(  # in Python
        models=gb.Models(target=str(world / "target")),
        catalog=str(world / "data" / "items.parquet"),
        decoding=gb.Decoding(mode="disc", k=K, seed=7),
        compute=gb.Compute(batch_size=5),
        columns=gb.Columns(user_id="uid", history="items"),  # the pandas frame's names (`as_pandas`)
    )


@pytest.mark.parametrize("mode", ["beam", "atspeed-strict", "disc"])
def test_the_processors_lists_are_the_nightlys(world, histories, ray_session_plain, tmp_path, mode):
    """The same users, models and settings through the nightly (batches of 16, ordered by length) and the processor
    (batches of 5, in the dataset's order; beam from a Delta table, strict from parquet with a preprocess, DISC seeded
    from pandas under other column names): the same lists, scores within float32's reordering bound; every row out
    once, in its own row, with its columns, its list or the nightly's reject reason; no user gets an item its
    exclusion column names."""
    import ray

    import genrec_batch as gb

    table, excluded = histories
    settings = [f"decoding.mode={mode}"] + (["decoding.seed=7"] if mode == "disc" else [])
    source = {"beam": f"input=delta+{world / 'histories.delta'}"}.get(mode, f"input={world / 'histories.parquet'}")
    want, want_scores, want_reasons = nightly_lists(world, tmp_path / "out", source, *settings)

    ds = {
        "beam": lambda: ray.data.read_delta(str(world / "histories.delta")),
        "atspeed-strict": lambda: ray.data.read_parquet(world / "histories.parquet"),
        "disc": lambda: ray.data.from_pandas(as_pandas(table)),
    }[mode]()
    extra = ["compute.batch_size=5", "compute.order_by_length=false"] if mode != "disc" else []
    arm = (lambda row: {"arm": row["segment"].upper()}) if mode == "atspeed-strict" else None  # merged into the row
    got = gb.build_processor(processor_config(world, mode, *settings, *extra), preprocess=arm)(ds).to_pandas()
    got = got.rename(columns={"uid": "user_id", "items": "history"})

    added = ["arm"] * (arm is not None)
    assert len(got) == table.num_rows and list(got.columns) == [*table.column_names, *added, *gb_outputs()]
    assert sorted(got.segment) == sorted(table["segment"].to_pylist())  # the user's columns, each row once
    assert not added or (got.arm == got.segment.str.upper()).all()
    for row in got.itertuples():
        user = None if pd.isna(row.user_id) else int(row.user_id)
        if user in want:
            assert null(row.reject_reason) and list(row.item_ids) == want[user], (mode, user)
            atol = float32_atol(torch.tensor(want_scores[user]))
            np.testing.assert_allclose(row.scores, want_scores[user], rtol=0, atol=atol)
            assert excluded.get(user) not in row.item_ids
        else:
            assert null(row.item_ids) and null(row.scores) and row.reject_reason == want_reasons[user], user
    reasons = got.set_index("segment").reject_reason.dropna()
    assert sorted(reasons) == sorted(["missing_user_id", "bad_exclude_items", *(r for r, _ in BAD.values())])
    assert len(want) == table.num_rows - len(reasons)  # every good user listed by both


def null(value) -> bool:
    """A null cell of a pandas frame read from Arrow (None, or pandas' NA), never a list."""
    return value is None or (np.ndim(value) == 0 and pd.isna(value))


def gb_outputs() -> list[str]:
    from pipeline.processor import OUTPUT_COLUMNS

    return list(OUTPUT_COLUMNS)


def as_pandas(table: pa.Table) -> pd.DataFrame:
    """The histories as a user's pandas frame: nullable integer ids (`uid`), each history a numpy array (`items`:
    Ray Data makes the column a tensor column), the exclusion lists as Python lists."""
    df = table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    df["history"] = [np.asarray(h if h is not None else [], np.int64) for h in table["history"].to_pylist()]
    df["exclude_items"] = table["exclude_items"].to_pylist()
    return df.rename(columns={"user_id": "uid", "history": "items"})


def test_the_library_pages_example_runs_as_written(world, ray_session_plain, tmp_path):
    """docs/library.md's example, its code blocks run as written in a folder laid out as `make demo` lays it (the
    world's data and target under those names): parquet histories joined with a feature table and filtered, the
    processor, a business rule in postprocess, a parquet sink. Every active user has one row, and its list is a
    direct beam search's (the whole catalog, the same k) less the items the rule drops."""
    from tests.test_nightly import direct_beam_search

    (tmp_path / "data").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "data" / "beauty").symlink_to(world / "data")
    (tmp_path / "models" / "demo-target").symlink_to(world / "target")
    page = (ROOT / "docs" / "library.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page.split("\n## An example\n", 1)[1], re.M | re.S)
    assert len(blocks) == 2
    scope: dict = {}
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for block in blocks:  # its relative paths under tmp_path: this Ray's workers run in the repository's folder
            block = re.sub(r'"(data|models|out)/', lambda m: f'"{tmp_path}/{m[1]}/', block)
            exec(compile(block, "docs/library.md", "exec"), scope)
    deprecated = [f"{w.lineno}: {w.message}" for w in warned if w.filename == "docs/library.md"]
    assert not deprecated, deprecated  # the page's calls are the libraries' current API
    got = pq.read_table(tmp_path / "out" / "library").to_pandas().set_index("user_id")
    features = pq.read_table(tmp_path / "data" / "features.parquet").to_pandas()
    active = features[features.active]
    assert sorted(got.index) == sorted(active.user_id) and got.reject_reason.isna().all()
    histories = pq.read_table(world / "data" / "test.parquet").to_pandas().set_index("user_id").loc[active.user_id]
    direct = direct_beam_search(world, histories.history.map(list).tolist(), k=10)[0].item_ids.tolist()
    dropped = 0
    for user, market, items in zip(active.user_id, active.market, direct):
        kept = [i for i in items if i not in scope["OUT_OF_STOCK"][market]]
        assert list(got.loc[user, "item_ids"]) == kept, user
        dropped += len(items) - len(kept)
    assert dropped  # the rule took items out


def test_the_processor_config_is_the_nightlys_fields_checked_alike(world, caplog):
    """ProcessorConfig: the nightly config's processor fields, with their defaults; checked as the nightly's are
    (num_actors also as Ray Data LLM's (min, max)), the precision audit refused; a nightly YAML's own fields named and
    left out; a missing model refused on the driver, named, as the nightly's plan refuses it."""
    import genrec_batch as gb
    from pipeline.cluster import actor_pool
    from pipeline.config import PROCESSOR_FIELDS, Config, processor_config

    cfg = gb.ProcessorConfig(
        models=gb.Models(target=str(world / "target")), catalog=str(world / "data" / "items.parquet")
    )
    assert set(vars(cfg)) == set(PROCESSOR_FIELDS) and cfg.decoding == Config().decoding
    for concurrency, pool in (((2, 4), (2, 4, 4)), ("2..4", (2, 4, 4)), (3, (1, 3, 3)), ("auto", (1, None, 7))):
        cfg.compute.num_actors = concurrency
        assert processor_config(cfg) is cfg
        assert tuple(vars(actor_pool(cfg.compute, {"CPU": 8}))[k] for k in ("min", "max", "initial")) == pool
    for wrong, message in (
        ({"num_actors": (4, 2)}, "compute.num_actors must be an integer >= 1, a range"),
        ({"num_actors": (0, 2)}, "compute.num_actors"),
        ({"audit_users": 8}, "compute.audit_users is the nightly's precision audit"),
    ):
        bad = gb.ProcessorConfig(**{**vars(cfg), "compute": gb.Compute(**wrong)})
        with pytest.raises(ValueError, match=re.escape(message)):
            gb.build_processor(bad)
    with pytest.raises(ValueError, match="catalog must be set"):
        gb.build_processor(gb.ProcessorConfig(models=cfg.models))
    with caplog.at_level(logging.INFO, logger="genrec.processor"):
        loaded = gb.load_processor_config(
            None,
            [
                f"catalog={cfg.catalog}",
                f"models.target={cfg.models.target}",
                "input=x.parquet",
                "runs.lease_s=60",
                "compute.num_actors=2..4",
            ],
        )
    assert "the processor ignores the nightly's input, runs" in caplog.text and loaded.compute.num_actors == "2..4"
    with pytest.raises(FileNotFoundError, match="models.target"):
        gb.build_processor(gb.ProcessorConfig(models=gb.Models(target=str(world / "none")), catalog=cfg.catalog))


def test_a_batch_becomes_its_rows_with_their_lists_or_reasons():
    """The actor's two ends, without Ray: a dataset's batch -> the recommender's rows (`columns` renamed, Ray Data's
    tensor columns as lists, refusals naming the column); its decode -> one row per row in, lists where listed; and
    preprocess's merge (a preprocess that returns no dict refused, naming it)."""
    from operators.recommender import Recommended
    from pipeline.config import Columns, ProcessorConfig
    from pipeline.processor import decoder_rows, merged, plain, with_lists

    cfg = ProcessorConfig(columns=Columns(user_id="uid", history="items"))
    batch = pa.table({"uid": [7, 8, 9], "items": [[1, 2], [3], []], "exclude_items": [[2], None, None], "x": [1, 2, 3]})
    rows = decoder_rows(batch, cfg)
    assert rows.column_names == ["user_id", "history", "exclude_items"] and rows["history"] == batch["items"]
    for table, message in (
        (batch.drop_columns(["items"]), r"no column\(s\) \['items'\] \(columns.user_id uid, columns.history items\)"),
        (batch.append_column("scores", pa.array([1, 2, 3])), r"already has column\(s\) \['scores'\]"),
        (batch.set_column(0, "uid", pa.array([1.0, 2.0, 3.0])), "user ids must be integers, strings or binary"),
    ):
        with pytest.raises(ValueError, match=message):
            decoder_rows(table, cfg)
    assert decoder_rows(batch.set_column(0, "uid", pa.nulls(3)), cfg).num_rows == 3  # each row a missing_user_id
    from ray.data._internal.tensor_extensions.arrow import ArrowTensorArray

    ragged = ArrowTensorArray.from_numpy(np.array([np.array([1, 2]), np.array([3])], dtype=object))
    square = ArrowTensorArray.from_numpy(np.array([[1, 2], [3, 4]]))
    assert [plain(pa.chunked_array([t])).to_pylist() for t in (ragged, square)] == [[[1, 2], [3]], [[1, 2], [3, 4]]]

    assert merged({"a": 1, "b": 2}, lambda row: {"b": 3, "c": row["a"]}) == {"a": 1, "b": 3, "c": 1}
    with pytest.raises(TypeError, match="preprocess '<lambda>' must return a dict .* got NoneType"):
        merged({"a": 1}, lambda row: None)

    recs = pa.table({"item_id": pa.array([5, 6, 7], pa.int64()), "score": pa.array([-1, -2, -3], pa.float32())})
    rejects = pa.table({"user_id": [9, 8], "reason": ["empty_history", "no_items"], "detail": ["", ""]})
    out = Recommended(np.array([0, 1]), np.array([3, 0]), recs, rejects, np.array([2, 1]), {})
    got = with_lists(batch, out)
    assert got.column_names == [*batch.column_names, "item_ids", "scores", "reject_reason"]
    assert got["item_ids"].to_pylist() == [[5, 6, 7], None, None] and got["scores"].type == pa.list_(pa.float32())
    assert got["reject_reason"].to_pylist() == [None, "no_items", "empty_history"]


def test_a_user_text_column_of_nulls_only_writes_nothing(world, tmp_path):
    """The actor without Ray: a {user:COLUMN} the template writes that a block holds as Arrow's null type (a pandas
    or Ray Data column whose every value in the block is None) writes nothing, as the same nulls typed as strings do;
    a column of another type is refused, naming it."""
    import json

    import genrec_batch as gb
    from pipeline.processor import RowRecommender, actor_args

    template = tmp_path / "profiled.json"
    profiled = {"name": "profiled", "prefix": "{user:profile} ", "max_items": 8, "trusted": ["profile"]}
    template.write_text(json.dumps(profiled))  # trusted: the tiny word-level tokenizer holds code tokens as words
    cfg = gb.ProcessorConfig(
        models=gb.Models(target=str(world / "target"), template=str(template)),
        catalog=str(world / "data" / "items.parquet"),
        decoding=gb.Decoding(k=K),
    )
    processor = gb.build_processor(cfg)
    actor = RowRecommender(**actor_args(processor.config, processor.decoder))
    batch = pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"]).slice(0, 4)
    typed = actor(batch.append_column("profile", pa.nulls(4, pa.string())))
    untyped = actor(batch.append_column("profile", pa.nulls(4)))
    assert typed["reject_reason"].null_count == 4
    assert untyped.drop_columns(["profile"]).equals(typed.drop_columns(["profile"]))
    with pytest.raises(ValueError, match=re.escape("{user:profile}, but the dataset's profile is struct")):
        actor(batch.append_column("profile", pa.array([{"a": 1}] * 4)))


def test_the_library_page_names_every_reason_a_row_can_carry():
    """docs/library.md's reject_reason names every reason of docs/output.md's rejects but duplicate_user, which the
    processor does not give (a repeated id is decoded again)."""
    output = (ROOT / "docs" / "output.md").read_text().split("Reasons, in order of precedence", 1)[1].split("###")[0]
    reasons = set(re.findall(r"^\| `(\w+)` \|", output, re.M)) - {"duplicate_user"}
    page = (ROOT / "docs" / "library.md").read_text()
    listed = set(re.findall(r"`(\w+)`", page.split("- `reject_reason`", 1)[1].split("\n\n", 1)[0]))
    assert reasons and reasons <= listed, reasons - listed


def test_every_bad_row_keeps_its_place_with_its_reason(world, tmp_path):
    """The actor without Ray, one batch of every kind of row, among them those rejected only once rendered
    (prompt_too_long) or decoded (non_finite_logits: the target's embedding of one code token planted NaN, which only
    that row's prompt holds; no_items): each row comes out in its place with the nightly's reason and no list, and the
    others with a direct beam search's lists, a repeated user id's rows each with its own history's (docs/library.md:
    the processor has no duplicate_user)."""
    import shutil

    from safetensors.torch import load_file, save_file

    import genrec_batch as gb
    from pipeline.processor import RowRecommender, actor_args
    from tests.test_nightly import direct_beam_search

    target = tmp_path / "target"
    shutil.copytree(world / "target", target)
    weights = load_file(target / "model.safetensors")
    weights["model.embed_tokens.weight"][gb.load_tokenizer(str(target)).convert_tokens_to_ids("<c_5>")] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    items = pq.read_table(world / "data" / "items.parquet").to_pylist()
    poisoned = next(i["item_id"] for i in items if "<c_5>" in i["code_tokens"])
    a, b, c, d = [i["item_id"] for i in items if "<c_5>" not in i["code_tokens"]][:4]
    rows = [  # (user, history, exclusions, reason)
        (1, [a, b], None, None),
        (None, [a], None, "missing_user_id"),
        (3, [poisoned], None, "non_finite_logits"),
        (4, [a, b, c], None, "prompt_too_long"),
        (5, [], None, "empty_history"),
        (6, [1.5], None, "bad_type"),
        (7, [10**12], None, "unknown_item"),
        (8, [c], [None], "bad_exclude_items"),
        (9, [b], [i["item_id"] for i in items], "no_items"),
        (10, [d, c], None, None),
        (1, [d, c], None, None),  # a repeated id: decoded again, from its own history (no duplicate_user)
    ]
    batch = pa.table(
        {
            "user_id": pa.array([r[0] for r in rows], pa.int64()),
            "history": pa.array([r[1] for r in rows], pa.list_(pa.float64())),
            "exclude_items": pa.array([r[2] for r in rows], pa.list_(pa.int64())),
        }
    )
    cfg = gb.ProcessorConfig(
        models=gb.Models(target=str(target)),
        catalog=str(world / "data" / "items.parquet"),
        decoding=gb.Decoding(k=K, max_prompt_tokens=7, too_long="reject"),  # <bos> and two items of 3 codes
    )
    processor = gb.build_processor(cfg)
    out = RowRecommender(**actor_args(processor.config, processor.decoder))(batch)
    assert out["reject_reason"].to_pylist() == [r[3] for r in rows]
    lists = out["item_ids"].to_pylist()
    assert [i for i in range(len(rows)) if lists[i] is None] == [i for i, r in enumerate(rows) if r[3]]
    direct = direct_beam_search(world, [[a, b], [d, c]], k=K)[0].item_ids.tolist()
    assert [lists[0], lists[-2], lists[-1]] == [direct[0], direct[1], direct[1]]


def test_gpu_actors_on_a_cluster_without_gpus_are_said_before_the_wait(world, ray_session_plain, caplog):
    """A processor of GPU actors applied on this CPU-only Ray: the driver warns, naming the setting, the cluster and
    the bound on the wait, when the dataset is built (its execution would wait for a GPU node as long as it runs)."""
    import ray

    import genrec_batch as gb

    cfg = gb.ProcessorConfig(
        models=gb.Models(target=str(world / "target")),
        catalog=str(world / "data" / "items.parquet"),
        compute=gb.Compute(gpus_per_actor=1),
    )
    with caplog.at_level(logging.WARNING, logger="genrec.processor"):
        gb.build_processor(cfg)(ray.data.range(1))
    assert "compute.gpus_per_actor 1 GPU" in caplog.text and "has CPU 2 now" in caplog.text, caplog.text
    assert "wait_for_min_actors_s" in caplog.text


def test_the_docs_python_examples_import_only_the_public_api():
    """Every Python example of the docs imports genrec-batch's code as `genrec_batch` (its public API), never the
    internal packages it re-exports from."""
    internal = re.compile(r"^\s*(?:from|import)\s+(decoding|operators|pipeline|jobs)\b", re.M)
    found = [
        f"{page.relative_to(ROOT)}: {m.group(0).strip()}"
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)
        for m in internal.finditer(block)
    ]
    found += [
        f"{p.relative_to(ROOT)}: {m.group(0).strip()}"
        for p in (ROOT / "docs").rglob("*.py")
        for m in internal.finditer(p.read_text())
    ]
    assert not found, found
