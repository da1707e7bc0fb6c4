"""GPU catalog index: which semantic-ID token sequences are real items.

The catalog is N items, each a row of L token ids. Rows are kept lexicographically sorted on the
catalog's device, and two structures are derived from them:

- PPV (parallel prefix verification, DISC paper Algorithm 2): a vectorised binary search of
  `prefix + candidate` rows in the sorted matrix (`verify`, `lookup`).
- CSR transition index: per level t, the sorted unique prefixes of length t are the trie's nodes;
  `child_ptr[t][u] : child_ptr[t][u + 1]` is the range of node u's children, `child_tok[t]` their
  tokens (ascending). A child's position in that range is also its node id at level t + 1, so
  beam search walks the trie by node id, and `allowed_next` gathers whole child ranges at once.

No Python loop runs over rows, beams or users; loops run over the L levels or log2(N) bisection steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from decoding.codes import code_token_ids, format_rows, semantic_id_matrix


@dataclass
class Catalog:
    item_ids: torch.Tensor  # [N] int64, in the order of `tokens`
    tokens: torch.Tensor  # [N, L] int64, rows sorted lexicographically, unique
    vocab_size: int
    child_ptr: list[torch.Tensor]  # per level t: [U_t + 1] int64, U_0 = 1 (the root)
    child_tok: list[torch.Tensor]  # per level t: [U_{t+1}] int64, children's tokens, ascending per node
    child_key: list[torch.Tensor]  # per level t: [U_{t+1}] int64, parent * vocab_size + token, ascending
    max_children: list[int]  # per level t: the largest number of children of one node
    duplicates: list[tuple[int, int]] = field(default_factory=list)  # (dropped item, kept item) sharing one semantic ID

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_token_ids(cls, item_ids, token_ids, vocab_size: int, on_duplicate: str = "error",
                       device: torch.device | str | None = None) -> "Catalog":
        """item_ids [N]; token_ids [N, L] (tensor, array or list of rows; ragged rows are an error)."""
        if on_duplicate not in ("error", "first"):
            raise ValueError(f"on_duplicate must be 'error' or 'first', got {on_duplicate!r}")
        token_ids = _as_matrix(token_ids)
        item_ids = torch.as_tensor(item_ids, dtype=torch.int64).reshape(-1)
        n, code_len = token_ids.shape
        if item_ids.numel() != n:
            raise ValueError(f"item_ids has {item_ids.numel()} entries but token_ids has {n} rows")
        if n == 0 or code_len == 0:
            raise ValueError(f"the catalog is empty: token_ids has shape {tuple(token_ids.shape)}")
        bad = ((token_ids < 0) | (token_ids >= vocab_size)).any(1).nonzero().flatten()
        if bad.numel():
            raise ValueError(f"token ids outside [0, {vocab_size}) in rows {format_rows(bad)} "
                             f"(item ids {format_rows(item_ids[bad])})")
        ids_sorted, _ = item_ids.sort()
        rep = ids_sorted[1:][ids_sorted[1:] == ids_sorted[:-1]].unique()
        if rep.numel():
            raise ValueError(f"duplicate item ids: {format_rows(rep)}")

        order = _lexsort(token_ids)  # [N], stable: equal rows keep input order
        tokens, item_ids, input_row = token_ids[order], item_ids[order], order
        first = torch.ones(n, dtype=torch.bool)
        first[1:] = (tokens[1:] != tokens[:-1]).any(1)  # [N] first row of each semantic ID
        duplicates = []
        if not first.all():
            dup = (~first).nonzero().flatten()
            kept = torch.cummax(torch.where(first, torch.arange(n), 0), 0).values[dup]
            if on_duplicate == "error":
                raise ValueError(
                    f"{dup.numel()} items share a semantic ID with another item, e.g. input rows "
                    f"{format_rows(input_row[dup])} repeat rows {format_rows(input_row[kept])} "
                    f"(item ids {format_rows(item_ids[dup])} vs {format_rows(item_ids[kept])}); "
                    "pass on_duplicate='first' to keep the first item of each semantic ID")
            duplicates = list(zip(item_ids[dup].tolist(), item_ids[kept].tolist()))
            tokens, item_ids = tokens[first], item_ids[first]

        child_ptr, child_tok, child_key, max_children = _csr_levels(tokens, vocab_size)
        cat = cls(item_ids, tokens, int(vocab_size), child_ptr, child_tok, child_key, max_children, duplicates)
        return cat.to(device) if device is not None else cat

    @classmethod
    def from_parquet(cls, path, tokenizer, on_duplicate: str = "error", device=None) -> "Catalog":
        """Builds the catalog from `items.parquet` (`item_id`, `semantic_id` list of L codes) and a tokenizer
        whose vocabulary holds the code tokens `<a_12>`, `<b_3>`, ... (level letter, code)."""
        import pyarrow.parquet as pq  # the one file this module reads, outside any decoding path

        table = pq.read_table(path)
        if "item_id" not in table.column_names:
            raise ValueError(f"{path}: missing column 'item_id' (has {table.column_names})")
        codes = semantic_id_matrix(table, str(path))  # [N, L], checked: not ragged, no nulls, no negatives
        try:
            token_ids = code_token_ids(tokenizer, codes)  # [N, L]
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        item_ids = table.column("item_id").to_numpy().astype(np.int64)
        return cls.from_token_ids(torch.from_numpy(item_ids), torch.from_numpy(token_ids), len(tokenizer),
                                  on_duplicate, device)

    def to(self, device) -> "Catalog":
        move = lambda ts: [t.to(device) for t in ts]  # noqa: E731
        return Catalog(self.item_ids.to(device), self.tokens.to(device), self.vocab_size,
                       move(self.child_ptr), move(self.child_tok), move(self.child_key), self.max_children,
                       self.duplicates)

    @property
    def code_len(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def __len__(self) -> int:
        return self.tokens.shape[0]

    # ---------------------------------------------------------------- CSR transition index

    def node_of(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix [R, t] -> trie node id at level t [R], -1 where the prefix is not in the catalog."""
        rows, t = prefix.shape
        node = torch.zeros(rows, dtype=torch.int64, device=self.device)
        for level in range(t):
            node = self.child_node(level, node, prefix[:, level])
        return node

    def child_node(self, level: int, node: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """node [R] at `level` (-1 = none), token [R] -> node id at level + 1 [R], -1 if not a child."""
        keys = self.child_key[level]  # [U_{t+1}] ascending; an edge's index is its child's node id
        query = node.clamp(min=0) * self.vocab_size + token.clamp(min=0, max=self.vocab_size - 1)
        idx = torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)  # [R]
        found = (node >= 0) & (token >= 0) & (token < self.vocab_size) & (keys[idx] == query)
        return torch.where(found, idx, -1)

    def children(self, level: int, node: torch.Tensor):
        """node [R] at `level` (-1 = none) -> (tokens [R, D], child nodes [R, D], valid [R, D]),
        D = the widest node of the level; children in ascending token order, padding has token 0."""
        ptr, tok = self.child_ptr[level], self.child_tok[level]
        width = self.max_children[level]
        start = ptr[node.clamp(min=0)]  # [R]
        count = torch.where(node >= 0, ptr[node.clamp(min=0) + 1] - start, 0)  # [R]
        offset = torch.arange(width, device=self.device)  # [D]
        valid = offset < count[:, None]  # [R, D]
        child = torch.where(valid, start[:, None] + offset, 0)  # [R, D]
        tokens = torch.where(valid, tok[child], 0)
        return tokens, torch.where(valid, child, -1), valid

    def allowed_next(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix [R, t] (0 <= t < L) -> bool [R, vocab_size]: the exact set of valid next tokens."""
        rows, t = prefix.shape
        if not 0 <= t < self.code_len:
            raise ValueError(f"prefix length {t} outside [0, {self.code_len})")
        tokens, _, valid = self.children(t, self.node_of(prefix.to(self.device)))  # [R, D]
        mask = torch.zeros(rows, self.vocab_size + 1, dtype=torch.bool, device=self.device)
        column = torch.where(valid, tokens, self.vocab_size)  # padding lands in a spare last column
        return mask.scatter_(1, column, True)[:, : self.vocab_size]

    def item_of_node(self, node: torch.Tensor) -> torch.Tensor:
        """Level-L node ids [*] -> item ids [*], -1 for node -1 (level-L nodes are the sorted rows)."""
        return torch.where(node >= 0, self.item_ids[node.clamp(min=0)], -1)

    # ---------------------------------------------------------------- PPV: binary search in sorted rows

    def verify(self, prefix: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """PPV. prefix [R, t], candidates [R, M] -> bool [R, M]: is prefix + candidate a prefix of an item."""
        rows, t = prefix.shape
        m = candidates.shape[1]
        if not 0 <= t < self.code_len:
            raise ValueError(f"prefix length {t} outside [0, {self.code_len})")
        query = torch.cat([prefix.to(self.device)[:, None, :].expand(rows, m, t),
                           candidates.to(self.device)[:, :, None]], dim=2).reshape(rows * m, t + 1)
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
        raise ValueError(f"ragged code lengths: rows {format_rows(bad)} have lengths {format_rows(lens[bad])}, "
                         f"expected {int(common)}")
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)


def _lexsort(rows: torch.Tensor) -> torch.Tensor:
    """[N, L] -> permutation [N] sorting rows lexicographically (stable: LSD radix of stable sorts)."""
    order = torch.arange(rows.shape[0], device=rows.device)
    for col in reversed(range(rows.shape[1])):
        order = order[torch.sort(rows[order, col], stable=True).indices]
    return order


def _lex_less(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [Q, t] -> bool [Q]: a < b lexicographically."""
    if a.shape[1] == 0:
        return torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    diff = a != b  # [Q, t]
    first = diff.int().argmax(1, keepdim=True)  # first differing column (0 when equal)
    return diff.any(1) & (a.gather(1, first) < b.gather(1, first)).squeeze(1)


def _csr_levels(tokens: torch.Tensor, vocab_size: int):
    """Sorted unique rows [N, L] -> per level t: child_ptr [U_t + 1], child_tok and child_key [U_{t+1}],
    and the largest number of children of one node."""
    n, code_len = tokens.shape
    child_ptr, child_tok, child_key, max_children = [], [], [], []
    new_prefix = torch.zeros(n, dtype=torch.bool, device=tokens.device)
    new_prefix[0] = True  # level 0: one node, the root
    for t in range(code_len):
        # row r starts a new prefix of length t + 1 if its first t + 1 tokens differ from row r - 1
        starts_child = new_prefix.clone()
        starts_child[1:] |= tokens[1:, t] != tokens[:-1, t]
        parent = torch.cumsum(new_prefix.long(), 0) - 1  # [N] node id at level t of each row
        child_rows = starts_child.nonzero().flatten()  # first row of each node at level t + 1
        counts = torch.bincount(parent[child_rows], minlength=int(parent[-1]) + 1)  # [U_t]
        child_ptr.append(torch.cat([counts.new_zeros(1), counts.cumsum(0)]))
        child_tok.append(tokens[child_rows, t])
        child_key.append(parent[child_rows] * vocab_size + tokens[child_rows, t])
        max_children.append(int(counts.max()))
        new_prefix = starts_child
    return child_ptr, child_tok, child_key, max_children
