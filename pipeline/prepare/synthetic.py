"""Synthetic catalogs and users for scale tests, drawn like Amazon Beauty (history lengths, item popularity), written
in the project's contracts with leave-one-out splits (SYNTHETIC_SPLITS: SPLIT_CONVENTION on one item per user for
valid and one for test)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from operators.prompts import ragged_arrays
from pipeline.prepare.contract import build_tokenizer, items_table, write_contract
from pipeline.prepare.splits import Interactions, length_summary, list_array, sorted_unique, split_tables

# History lengths of synthetic users: n = 5 + floor(Y), Y ~ LogNormal(mu, sigma).
# Fitted once on pipeline/prepare/amazon-beauty/train.parquet (19,383 users; train
# lengths min 2, median 5, mean 6.31, p99 31, max 165). 5-core data has >= 5 interactions
# per user, so the fit uses the 11,356 users with n >= 5 (median 6, mean 8.50, p90 14,
# p99 39, max 165): mu, sigma = mean, std of log(n - 4.5) (n - 4.5 is the midpoint of
# the Y interval that floors to n). Sampled: mean 8.27, p90 13, p99 33.
BEAUTY_LENGTH_MU = 0.6405
BEAUTY_LENGTH_SIGMA = 1.1684
# Item popularity, Zipf-Mandelbrot: P(rank r) ~ (r + offset) ** -alpha, r = 1, 2, ...
# Least-squares fit of log count vs log(rank + offset) over the 11,717 items seen in
# Beauty train (offset 100 -> slope -0.943). A plain Zipf (offset 0, slope -0.84) would
# give the top item 4% of all interactions instead of Beauty's 0.28% (0.18% here).
BEAUTY_ZIPF_ALPHA = 0.94
BEAUTY_ZIPF_OFFSET = 100
MIN_HISTORY = 5  # 5-core
SYNTHETIC_SPLITS = {  # write_synthetic: leave-one-out, like the real splits
    "train": "every user's items but the last two",
    "valid": "history = the train items (the last history_len); targets = the next item",
    "test": "history = the train + valid items (the last history_len); targets = one held-out next item",
    "evaluation": "every user has one target",
}


def _distinct_integers(rng: np.random.Generator, n: int, population: int) -> np.ndarray:
    """n distinct integers of [0, population), uniformly at random, in random order: [n] int64.

    Dense case (n >= population / 4): a permutation of the population. Sparse case: draw
    with replacement and deduplicate until n distinct values exist (memory O(n), never
    O(population)), then keep a random n of them.
    """
    if n > population:
        raise ValueError(f"cannot draw {n} distinct values from {population}")
    if 4 * n >= population:
        return rng.permutation(population)[:n].astype(np.int64)
    keys = np.zeros(0, dtype=np.int64)
    while len(keys) < n:
        extra = n - len(keys)
        draw = rng.integers(0, population, size=extra + extra // 8 + 1024, dtype=np.int64)
        keys = sorted_unique(np.concatenate([keys, draw]))
    return rng.permutation(keys)[:n]


def synthetic_catalog(n_items: int, levels: int = 4, codes: int = 256, seed=0) -> pa.Table:
    """A catalog of n_items with unique random semantic IDs: item_id, semantic_id, code_tokens.

    Item ids are 1_000_000 + a random permutation of arange(n_items) (unique, not row order).
    `seed` is an int, a SeedSequence or a Generator.
    """
    population = codes**levels  # Python int: no overflow
    if n_items <= 0:
        raise ValueError(f"n_items must be positive, got {n_items}")
    if n_items > population:
        raise ValueError(
            f"n_items={n_items} > codes**levels={codes}**{levels}={population}: not enough distinct semantic IDs"
        )
    if population >= 2**62:
        raise ValueError(f"codes**levels={population} is too large for synthetic catalogs (max 2**62)")
    rng = np.random.default_rng(seed)
    keys = _distinct_integers(rng, n_items, population)  # [N]
    sid = np.empty((n_items, levels), dtype=np.int32)  # [N, L]
    for j in range(levels):  # base-`codes` digits, most significant first
        sid[:, j] = (keys // codes ** (levels - 1 - j)) % codes
    del keys
    item_ids = 1_000_000 + rng.permutation(n_items).astype(np.int64)  # [N]
    return items_table(item_ids, sid, codes)


def _popularity(
    catalog_item_ids: np.ndarray, alpha: float, rng: np.random.Generator, offset: float = BEAUTY_ZIPF_OFFSET
):
    """Zipf-Mandelbrot popularity: (item ids by rank [N], cdf [N] float64); ranks at random."""
    ranked = rng.permutation(np.asarray(catalog_item_ids, dtype=np.int64))  # [N]
    cdf = np.cumsum((np.arange(1, len(ranked) + 1, dtype=np.float64) + offset) ** -alpha)
    cdf /= cdf[-1]
    return ranked, cdf


def synthetic_histories(
    n_users: int,
    catalog_item_ids: np.ndarray,
    seed=0,
    *,
    first_user_id: int = 1,
    alpha: float = BEAUTY_ZIPF_ALPHA,
    max_len: int = 1000,
    popularity=None,
) -> pa.Table:
    """n_users synthetic users: user_id, history list<int64> (full), target_items list<int64> [1].

    History length n = 5 + floor(LogNormal(BEAUTY_LENGTH_MU, BEAUTY_LENGTH_SIGMA)), capped at
    max_len; n + 1 items are drawn iid from a Zipf-Mandelbrot(alpha, BEAUTY_ZIPF_OFFSET)
    popularity over the catalog, ranks shuffled over the item ids (an item
    may repeat within a user, rarely); the last one is the held-out target. User ids are
    first_user_id + arange(n_users). `popularity` = _popularity(...) lets chunks share it.
    """
    if n_users < 0 or len(catalog_item_ids) == 0:
        raise ValueError(
            f"need n_users >= 0 and a non-empty catalog, got {n_users} users, {len(catalog_item_ids)} items"
        )
    rng = np.random.default_rng(seed)
    ranked, cdf = popularity if popularity is not None else _popularity(catalog_item_ids, alpha, rng)
    y = rng.lognormal(BEAUTY_LENGTH_MU, BEAUTY_LENGTH_SIGMA, size=n_users)  # [U]
    lengths = np.minimum(MIN_HISTORY + np.floor(np.minimum(y, max_len)), max_len).astype(np.int64)
    total = lengths + 1  # history + target
    rank = np.searchsorted(cdf, rng.random(int(total.sum())), side="right")  # [T]
    items = ranked[np.minimum(rank, len(ranked) - 1)]  # [T]
    starts = np.cumsum(total) - total  # [U]
    return pa.table(
        {
            "user_id": pa.array(first_user_id + np.arange(n_users, dtype=np.int64)),
            "history": list_array(items, starts, lengths),
            "target_items": list_array(items, starts + lengths, np.ones(n_users, dtype=np.int64)),
        }
    )


@dataclass
class SyntheticSummary:
    out_dir: str
    users: int
    items: int
    levels: int
    codes: int
    history_len: int
    interactions: int
    row_groups: int
    history_length: dict = field(default_factory=dict)


def write_synthetic(
    out_dir,
    n_users: int,
    n_items: int,
    levels: int = 4,
    codes: int = 256,
    seed: int = 0,
    *,
    history_len: int = 20,
    chunk_users: int = 1_000_000,
) -> SyntheticSummary:
    """Synthetic catalog + users in `out_dir`: items, train (histories without their last item), valid (that last
    item as target), test (last history_len items + 1 held-out target), tokenizer/, prepare.json. Users are generated
    and written `chunk_users` at a time (one parquet row group each)."""
    if n_users <= 0 or chunk_users <= 0 or history_len <= 0:
        raise ValueError(
            f"n_users, chunk_users and history_len must be positive, got {n_users}, {chunk_users}, {history_len}"
        )
    out_dir = Path(out_dir)
    catalog_seed, users_seed = np.random.SeedSequence(seed).spawn(2)
    catalog = synthetic_catalog(n_items, levels, codes, seed=catalog_seed)
    rng = np.random.default_rng(users_seed)
    popularity = _popularity(catalog.column("item_id").to_numpy(), BEAUTY_ZIPF_ALPHA, rng)
    lengths = []  # [chunk users] history lengths of every chunk, appended as it is written
    chunks = _leave_one_out(n_users, chunk_users, history_len, popularity, rng, lengths)
    row_groups = len(range(0, n_users, chunk_users))
    summary = SyntheticSummary(str(out_dir), n_users, n_items, levels, codes, history_len, 0, row_groups)
    report = functools.partial(
        _synthetic_report, summary, lengths, seed, chunk_users
    )  # asked once every chunk is written
    write_contract(out_dir, catalog, build_tokenizer(levels, codes), chunks, report)
    return summary


def _synthetic_report(summary: SyntheticSummary, lengths: list, seed: int, chunk_users: int) -> dict:
    """prepare.json of a synthetic set, once every chunk's history `lengths` are in (they complete `summary`)."""
    lens = np.concatenate(lengths)
    summary.interactions, summary.history_length = int(lens.sum()) + summary.users, length_summary(lens)
    return {
        "synthetic": True,
        "splits": SYNTHETIC_SPLITS,
        "seed": seed,
        "chunk_users": chunk_users,
        "zipf_alpha": BEAUTY_ZIPF_ALPHA,
        "zipf_offset": BEAUTY_ZIPF_OFFSET,
        "length_lognormal": {"mu": BEAUTY_LENGTH_MU, "sigma": BEAUTY_LENGTH_SIGMA, "min": MIN_HISTORY},
        "semantic_id_collisions": [],
        **asdict(summary),
    }


