"""The KV cache of the token tree: one preallocated buffer per layer, written in place.

Layout per user row: [P shared-prefix columns | S prompt columns | T tree columns], all layers alike. A forward writes
its Q new columns at the end (no concatenation of the whole cache per step, as transformers' DynamicCache does) and
attends to the filled part, a view. Capacity grows by doubling when a forward would overflow it, so a decode costs
its new tokens plus O(log) reallocations. `keep` compacts the tree region in place (the prefix and prompt stay where
they are), `select` keeps some user rows (finished users leave), `rows` restricts the next forward to the first rows
(users sorted so that the ones with work this step come first).
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class TreeLayer(CacheLayerMixin):
    """One layer's keys and values [B, H_kv, capacity, D]; `length` columns are filled. It holds no reference to
    its TreeCache: without a reference cycle a batch's cache is freed as soon as the decode returns, not at the next
    garbage collection (which would keep it alive, on the heap or the GPU, through the next batch)."""

    is_sliding = False  # a sliding window is applied through the mask: every column stays (see check_window)

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(b, h, self.capacity, d)  # zeros: unwritten columns stay finite
        self.values = value_states.new_zeros(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [A, H_kv, Q, D] of the active rows -> all their keys and values so far [A, H_kv, len + Q, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        a, q = key_states.shape[0], key_states.shape[2]
        end = self.length + q
        if end > self.keys.shape[2]:
            self.grow(end)
        self.keys[:a, :, self.length : end] = key_states
        self.values[:a, :, self.length : end] = value_states
        self.length = end
        return self.keys[:a, :, :end], self.values[:a, :, :end]

    def grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys.shape[2])
        pad = capacity - self.keys.shape[2]
        self.keys = torch.cat([self.keys, self.keys.new_zeros(*self.keys.shape[:2], pad, self.keys.shape[3])], 2)
        self.values = torch.cat(
            [self.values, self.values.new_zeros(*self.values.shape[:2], pad, self.values.shape[3])], 2
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class TreeCache(Cache):
    """The layers of one model's tree cache (created lazily, one per attention layer, by the first forward)."""

    def __init__(self, capacity: int):
        self.capacity = max(int(capacity), 1)
        super().__init__(layer_class_to_replicate=partial(TreeLayer, self.capacity))

    @property
    def length(self) -> int:
        """Columns filled (the same in every layer)."""
        return self.layers[0].length if self.layers else 0

    @property
    def rows(self) -> int:
        """Cache rows (users)."""
        return self.layers[0].keys.shape[0] if self.layers else 0

    def start(self, batch: int, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """An empty cache of `batch` rows, or one whose first columns hold a shared prefix's keys and values
        (prefix: per layer ([1, H_kv, P, D], [1, H_kv, P, D]), copied into every row: computed once, stored per row
        so that attention stays one kernel over each row)."""
        for k, v in prefix or []:
            layer = TreeLayer(self.capacity)
            layer.lazy_initialization(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1))
            layer.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1))
            self.layers.append(layer)

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Compacts the columns from `start` on (the tree region) to idx [B, T'] of them (offsets from `start`), in
        place; the columns before `start` are not touched."""
        b, kept = idx.shape
        for layer in self.layers:
            for name in ("keys", "values"):
                buf = getattr(layer, name)  # [B, H, C, D]
                at = (start + idx)[:, None, :, None].expand(b, buf.shape[1], kept, buf.shape[3])
                buf[:, :, start : start + kept] = buf[:b, :, : layer.length].gather(2, at)
            layer.length = start + kept

    def select(self, users: torch.Tensor) -> None:
        """Keeps the given rows [B'] (finished users leave: their columns stop costing attention and memory)."""
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[users], layer.values[users]

    def prefix_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row 0's filled keys and values per layer ([1, H_kv, len, D]): a prefix to `start` other caches with."""
        return [(layer.keys[:1, :, : layer.length], layer.values[:1, :, : layer.length]) for layer in self.layers]
