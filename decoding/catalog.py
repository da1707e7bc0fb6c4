"""GPU catalog index: which semantic-ID token sequences are real items.

The catalog is N items, each a row of L token ids. Rows are kept lexicographically sorted on the
catalog's device, and two structures are derived from them:

- PPV (parallel prefix verification, DISC paper Algorithm 2): a vectorised binary search of
  `prefix + candidate` rows in the sorted matrix (`verify`, `lookup`).
- CSR transition index: the trie's nodes are the sorted unique prefixes, level by level (node 0 is the
  root, then the prefixes of length 1, 2, ..., then the L-token items), so a node id says its level too.
  Node g's children are nodes `node_ptr[g] + 1 .. node_ptr[g + 1]`, reached by the tokens `edge_tok`
  (ascending). Beam search walks the trie by node id, beams at different levels expand in one call
  (speculative decoding needs that), and `allowed_next` gathers whole child ranges at once.

Items that share a semantic ID (`duplicate_items`): the index holds each semantic ID once, and its items as a CSR
group (`group_ptr`, `listed`) in the policy's order: `first` keeps one item per semantic ID, `by:COLUMN` and `expand`
keep them all, best first. A decoder searches semantic IDs; `listing` turns each user's semantic IDs into its list
(`by`: the first item of each that the user may take; `expand`: every such item, one entry each).

Per-user exclusions (`Exclusions`, one batch's): the trie nodes each user may not reach, closed bottom-up (a leaf
all of whose items are excluded, a node all of whose children are closed), as sorted keys user * G + node per level;
every decoder drops a closed child where its candidates are made (`decoding.beam.children`).

No Python loop runs over rows, beams or users; loops run over the L levels or log2(N) bisection steps.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import torch

from decoding.codes import code_token, code_token_ids, column_rank, duplicate_policy, format_rows, semantic_id_matrix


@dataclass
class ItemTokens:
    """Every item of the item index (items sharing a semantic ID, and items no list may hold, included) -> its L code
    token ids: the map prompts are rendered with. A sorted id array and np.searchsorted, on the CPU; the token ids are
    kept in int32 (8 + 4 L bytes per item) and looked up as int64."""

    item_ids: np.ndarray  # [N] int64, sorted ascending, unique
    token_ids: np.ndarray  # [N, L] int32 (int64 for a vocabulary of 2**31 tokens or more), row i is item_ids[i]'s

    @classmethod
    def from_arrays(cls, item_ids, token_ids) -> ItemTokens:
        item_ids = np.asarray(item_ids, dtype=np.int64).reshape(-1)
        token_ids = np.asarray(token_ids)
        if token_ids.ndim != 2 or len(token_ids) != len(item_ids):
            raise ValueError(f"token_ids must be [N, L] with N = {len(item_ids)}, got {token_ids.shape}")
        narrow = token_ids.size == 0 or (int(token_ids.min()) >= 0 and int(token_ids.max()) < 2**31)
        order = argsort_ids(item_ids)  # [N]
        item_ids, token_ids = item_ids[order], token_ids.astype(np.int32 if narrow else np.int64, copy=False)[order]
        dup = np.flatnonzero(item_ids[1:] == item_ids[:-1])
        if len(dup):
            raise ValueError(f"duplicate item ids: {format_rows(np.unique(item_ids[dup]))}")
        return cls(item_ids=item_ids, token_ids=token_ids)

    @property
    def levels(self) -> int:
        return self.token_ids.shape[1]

    def lookup(self, item_ids) -> tuple[np.ndarray, np.ndarray]:
        """item ids [U] -> (token ids [U, L], known [U] bool); unknown rows hold -1."""
        item_ids = np.asarray(item_ids, dtype=np.int64)
        if len(self.item_ids) == 0:
            return np.full((len(item_ids), self.levels), -1, dtype=np.int64), np.zeros(len(item_ids), bool)
        pos = np.minimum(np.searchsorted(self.item_ids, item_ids), len(self.item_ids) - 1)  # [U]
        known = self.item_ids[pos] == item_ids  # [U]
        return np.where(known[:, None], self.token_ids[pos].astype(np.int64), -1), known


@dataclass
class Catalog:
    item_ids: torch.Tensor  # [N] int64, in the order of `tokens`: the first listed item of each semantic ID
    tokens: torch.Tensor  # [N, L] int64, rows sorted lexicographically, unique
    vocab_size: int
    node_ptr: torch.Tensor  # [G + 1] int64: node g's children are edges node_ptr[g] .. node_ptr[g + 1] - 1
    edge_tok: torch.Tensor  # [G - 1] int64: edge e leads to node e + 1 through this token
    edge_key: torch.Tensor  # [G - 1] int64: parent * vocab_size + token, ascending
    level_start: list[int]  # [L + 2]: first node id of each level (level_start[L + 1] = G)
    max_children: list[int]  # per level t < L: the largest number of children of one node
    leaf_count: torch.Tensor  # [G] int64: items under each node
    item_tokens: ItemTokens  # every input item (the item index: those not recommendable and those dropped as
    # duplicates included) -> its token ids, what prompts are rendered with
    group_ptr: torch.Tensor  # [N + 1] int64: semantic ID r (row r of `tokens`) lists items listed[group_ptr[r] ..
    # group_ptr[r + 1] - 1]
    listed: torch.Tensor  # [P] int64: the items a list may hold, grouped by semantic ID, each group best first
    expand: bool = False  # a semantic ID lists every item it may (`expand`), else the first (`first`, `by`)
    duplicates: list[tuple[int, int]] = field(default_factory=list)  # (dropped item, kept item) sharing one semantic ID
    collisions: tuple[int, int] = (0, 0)  # semantic IDs of more than one recommendable item, and the items they name

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_token_ids(
        cls,
        item_ids,
        token_ids,
        vocab_size: int,
        on_duplicate: str = "error",
        device: torch.device | str | None = None,
        recommendable=None,
        order=None,
    ) -> Catalog:
        """item_ids [N]; token_ids [N, L] (tensor, array or list of rows; ragged rows are an error); recommendable
        [N] bool: the items a list may hold (None: every item). The index holds the recommendable items only; every
        item stays in `item_tokens`, since histories may name any of them. Items that share a semantic ID:
        on_duplicate="error" refuses any two of the catalog, recommendable or not (whether the catalog is valid does
        not change with tonight's set); "first": the first recommendable one keeps it in the index, and the other
        recommendable ones are listed in `duplicates`; "by" and "expand": the semantic ID keeps every recommendable
        item, in `order` [N] (lower first, e.g. a column's rank; None: by item id), ties by input row."""
        if on_duplicate not in ("error", "first", "by", "expand"):
            raise ValueError(f"on_duplicate must be error, first, by or expand, got {on_duplicate!r}")
        vocab_size = int(vocab_size)  # a Python int: vocab_size ** L must not wrap (numpy integers do)
        token_ids = _as_matrix(token_ids)
        item_ids = torch.as_tensor(item_ids, dtype=torch.int64).reshape(-1)
        n, code_len = token_ids.shape
        if item_ids.numel() != n:
            raise ValueError(f"item_ids has {item_ids.numel()} entries but token_ids has {n} rows")
        if n == 0 or code_len == 0:
            raise ValueError(f"the catalog is empty: token_ids has shape {tuple(token_ids.shape)}")
        bad = ((token_ids < 0) | (token_ids >= vocab_size)).any(1).nonzero().flatten()
        if bad.numel():
            raise ValueError(
                f"token ids outside [0, {vocab_size}) in rows {format_rows(bad)} "
                f"(item ids {format_rows(item_ids[bad])})"
            )
        item_tokens = ItemTokens.from_arrays(item_ids.cpu().numpy(), token_ids.cpu().numpy())  # checks: unique ids
        rows = _recommendable_rows(recommendable, n)  # [N'] the rows the index holds (None: every row)
        if rows is not None and on_duplicate == "error":  # the policy is the item index's, not tonight's subset's
            everything = _lexsort(token_ids, vocab_size)
            first_of_each(token_ids[everything], item_ids[everything], everything, on_duplicate)
        rows = torch.arange(n) if rows is None else rows
        rows = rows[_policy_order(on_duplicate, _as_order(order, n), item_ids, rows)]  # [N'] a group's items in order
        input_row = rows[_lexsort(token_ids[rows], vocab_size)]  # [N'], stable: groups keep the policy's order
        tokens, ids, groups = _groups(token_ids[input_row], item_ids[input_row], input_row, on_duplicate)
        cat = cls(ids, tokens, vocab_size, *_csr(tokens, vocab_size), item_tokens, **groups)
        return cat.to(device) if device is not None else cat

    @classmethod
    def from_parquet(cls, path, tokenizer, on_duplicate: str = "error", device=None, code_token=code_token) -> Catalog:
        """Builds the catalog from `items.parquet` (`item_id`, `semantic_id` list of L codes) and a tokenizer
        whose vocabulary holds the code tokens `<a_12>`, `<b_3>`, ... (level letter, code)."""
        import pyarrow.dataset as pads  # the one file this module reads, outside any decoding path

        data = pads.dataset(path, format="parquet")
        wanted = ("item_id", "semantic_id", duplicate_policy(on_duplicate)[1])
        table = data.to_table(columns=[c for c in wanted if c in data.schema.names])
        return cls.from_table(table, tokenizer, on_duplicate, device, str(path), code_token)

    @classmethod
    def from_table(
        cls,
        table,
        tokenizer,
        on_duplicate: str = "error",
        device=None,
        source: str = "items.parquet",
        code_token=code_token,
        recommendable=None,
    ) -> Catalog:
        """The one parser of a catalog table (`item_id`, `semantic_id`, and the column a `by:` or `expand:` policy
        names), read from anywhere: the index (of the `recommendable` rows [N] bool, None: all) and the item-to-tokens
        map of prompts (every row), from one pass over the semantic IDs. on_duplicate: a policy (`duplicate_policy`).
        code_token(level, code) names the code tokens (a prompt template's `code`); every one the catalog needs must
        be in the tokenizer."""
        kind, column = duplicate_policy(on_duplicate)
        if "item_id" not in table.column_names:
            raise ValueError(f"{source}: missing column 'item_id' (has {table.column_names})")
        if table.column("item_id").null_count:
            nulls = np.flatnonzero(table.column("item_id").is_null().to_numpy(zero_copy_only=False))
            raise ValueError(f"{source}: column 'item_id' is null in rows {format_rows(nulls)}")
        codes = semantic_id_matrix(table, source)  # [N, L], checked: not ragged, no nulls, no negatives
        try:
            token_ids = code_token_ids(tokenizer, codes, code_token)  # [N, L]
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        item_ids = table.column("item_id").to_numpy().astype(np.int64)
        order = column_rank(table, column, source) if column else None
        try:
            return cls.from_token_ids(
                torch.from_numpy(item_ids),
                torch.from_numpy(token_ids),
                len(tokenizer),
                kind,
                device,
                recommendable,
                order,
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to(self, device) -> Catalog:
        """The index on `device` (the item-to-tokens map stays on the CPU, where prompts are rendered)."""
        return replace(
            self,
            item_ids=self.item_ids.to(device),
            tokens=self.tokens.to(device),
            node_ptr=self.node_ptr.to(device),
            edge_tok=self.edge_tok.to(device),
            edge_key=self.edge_key.to(device),
            leaf_count=self.leaf_count.to(device),
            group_ptr=self.group_ptr.to(device),
            listed=self.listed.to(device),
        )

    @property
    def code_len(self) -> int:
        return self.tokens.shape[1]

    def listing_sha256(self) -> str:
        """What a list draws from besides the index's item ids and semantic IDs: the items each semantic ID lists, in
        order (the duplicate policy's outcome: `first`'s kept item, the order `by:` and `expand:` take from their
        column), and whether it lists all of them (`expand`). sha256 over little-endian int64s."""
        h = hashlib.sha256(np.array([self.expand, len(self)], dtype="<i8").tobytes())
        h.update(self.group_ptr.cpu().numpy().astype("<i8").tobytes())
        h.update(self.listed.cpu().numpy().astype("<i8").tobytes())
        return h.hexdigest()

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def __len__(self) -> int:
        return self.tokens.shape[0]

    # ---------------------------------------------------------------- CSR transition index

    def node_of(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix [R, t] -> trie node id [R], -1 where the prefix is not in the catalog."""
        node = torch.zeros(prefix.shape[0], dtype=torch.int64, device=self.device)
        for level in range(prefix.shape[1]):
            node = self.child_node(node, prefix[:, level])
        return node

    def child_node(self, node: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """node [R] (-1 = none), token [R] -> the child reached by the token [R], -1 if there is none."""
        query = node.clamp(min=0) * self.vocab_size + token.clamp(min=0, max=self.vocab_size - 1)
        edge = torch.searchsorted(self.edge_key, query).clamp(max=self.edge_key.numel() - 1)  # [R]
        found = (node >= 0) & (token >= 0) & (token < self.vocab_size) & (self.edge_key[edge] == query)
        return torch.where(found, edge + 1, -1)

    def children(self, node: torch.Tensor, width: int | None = None):
        """node [R] (any levels, -1 = none) -> (tokens [R, D], child nodes [R, D], valid [R, D]), D = `width`
        (default: the widest node of any level); children in ascending token order, padding has token 0."""
        width = max(self.max_children) if width is None else width
        start = self.node_ptr[node.clamp(min=0)]  # [R]
        count = torch.where(node >= 0, self.node_ptr[node.clamp(min=0) + 1] - start, 0)  # [R]
        offset = torch.arange(width, device=self.device)  # [D]
        valid = offset < count[:, None]  # [R, D]
        edge = torch.where(valid, start[:, None] + offset, 0)  # [R, D]
        return torch.where(valid, self.edge_tok[edge], 0), torch.where(valid, edge + 1, -1), valid

    def num_children(self, node: torch.Tensor) -> torch.Tensor:
        return self.node_ptr[node + 1] - self.node_ptr[node]

    def level_of(self, node: torch.Tensor) -> torch.Tensor:
        """node ids [*] -> their levels (prefix lengths) [*]."""
        starts = torch.tensor(self.level_start[1:-1], device=self.device)
        return torch.searchsorted(starts, node, right=True)

    def allowed_next(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix [R, t] (0 <= t < L) -> bool [R, vocab_size]: the exact set of valid next tokens."""
        rows, t = prefix.shape
        if not 0 <= t < self.code_len:
            raise ValueError(f"prefix length {t} outside [0, {self.code_len})")
        tokens, _, valid = self.children(self.node_of(prefix.to(self.device)), self.max_children[t])  # [R, D]
        mask = torch.zeros(rows, self.vocab_size + 1, dtype=torch.bool, device=self.device)
        column = torch.where(valid, tokens, self.vocab_size)  # padding lands in a spare last column
        return mask.scatter_(1, column, True)[:, : self.vocab_size]

    def item_of_node(self, node: torch.Tensor) -> torch.Tensor:
        """Node ids [*] -> item ids [*] for leaves (the level-L nodes are the sorted rows), -1 otherwise."""
        row = node - self.level_start[self.code_len]
        return torch.where(row >= 0, self.item_ids[row.clamp(0, len(self) - 1)], -1)

    @property
    def num_nodes(self) -> int:
        """G: the trie's nodes, root and leaves included."""
        return self.node_ptr.numel() - 1

    @cached_property
    def parent(self) -> torch.Tensor:
        """[G] int64: each node's parent, -1 for the root (node n is reached by edge n - 1); computed once per
        catalog (and device)."""
        root = torch.full((1,), -1, dtype=torch.int64, device=self.device)
        return torch.cat([root, self.edge_key // self.vocab_size])

    def leaf_of(self, item_ids: torch.Tensor) -> torch.Tensor:
        """Item ids [M] -> their leaf nodes [M]; -1 for an id the index does not hold (not in the catalog, not
        recommendable, or dropped by `first` for sharing another item's semantic ID: that item is a different one)."""
        at = self.position_of(item_ids)  # [M]
        return torch.where(at >= 0, self.level_start[self.code_len] + self.row_of(at), -1)

    def position_of(self, item_ids: torch.Tensor) -> torch.Tensor:
        """Item ids [M] -> their positions in `listed` [M]; -1 for an id the index does not list."""
        ids, where = self._by_id
        query, order = torch.sort(torch.as_tensor(item_ids, dtype=torch.int64).to(self.device), stable=True)
        at = torch.searchsorted(ids, query).clamp(max=len(ids) - 1)  # [M] walk the ids in order: cache-friendly
        found = torch.where(ids[at] == query, where[at], -1)
        return torch.empty_like(found).scatter_(0, order, found)

    def row_of(self, position: torch.Tensor) -> torch.Tensor:
        """Positions in `listed` [M] (>= 0) -> the semantic ID (row of `tokens`) that lists each [M]."""
        return position if len(self.listed) == len(self) else self._row[position]

    @cached_property
    def _row(self) -> torch.Tensor:
        """[P] the semantic ID of each position in `listed` (a gather is many times faster than a binary search per
        position): computed once per catalog (and device) that lists several items for one semantic ID."""
        rows = torch.arange(len(self), device=self.device)
        return torch.repeat_interleave(rows, torch.diff(self.group_ptr), output_size=len(self.listed))

    @cached_property
    def _by_id(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(listed item ids sorted [P], the position of each in `listed` [P]): computed once per catalog (and
        device)."""
        return torch.sort(self.listed)

    # ---------------------------------------------------------------- a user's list from its semantic IDs

    def listing(self, node: torch.Tensor, exclude: Exclusions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each user's semantic IDs, best first: leaves node [B, K] (-1 = none; row b is `exclude`'s row b) -> the
        user's list: item ids [B, K] and the column of `node` each comes from [B, K] (-1 and -1 past its end). A
        semantic ID names the first of its items (in the policy's order) that its user may take: one that `exclude`
        does not exclude; with `expand` every such item, one entry each, semantic IDs in turn, the list cut at K
        entries. A decoder never returns a closed leaf, so each semantic ID names at least one item. No Python loop:
        of each group only the positions that can matter are gathered, all at once (the first `need` items, 1 or K,
        and as many more as the user excludes in the group)."""
        b, k = node.shape
        if not self.expand and len(self.listed) == len(self):  # one item per semantic ID: its leaf's
            return self.item_of_node(node), torch.where(node >= 0, torch.arange(k, device=node.device), -1)
        row = torch.where(node >= 0, node - self.level_start[self.code_len], -1)  # [B, K]
        start = self.group_ptr[row.clamp(min=0)]  # [B, K]
        size = torch.where(row >= 0, self.group_ptr[row + 1] - start, 0)  # [B, K]
        skip = exclude.within(start, size) if exclude is not None else torch.zeros_like(size)  # [B, K]
        take = torch.minimum(size, (k if self.expand else 1) + skip).flatten()  # [B K]
        seg = torch.repeat_interleave(torch.arange(b * k, device=node.device), take)  # [T] entry -> (user, column)
        begin = take.cumsum(0) - take  # [B K] each segment's first entry
        pos = start.flatten()[seg] + torch.arange(len(seg), device=node.device) - begin[seg]  # [T] in `listed`
        ok = ~exclude.has(seg // k, pos) if exclude is not None else torch.ones_like(pos, dtype=torch.bool)  # [T]
        group = begin[seg - seg % k] if self.expand else begin[seg]  # [T] the first entry of its user / segment
        count = ok.long().cumsum(0)
        rank = count - (count - ok.long())[group] - 1  # [T] the entry's place among its user's / segment's items
        keep = ok & (rank < k if self.expand else rank == 0)
        slot = seg // k * k + rank if self.expand else seg  # [T] where a kept entry goes in the flat [B K] list
        items = torch.full((b * k,), -1, dtype=torch.int64, device=node.device)
        source = torch.full_like(items, -1)
        items[slot[keep]] = self.listed[pos[keep]]
        source[slot[keep]] = seg[keep] % k
        return items.view(b, k), source.view(b, k)

    # ---------------------------------------------------------------- PPV: binary search in sorted rows

    def verify(self, prefix: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """PPV. prefix [R, t], candidates [R, M] -> bool [R, M]: is prefix + candidate a prefix of an item."""
        rows, t = prefix.shape
        m = candidates.shape[1]
        if not 0 <= t < self.code_len:
            raise ValueError(f"prefix length {t} outside [0, {self.code_len})")
        query = torch.cat(
            [prefix.to(self.device)[:, None, :].expand(rows, m, t), candidates.to(self.device)[:, :, None]], dim=2
        ).reshape(rows * m, t + 1)
        idx = self._lower_bound(query)  # [R*M]
        hit = (self.tokens[idx.clamp(max=len(self) - 1), : t + 1] == query).all(1) & (idx < len(self))
        return hit.view(rows, m)

    def lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [R, L] -> item ids [R], -1 when the row is not an item of the catalog."""
        query = token_ids.to(self.device)
        if query.shape[1] != self.code_len:
            raise ValueError(f"lookup needs rows of length {self.code_len}, got {query.shape[1]}")
        idx = self._lower_bound(query).clamp(max=len(self) - 1)
        hit = (self.tokens[idx] == query).all(1)
        return torch.where(hit, self.item_ids[idx], -1)

    def _lower_bound(self, query: torch.Tensor) -> torch.Tensor:
        """query [Q, t] -> [Q]: first row of the sorted matrix whose first t tokens are >= query (lexicographic)."""
        q, t = query.shape
        lo = torch.zeros(q, dtype=torch.int64, device=self.device)
        hi = torch.full((q,), len(self), dtype=torch.int64, device=self.device)
        for _ in range(len(self).bit_length()):
            mid = (lo + hi) // 2  # [Q]
            row = self.tokens[mid.clamp(max=len(self) - 1), :t]  # [Q, t]
            less = _lex_less(row, query) & (mid < hi)  # row < query: the answer lies right of mid
            lo = torch.where(less, mid + 1, lo)
            hi = torch.where(less, hi, mid)
        return lo


# -------------------------------------------------------------------- per-user exclusions


@dataclass
class Exclusions:
    """One batch's per-user exclusions (items a user must not be recommended) as the trie nodes they close: a node is
    closed for a user once every item under it is excluded (a leaf, a semantic ID, closes when all its listed items
    are; a node closes when all its children are closed), and no decoder ever makes a closed node a candidate. Per
    level t = 0 .. L, the sorted keys user * G + node of the closed nodes; the closed leaves under any node (what DISC
    adds to the semantic IDs its draws exclude) are counted against `leaf_count` on demand (`counts`). The excluded
    items themselves (`items`) decide which items of an open semantic ID its user's list names
    (`Catalog.listing`). `rows` says which user each row of a decoder's tensors stands for: selecting users (a
    slice of the batch, finished users leaving) gathers rows and leaves the keys alone. Built once per batch on the
    catalog's device with one sort (of the (user, item) pairs), then linear passes, one per level; no Python loop
    over users or items."""

    leaves: torch.Tensor  # [M] int64, sorted, unique: user * G + leaf, each user's closed semantic IDs
    closed: list[torch.Tensor]  # per level t = 0 .. L: [C_t] int64, sorted: user * G + node of its closed nodes
    rows: torch.Tensor  # [A] int64: the user (0 .. B - 1) of each row
    nodes: int  # G, the catalog's trie nodes
    level_start: list[int]  # the catalog's: level t's nodes are level_start[t] .. level_start[t + 1] - 1
    parent: torch.Tensor  # [G] the catalog's parent of each node (counts walk the paths up)
    items: torch.Tensor  # [E] int64, sorted, unique: user * P + position in catalog.listed, each user's excluded items
    positions: int  # P, the catalog's listed items

    @classmethod
    def from_items(cls, catalog: Catalog, user, item_ids, users: int) -> Exclusions:
        """Pairs (user [M] in 0 .. users - 1, item id [M]): repeats count once; ids the index does not list are
        ignored (they cannot be recommended anyway)."""
        user = torch.as_tensor(user, dtype=torch.int64).to(catalog.device).reshape(-1)
        at = catalog.position_of(torch.as_tensor(item_ids, dtype=torch.int64).reshape(-1))  # [M]
        if user.shape != at.shape:
            raise ValueError(f"user has {user.numel()} entries but item_ids {at.numel()}")
        if user.numel() and not (0 <= int(user.min()) and int(user.max()) < users):
            raise ValueError(f"users must lie in [0, {users}), got {int(user.min())} .. {int(user.max())}")
        g, p, leaves_at = catalog.num_nodes, len(catalog.listed), catalog.level_start[catalog.code_len]
        # a stable sort of non-negative integers is a radix sort on the CPU (unknown ids sort last, then drop)
        key = torch.sort(torch.where(at >= 0, user * p + at, users * p), stable=True).values
        items = torch.unique_consecutive(key[: key.numel() - int((at < 0).sum())])  # [E] distinct, sorted
        leaves = items // p * g + leaves_at + catalog.row_of(items % p)  # [E] sorted: a group's positions are one run
        if p != len(catalog):  # semantic IDs of several items: a leaf closes once all of its items are excluded
            leaves, hits = torch.unique_consecutive(leaves, return_counts=True)  # [M'] (user, semantic ID) pairs
            row = leaves % g - leaves_at
            leaves = leaves[hits == catalog.group_ptr[row + 1] - catalog.group_ptr[row]]
        closed, who, node = [leaves], leaves // g, leaves % g
        for _ in range(catalog.code_len):  # level by level up to the root: nodes are numbered in prefix order, so the
            # parents of a level's sorted closed keys come sorted, and equal ones adjacent
            parent = catalog.parent[node]
            up, shut_children = torch.unique_consecutive(who * g + parent, return_counts=True)  # [P]
            first = shut_children.cumsum(0) - shut_children  # [P] each run's first child
            shut = (shut_children == catalog.num_children(parent[first])).nonzero().flatten()  # all children closed
            closed.insert(0, up[shut])
            who, node = who[first[shut]], parent[first[shut]]
        rows = torch.arange(users, device=catalog.device)
        return cls(leaves, closed, rows, g, list(catalog.level_start), catalog.parent, items, p)

    @classmethod
    def none(cls, catalog: Catalog, users: int) -> Exclusions:
        """No exclusions for `users` users (the same answers as passing None, at a search's cost)."""
        return cls.from_items(catalog, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), users)

    @cached_property
    def counts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per level t = 0 .. L: (sorted keys user * G + node of the nodes on a closed leaf's path [E_t], the user's
        closed leaves under each [E_t]), from the leaves up (computed on first use: DISC's)."""
        g = self.nodes
        key, count = self.leaves, torch.ones_like(self.leaves)
        out = [(key, count)]
        for _ in range(len(self.level_start) - 2):  # the L levels above the leaves
            key, inverse = torch.unique_consecutive(key - key % g + self.parent[key % g], return_inverse=True)
            count = torch.zeros_like(key).index_add_(0, inverse, count)
            out.insert(0, (key, count))
        return out

    def to(self, device) -> Exclusions:
        """The same exclusions on `device`."""
        return replace(
            self,
            leaves=self.leaves.to(device),
            closed=[c.to(device) for c in self.closed],
            rows=self.rows.to(device),
            parent=self.parent.to(device),
            items=self.items.to(device),
        )

    def select(self, rows: torch.Tensor) -> Exclusions:
        """The rows [A'] of the current rows (a slice of the batch, or the users still decoding)."""
        return replace(self, rows=self.rows[rows])

    def _keys(self, node: torch.Tensor) -> torch.Tensor:
        """node [A', ...] (row r of the first A' rows) -> the keys user * G + node [A', ...]."""
        return self.rows[: node.shape[0]].view(-1, *([1] * (node.dim() - 1))) * self.nodes + node.clamp(min=0)

    def excluded(self, node: torch.Tensor) -> torch.Tensor:
        """node [A', ...] (row r of the first A' rows; -1 = none) -> the row's user's closed leaves (semantic IDs all
        of whose items are excluded) under it [A', ...] (0 for none)."""
        query = self._keys(node)
        total = sum(count_at(k, c, query) for k, c in self.counts)  # a node is of one level only
        return torch.where(node >= 0, total, 0)

    def open(self, node: torch.Tensor) -> torch.Tensor:
        """node [A', ...] (-1 = none) -> bool [A', ...]: the node holds an item its row's user may still get. Only the
        real nodes are looked up, each in its own level's closed keys."""
        live = node >= 0
        where = live.nonzero(as_tuple=True)
        child = node[where]  # [R] the real nodes
        query = self.rows[where[0]] * self.nodes + child  # [R] their keys
        lo, hi = (bisect.bisect_right(self.level_start, int(x)) - 1 for x in child.aminmax()) if len(child) else (0, -1)
        shut = torch.zeros_like(query, dtype=torch.bool)
        if lo == hi and self.closed[lo].numel():  # beam search asks about one level at a time
            shut = found_in(self.closed[lo], query)
        elif lo < hi:  # speculative decoding about several
            level = torch.searchsorted(torch.tensor(self.level_start[1:-1], device=node.device), child, right=True)
            for t in range(lo, hi + 1):
                if self.closed[t].numel():
                    at = (level == t).nonzero().flatten()
                    shut[at] = found_in(self.closed[t], query[at])
        return live.index_put_(where, ~shut)

    def per_user(self) -> torch.Tensor:
        """[A] each row's excluded items that the index lists (distinct)."""
        first = self.rows * self.positions
        return torch.searchsorted(self.items, first + self.positions) - torch.searchsorted(self.items, first)

    def within(self, start: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
        """Runs of positions in catalog.listed start, size [A', ...] (row r of the first A' rows) -> how many of each
        run the row's user excludes [A', ...]."""
        first = self.rows[: start.shape[0]].view(-1, *([1] * (start.dim() - 1))) * self.positions + start
        return torch.searchsorted(self.items, first + size) - torch.searchsorted(self.items, first)

    def has(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """row [T] (of the current rows), position in catalog.listed [T] -> bool [T]: the row's user excludes it."""
        if not self.items.numel():
            return torch.zeros_like(position, dtype=torch.bool)
        return found_in(self.items, self.rows[row] * self.positions + position)


def count_at(key: torch.Tensor, count: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Sorted unique keys [E] with counts [E], query keys [...] -> each query's count [...] (0 where absent)."""
    if key.numel() == 0:
        return torch.zeros_like(query)
    at = torch.searchsorted(key, query).clamp(max=key.numel() - 1)
    return torch.where(key[at] == query, count[at], 0)


def found_in(key: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Sorted keys [E] (E >= 1), query keys [...] -> bool [...]: the query is one of the keys."""
    return key[torch.searchsorted(key, query).clamp(max=key.numel() - 1)] == query


# -------------------------------------------------------------------- helpers


def _as_matrix(token_ids) -> torch.Tensor:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be [N, L], got shape {tuple(token_ids.shape)}")
        return token_ids.to(torch.int64)
    rows = [list(r) for r in token_ids]
    lens = torch.tensor([len(r) for r in rows])
    if lens.numel() and (lens != lens[0]).any():
        common = lens[0] if 2 * int((lens == lens[0]).sum()) >= len(lens) else torch.mode(lens).values
        bad = (lens != common).nonzero().flatten()
        raise ValueError(
            f"ragged code lengths: rows {format_rows(bad)} have lengths {format_rows(lens[bad])}, "
            f"expected {int(common)}"
        )
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)


def _recommendable_rows(recommendable, n: int) -> torch.Tensor | None:
    """recommendable [N] bool (None: every item) -> the rows it keeps [N'] (None: every row); refused when it keeps
    none or does not match the catalog."""
    if recommendable is None:
        return None
    keep = torch.as_tensor(np.asarray(recommendable, dtype=bool).reshape(-1))  # [N]
    if keep.numel() != n:
        raise ValueError(f"recommendable has {keep.numel()} entries but the catalog {n} items")
    if not keep.any():
        raise ValueError(f"none of the catalog's {n} items is recommendable: a list could hold nothing")
    return None if keep.all() else keep.nonzero().flatten()


def _as_order(order, n: int) -> torch.Tensor | None:
    """order [N] (any numbers, lower first; None: none) -> a tensor [N], refused when it does not match the catalog."""
    if order is None:
        return None
    order = torch.as_tensor(np.asarray(order)).reshape(-1)
    if order.numel() != n:
        raise ValueError(f"order has {order.numel()} entries but the catalog {n} items")
    return order


def _policy_order(kind: str, order: torch.Tensor | None, item_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The index's rows [N'] (ascending) -> the permutation [N'] of them in the order a semantic ID lists its items:
    input order (first, error), else by `order` [N] (lower first; None: none), ties by item id (lowest first)."""
    if kind in ("first", "error"):
        return torch.arange(len(rows))
    perm = torch.sort(item_ids[rows], stable=True).indices  # [N']
    return perm if order is None else perm[torch.sort(order[rows[perm]], stable=True).indices]


def _first_rows(tokens: torch.Tensor) -> torch.Tensor:
    """Rows sorted by semantic ID [N, L] -> [N] bool: the first row of each semantic ID."""
    first = torch.ones(len(tokens), dtype=torch.bool)
    first[1:] = (tokens[1:] != tokens[:-1]).any(1)
    return first


def _groups(tokens: torch.Tensor, item_ids: torch.Tensor, input_row: torch.Tensor, on_duplicate: str):
    """Rows sorted by semantic ID, each semantic ID's items in the policy's order: tokens [N, L], item ids [N], input
    rows [N] -> (each semantic ID's tokens [N', L] and first item [N'], the catalog's fields of its groups: group_ptr,
    listed, expand, shared, and under `first` the duplicates it dropped)."""
    first = _first_rows(tokens)  # [N]
    ptr = torch.cat([first.nonzero().flatten(), torch.tensor([len(first)])])  # [N' + 1]
    size = ptr.diff()  # [N'] items per semantic ID
    info = {"expand": on_duplicate == "expand", "collisions": (int((size > 1).sum()), int(size[size > 1].sum()))}
    if on_duplicate in ("by", "expand"):
        return tokens[first], item_ids[first], {"group_ptr": ptr, "listed": item_ids, **info}
    tokens, item_ids, duplicates = first_of_each(tokens, item_ids, input_row, on_duplicate)
    one = {"group_ptr": torch.arange(len(item_ids) + 1), "listed": item_ids, "duplicates": duplicates}
    return tokens, item_ids, {**one, **info}


def first_of_each(tokens: torch.Tensor, item_ids: torch.Tensor, input_row: torch.Tensor, on_duplicate: str):
    """Rows sorted by semantic ID tokens [N, L], their item ids [N] and input rows [N] -> (the first row of each
    semantic ID's tokens and item id, [(dropped item, kept item)]); on_duplicate "error": a shared semantic ID is
    refused, naming the input rows and items."""
    n = len(tokens)
    first = _first_rows(tokens)  # [N]
    if first.all():
        return tokens, item_ids, []
    dup = (~first).nonzero().flatten()
    kept = torch.cummax(torch.where(first, torch.arange(n), 0), 0).values[dup]
    if on_duplicate == "error":
        raise ValueError(
            f"{dup.numel()} items share a semantic ID with another item, e.g. input rows "
            f"{format_rows(input_row[dup])} repeat rows {format_rows(input_row[kept])} "
            f"(item ids {format_rows(item_ids[dup])} vs {format_rows(item_ids[kept])}); "
            "choose a duplicate policy (duplicate_items): first keeps the first item, by:COLUMN the one with the "
            "highest value of a catalog column, expand every item"
        )
    return tokens[first], item_ids[first], list(zip(item_ids[dup].tolist(), item_ids[kept].tolist()))


def argsort_ids(ids: np.ndarray) -> np.ndarray:
    """Item ids [N] int64 -> the permutation [N] sorting them, stable (torch's radix sort: numpy's stable argsort of
    int64 is a merge sort, several times slower at millions of items)."""
    return torch.sort(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), stable=True).indices.numpy()


def _lexsort(rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] token ids in [0, vocab_size) -> permutation [N] sorting rows lexicographically, stable. One sort of the
    rows as base-vocab_size numbers when those fit an int64 (the same order: the map is monotone), else an LSD radix
    of stable sorts, one per column."""
    n, levels = rows.shape
    if vocab_size**levels < 2**63:
        key = torch.zeros(n, dtype=torch.int64, device=rows.device)
        for col in range(levels):
            key.mul_(vocab_size).add_(rows[:, col])
        return torch.sort(key, stable=True).indices
    order = torch.arange(n, device=rows.device)
    for col in reversed(range(levels)):
        order = order[torch.sort(rows[order, col], stable=True).indices]
    return order


def _lex_less(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [Q, t] -> bool [Q]: a < b lexicographically."""
    if a.shape[1] == 0:
        return torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    diff = a != b  # [Q, t]
    first = diff.int().argmax(1, keepdim=True)  # first differing column (0 when equal)
    return diff.any(1) & (a.gather(1, first) < b.gather(1, first)).squeeze(1)


def _csr(tokens: torch.Tensor, vocab_size: int):
    """Sorted unique rows [N, L] -> the global CSR trie: node_ptr [G + 1], edge_tok [G - 1], edge_key [G - 1],
    level_start [L + 2], max_children [L], leaf_count [G]. Nodes are numbered level by level, prefixes sorted
    within a level, so each node's items are a contiguous run of rows."""
    n, code_len = tokens.shape
    counts, edge_tok, parent_of_edge, level_start = [], [], [], [0, 1]
    first_rows = [torch.zeros(1, dtype=torch.int64, device=tokens.device)]  # per level: each node's first row
    new_prefix = torch.zeros(n, dtype=torch.bool, device=tokens.device)
    new_prefix[0] = True  # level 0: one node, the root
    for t in range(code_len):
        # row r starts a new prefix of length t + 1 if its first t + 1 tokens differ from row r - 1
        starts_child = new_prefix.clone()
        starts_child[1:] |= tokens[1:, t] != tokens[:-1, t]
        parent = torch.cumsum(new_prefix.long(), 0) - 1  # [N] level-t node (local id) of each row
        child_rows = starts_child.nonzero().flatten()  # first row of each level-(t + 1) node
        counts.append(torch.bincount(parent[child_rows], minlength=int(parent[-1]) + 1))  # [U_t]
        edge_tok.append(tokens[child_rows, t])
        parent_of_edge.append(parent[child_rows] + level_start[t])  # global id of the parent
        level_start.append(level_start[-1] + len(child_rows))
        first_rows.append(child_rows)
        new_prefix = starts_child
    counts.append(torch.zeros(n, dtype=torch.int64, device=tokens.device))  # the leaves have no children
    node_ptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=tokens.device), torch.cat(counts).cumsum(0)])
    edge_tok = torch.cat(edge_tok)
    edge_key = torch.cat(parent_of_edge) * vocab_size + edge_tok
    end = torch.full((1,), n, dtype=torch.int64, device=tokens.device)
    leaf_count = torch.cat([torch.cat([f, end]).diff() for f in first_rows])
    return node_ptr, edge_tok, edge_key, level_start, [int(c.max()) for c in counts[:-1]], leaf_count
