"""Memory-fitted slicing of a shard's decode: the order its users are decoded in (by prompt length), how many one
decode holds (compute.decode_batch, else on CUDA the most that fit the free memory, from the models' shapes), slices
that run out of memory halved and tried again, and the batch an out-of-memory left kept for the actor's later
shards. Each slice drops the left padding none of its users needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from decoding.beam import Recommendations
from decoding.catalog import Exclusions
from decoding.memory import decode_bytes_per_user, fit_batch, free_device_memory
from operators.spec import Decoding


def length_order(mask: torch.Tensor, users) -> np.ndarray:
    """Prompts' attention mask [U, S] and user ids [U] -> the rows by prompt length, then user id [U]: the same
    decode order for any permutation of the same users."""
    key = pa.table({"length": pa.array(mask.sum(1).cpu().numpy()), "user": users})
    return pc.sort_indices(key, sort_keys=[("length", "ascending"), ("user", "ascending")]).to_numpy().astype(np.int64)


def trim_padding(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts ids, mask [U, S] -> without the leading columns that no user of them needs [U, S']."""
    used = mask.any(0).nonzero()
    first = int(used[0]) if len(used) else 0
    return ids[:, first:], mask[:, first:]


def fitting(d: Decoding, prompt_tokens: int, levels: int, mode: str, target, draft) -> int | None:
    """On CUDA: the most users whose `mode` decode of prompts of `prompt_tokens` tokens (the shared prefix included)
    with these models fits in their device's free memory (decoding/memory.py); elsewhere None (no limit)."""
    free = free_device_memory(target.device)
    if free is None:
        return None
    per_user = decode_bytes_per_user(
        target, prompt_tokens, d.k, levels, target.dtype, mode, draft, d.draft_beams, d.gamma
    )
    return fit_batch(per_user, free)


def holding(mode: str, draft) -> int:
    """Models whose caches hold the prompts: the draft's too in the speculative modes."""
    return 2 if draft is not None and mode.startswith("atspeed") else 1


Decode = Callable[[torch.Tensor, torch.Tensor, pa.Array, Exclusions | None], Recommendations]
# ^ one slice's prompts ids, mask [U', S'], its users [U'] and their exclusions -> its lists


@dataclass
class Batcher:
    """An actor's users per decode, kept across its shards."""

    pinned: int | None = None  # compute.decode_batch (None: what fits)
    decode_batch: int = 0  # users per decode of the last shard
    oom_batch: int | None = None  # the batch an out-of-memory left: no later decode of the run's models goes above it

    def first(self, users: int, fits: int | None, models: bool = True) -> int:
        """Users per decode for `users` users: compute.decode_batch if pinned, else `fits` (the most the free memory
        holds; None: no limit), else all of them; never above the batch an out-of-memory left (`models`: a decode of
        the run's own models; another pair, the audit's, has its own sizes)."""
        return min(users, self.pinned or fits or users, (self.oom_batch if models else None) or users)

    def slices(
        self, decode: Decode, ids, mask, users, batch: int, exclude: Exclusions | None = None, holding: int = 1
    ) -> tuple[Recommendations, int]:
        """The users [U, S] in consecutive slices of `batch` users, a slice that runs out of memory halved and tried
        again (the slices already decoded stay), each without the left padding none of its users needs -> (one
        Recommendations, the batch it ended at); its stats count the prompt positions, padding and padding's KV
        tokens (`holding` models hold the prompts). Sampling modes draw per user: a slice draws what the whole batch
        would."""
        parts, a, widths = [], 0, []
        while a < ids.shape[0]:
            rows = torch.arange(a, min(a + batch, ids.shape[0]), device=ids.device)
            part = exclude.select(rows) if exclude is not None else None  # the slice's users' exclusions
            slice_ids, slice_mask = trim_padding(ids[a : a + batch], mask[a : a + batch])
            try:
                parts.append(decode(slice_ids, slice_mask, users.slice(a, batch), part))
                widths.append((len(rows), slice_mask.shape[1], int(slice_mask.sum())))
                a += batch
            except torch.OutOfMemoryError:
                if batch == 1:
                    raise
                batch //= 2
                if ids.device.type == "cuda":
                    torch.cuda.empty_cache()
        rec = Recommendations.concat(parts)
        rec.stats.update(
            prompt_positions=sum(n * s for n, s, _ in widths),
            prompt_padding=sum(n * s - t for n, s, t in widths),
            kv_padding_tokens=max(holding * (n * s - t) for n, s, t in widths),
        )
        return rec, batch

    def settle(self, ended: int, first: int) -> None:
        """A shard's decode ended at `ended` users per decode, started at `first`: what the metrics report, and the
        batch later shards start from when an out-of-memory halved it."""
        self.decode_batch = ended
        self.oom_batch = ended if ended < first else self.oom_batch