def _leave_one_out(
    n_users: int, chunk_users: int, history_len: int, popularity, rng: np.random.Generator, lengths: list
) -> Iterator[dict[str, pa.Table]]:
    """Synthetic users, `chunk_users` at a time -> each chunk's train / valid / test tables (nothing of a chunk is
    kept while the next one is drawn); each chunk's history lengths go to `lengths`."""
    for lo in range(0, n_users, chunk_users):
        n = min(chunk_users, n_users - lo)
        yield _split(
            synthetic_histories(n, popularity[0], rng, first_user_id=1 + lo, popularity=popularity),
            history_len,
            lengths,
        )


def _split(users: pa.Table, history_len: int, lengths: list) -> dict[str, pa.Table]:
    """Synthetic users -> their tables, SYNTHETIC_SPLITS: the last history item is the valid item, the held-out next
    item the test item (SPLIT_CONVENTION on those); their history lengths go to `lengths`."""
    user_ids = users.column("user_id").to_numpy()  # [n]
    values, starts, lens, _ = ragged_arrays(users.column("history"))  # [T], [n], [n]
    held_out, held_starts, ones, _ = ragged_arrays(users.column("target_items"))  # [n], [n], [n]
    lengths.append(lens)
    return split_tables(
        Interactions(user_ids, values, starts, lens - 1),
        Interactions(user_ids, values, starts + lens - 1, np.ones(len(lens), np.int64)),
        Interactions(user_ids, held_out, held_starts, ones),
        history_len,
    )
