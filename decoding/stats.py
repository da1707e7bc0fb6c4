"""The statistics contract of every decoder: one set of base keys, always present, with one meaning.

`beam_search` (greedy and sampling), `speculative_beam_search` (strict and relaxed), `disc_sample` and
`constrained_sample` all return `Recommendations.stats` holding:

    prefill_s             seconds of the prompt prefill (the target's, and the draft's in speculative decoding)
    draft_s               seconds the draft spent proposing (speculative decoding; 0 elsewhere)
    verify_s              seconds of the target's verification forwards (speculative decoding; 0 elsewhere)
    decode_s              every other second: tree forwards outside draft/verify, beam selection, acceptance,
                          compaction; the four phases add up to the decoder's wall time
    target_forwards       forward passes of the target (the prefill is one; one per call, whatever the batch)
    draft_forwards        forward passes of the draft (0 without one)
    target_tokens         token positions the target processed: the prefill's [B, S] (left padding included)
                          plus every tree node of every later forward
    draft_tokens          the same for the draft
    kv_tokens             the most KV-cache tokens held at once, all models and users together (cache rows x
                          columns, left padding included)
    kv_tokens_beam_batch  what a batch beam search (K copies of each prompt) holds for the same users:
                          B * k * (S + L - 1)

and, per user, `non_finite` [B] bool: its log-probabilities were NaN or infinite somewhere (NaN or infinite logits,
e.g. a float16 overflow); its items are not to be trusted (the nightly job rejects such users).

Each mode adds its own extras beside them (speculative: accepted_steps, drafted_steps, rounds, accepted_hist;
DISC: proposals, acceptance_rate, invalid_mass, importance_weight; beam search: kv_len, kv_batch, tree_tokens).
Scalars are Python numbers; per-user extras are tensors [B].
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PHASES = ("prefill_s", "draft_s", "verify_s", "decode_s")
COUNTS = ("target_forwards", "draft_forwards", "target_tokens", "draft_tokens", "kv_tokens", "kv_tokens_beam_batch")
BASE_KEYS = PHASES + COUNTS


class Meter:
    """Counts one decoder call into the base keys: phases timed with `phase`, forwards with `forward`, the KV
    peak with `kv`; `result(**extras)` closes the clock (decode_s = wall time - the other phases)."""

    def __init__(self, device: torch.device):
        import torch  # here: the module's constants are read by processes that never import torch (read tasks)

        self.cuda = torch.device(device).type == "cuda"
        self.stats = {key: 0.0 if key in PHASES else 0 for key in BASE_KEYS}
        self.t0 = self._now()

    def _now(self) -> float:
        if self.cuda:  # kernels run asynchronously: a phase ends when its work is done
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def phase(self, name: str):
        """Times the block into `<name>_s` (prefill, draft or verify)."""
        return timed(self.stats, f"{name}_s", self._now)

    def forward(self, role: str, input_ids: torch.Tensor) -> None:
        """One forward of `role` ('target' or 'draft') over input_ids [B, Q]."""
        self.stats[f"{role}_forwards"] += 1
        self.stats[f"{role}_tokens"] += input_ids.numel()

    def kv(self, tokens: int) -> None:
        """KV tokens held right now, all models together: the peak is kept."""
        self.stats["kv_tokens"] = max(self.stats["kv_tokens"], int(tokens))

    def result(self, kv_tokens_beam_batch: int, **extras) -> dict:
        wall = self._now() - self.t0
        self.stats["decode_s"] = max(wall - sum(self.stats[p] for p in PHASES if p != "decode_s"), 0.0)
        self.stats["kv_tokens_beam_batch"] = int(kv_tokens_beam_batch)
        return {**self.stats, **extras}


@contextmanager
def timed(seconds: dict, key: str, now=time.perf_counter):
    """Adds the seconds the block takes (clock `now`) to seconds[key] (0 when absent)."""
    t0 = now()
    try:
        yield
    finally:
        seconds[key] = seconds.get(key, 0.0) + now() - t0


def beam_batch_kv(batch: int, k: int, prompt_len: int, code_len: int) -> int:
    """KV tokens a batch beam search holds at its end: K copies of each padded prompt plus L - 1 generated tokens."""
    return batch * k * (prompt_len + code_len - 1)
