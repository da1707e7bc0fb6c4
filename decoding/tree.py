"""Shared-prefix token tree for a batch of users (trie-based beam search, tree attention).

Each user's prompt is prefilled once. Every generated token (a beam's next token, a drafted token)
is a node of a tree hanging off that prompt; its KV sits in the same tree cache (decoding/cache.py) after the
prompt's. A node attends to its user's real prompt tokens and to its ancestors (itself included),
through an additive float 4-D mask, at the position it would have in an unshared sequence:
`prompt_len + depth - 1`. Compaction drops the KV of pruned branches in place, the prompt untouched.

Cache layout per user: [P shared-prefix columns | S padded prompt columns | T tree columns]; tree column i is node i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.cache import TreeCache


@dataclass
class TokenTree:
    prompt_mask: torch.Tensor  # [B, S] bool, True on real (not left-padding) prompt tokens
    prompt_len: torch.Tensor  # [B] int64, number of real prompt tokens
    anc: torch.Tensor  # [B, T, T] bool, anc[b, i, j]: node j is node i or an ancestor of it
    depth: torch.Tensor  # [B, T] int64, 1 for a child of the prompt

    @classmethod
    def from_prompt(cls, attention_mask: torch.Tensor, prefix: int = 0) -> TokenTree:
        """A tree over left-padded prompts [B, S] that continue a shared prefix of `prefix` tokens."""
        prompt_mask = attention_mask.bool()  # [B, S]
        b, dev = prompt_mask.shape[0], prompt_mask.device
        prompt_mask = torch.cat([prompt_mask.new_ones(b, prefix), prompt_mask], 1)  # [B, P + S]
        return cls(
            prompt_mask,
            prompt_mask.sum(1),
            torch.zeros(b, 0, 0, dtype=torch.bool, device=dev),
            torch.zeros(b, 0, dtype=torch.int64, device=dev),
        )

    @property
    def num_nodes(self) -> int:
        return self.anc.shape[1]

    @property
    def kv_len(self) -> int:
        """Columns of the cache: padded prompt + tree nodes."""
        return self.prompt_mask.shape[1] + self.num_nodes

    def add(self, parent: torch.Tensor, dtype: torch.dtype, block_depth: int = 1):
        """Appends Q nodes per user. parent [B, Q]: an existing node (0 <= p < T), a node of this block
        (T <= p < T + Q, listed before its children; `block_depth` = levels inside the block), or -1 for a
        child of the prompt. Returns the additive mask [B, 1, Q, S + T + Q] and position ids [B, Q]."""
        b, q = parent.shape
        t = self.num_nodes
        dev = parent.device
        has_parent = parent >= 0
        par = parent.clamp(min=0)
        eye = torch.eye(q, dtype=torch.bool, device=dev).expand(b, q, q)
        new = torch.cat([torch.zeros(b, q, t, dtype=torch.bool, device=dev), eye], 2)  # [B, Q, T+Q] self only
        old = torch.cat([self.anc, torch.zeros(b, t, q, dtype=torch.bool, device=dev)], 2)  # [B, T, T+Q]
        depth = torch.ones(b, q, dtype=torch.int64, device=dev)
        for _ in range(block_depth):  # a node's row is its parent's row plus itself
            rows = torch.cat([old, new], 1)  # [B, T+Q, T+Q]
            par_rows = rows.gather(1, par[:, :, None].expand(b, q, t + q))  # [B, Q, T+Q]
            new = torch.cat([torch.zeros_like(new[..., :t]), eye], 2) | (par_rows & has_parent[..., None])
            depth = torch.where(has_parent, torch.cat([self.depth, depth], 1).gather(1, par) + 1, 1)
        self.anc = torch.cat([old, new], 1)
        self.depth = torch.cat([self.depth, depth], 1)
        return self.attention_mask(new, dtype), self.prompt_len[:, None] + depth - 1

    def attention_mask(self, tree_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """tree_rows [B, Q, T] bool -> additive [B, 1, Q, S + T]: 0 where attended, dtype min elsewhere."""
        b, q, _ = tree_rows.shape
        allowed = torch.cat([self.prompt_mask[:, None, :].expand(b, q, -1), tree_rows], 2)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

    def compact(self, keep: torch.Tensor, cache: TreeCache) -> torch.Tensor:
        """keep [B, T] bool, closed under ancestors. Drops the other nodes from the tree and the cache
        (kept nodes first, in their old order; users with fewer keep dead padding columns).
        Returns remap [B, T]: old node index -> new index, -1 if dropped."""
        b, t = keep.shape
        kept = int(keep.sum(1).max()) if t else 0
        idx = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :kept]  # [B, T']
        self.anc = self.anc.gather(1, idx[:, :, None].expand(b, kept, t)).gather(
            2, idx[:, None, :].expand(b, kept, kept)
        )
        self.depth = self.depth.gather(1, idx)
        cache.keep(self.prompt_mask.shape[1], idx)  # [B, H, S + T, D] -> [B, H, S + T', D], in place
        remap = torch.full((b, t), -1, dtype=torch.int64, device=keep.device)
        remap.scatter_(1, idx, torch.arange(kept, device=keep.device).expand(b, kept))
        return torch.where(keep, remap, -1)

    def keep_paths(self, nodes: torch.Tensor, cache: TreeCache) -> torch.Tensor:
        """Compacts the tree and cache to the paths of nodes [B, Q] (-1 = none); returns their new indices."""
        if self.num_nodes == 0:
            return nodes
        remap = self.compact(self.ancestors_of(nodes), cache)
        return torch.where(nodes >= 0, remap.gather(1, nodes.clamp(min=0)), -1)

    def select_users(self, users: torch.Tensor, cache: TreeCache) -> None:
        """Keeps only the given batch rows [B'] of the tree and the cache (finished users stop costing compute)."""
        self.prompt_mask, self.prompt_len = self.prompt_mask[users], self.prompt_len[users]
        self.anc, self.depth = self.anc[users], self.depth[users]
        cache.select(users)

    def ancestors_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """nodes [B, Q] (-1 = none) -> bool [B, T]: every node on the path of any of them."""
        b, q = nodes.shape
        rows = self.anc.gather(1, nodes.clamp(min=0)[:, :, None].expand(b, q, self.num_nodes))  # [B, Q, T]
        return (rows & (nodes >= 0)[:, :, None]).any(1)


def prompt_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padded [B, S] -> positions [B, S] counted over real tokens (as `generate` does)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def chain_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, chains: torch.Tensor) -> torch.Tensor:
    """Scores C token chains per user under the shared prompt in ONE forward (training, teacher data; no cache).
    input_ids, attention_mask [B, S] left-padded; chains [B, C, T] -> logits [B, C, T, V] where [:, c, j]
    predicts chains[:, c, j] from prompt + chains[:, c, :j]. The prompt is encoded once for all chains."""
    b, c, t = chains.shape
    s = input_ids.shape[1]
    n = t - 1  # a chain's last token predicts nothing needed here
    tree = TokenTree.from_prompt(attention_mask)
    parent = torch.arange(c * n, device=chains.device).view(c, n) - 1  # node (c, j) at index c * n + j
    parent[:, :1] = -1
    tree_mask, tree_pos = tree.add(parent.reshape(1, -1).expand(b, -1), model.dtype, block_depth=max(n, 1))
    causal = torch.ones(s, s, dtype=torch.bool, device=chains.device).tril()  # [S, S]
    prompt_rows = torch.cat(
        [causal & tree.prompt_mask[:, None, :], torch.zeros(b, s, c * n, dtype=torch.bool, device=chains.device)], 2
    )  # [B, S, S+Q]
    prompt_mask = torch.zeros(prompt_rows.shape, dtype=model.dtype, device=chains.device)
    prompt_mask.masked_fill_(~prompt_rows, torch.finfo(model.dtype).min)
    out = model(
        input_ids=torch.cat([input_ids, chains[:, :, :n].reshape(b, c * n)], 1),
        attention_mask=torch.cat([prompt_mask[:, None], tree_mask], 2),
        position_ids=torch.cat([prompt_position_ids(attention_mask), tree_pos], 1),
        logits_to_keep=1 + c * n,
    ).logits  # [B, 1 + C*n, V]
    first = out[:, :1].expand(b, c, -1)[:, :, None]  # the prompt's last position predicts every chain's token 0
    return torch.cat([first, out[:, 1:].reshape(b, c, n, out.shape[-1])], 2)
