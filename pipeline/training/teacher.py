"""Teacher data for draft training, cached on disk so that several draft objectives reuse it.

For each training sample (prompt): the target's top-K beam sequences (`beam_search`, batched) and the target's
logits along them, plus the target's logits along the ground-truth item. Logits along the top-K sequences are
kept only on each level's token span (the constrained objectives never look outside the tokens that can
continue an item at that level), which makes them V / W times smaller (1028 / 256 for Beauty).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from decoding.alignment import level_spans, span_logits
from decoding.beam import beam_search
from decoding.tree import chain_forward
from pipeline.storage import fingerprint
from pipeline.training.common import Data, sample_batch


@dataclass
class Teacher:
    sample_index: np.ndarray  # [n] sorted indices into the training samples
    tokens: torch.Tensor  # [n, K, L] int64: the target's top-K sequences, -1 rows where fewer exist
    gt_logits: torch.Tensor  # [n, L, V] float16: target logits along the ground-truth item
    top_logits: torch.Tensor  # [n, K, L, W] float16: target logits along its top-K sequences, on level spans
    span_lo: torch.Tensor  # [L] int64: first token id of each level's span (width W)

    def rows(self, idx: np.ndarray) -> torch.Tensor:
        """Sample indices [B] -> teacher rows [B]."""
        pos = np.searchsorted(self.sample_index, idx)
        found = pos < len(self.sample_index)
        found[found] = self.sample_index[pos[found]] == idx[found]
        if not found.all():
            raise KeyError(f"samples without teacher data: {idx[~found][:5].tolist()}")
        return torch.from_numpy(pos)


@torch.no_grad()
def build_teacher(target, data: Data, subset: np.ndarray, k: int, batch_size: int, device) -> Teacher:
    target.eval()
    span_lo, width = level_spans(data.catalog)
    tokens, gt_logits, top_logits = [], [], []
    for a in tqdm(range(0, len(subset), batch_size), desc="teacher data", mininterval=5):
        idx = subset[a : a + batch_size]
        ids, mask, labels = sample_batch(data, idx, device)
        top = beam_search(target, ids, mask, data.catalog, k).token_ids  # [B, K, L]
        logits = chain_forward(target, ids, mask, torch.cat([labels[:, None], top.clamp(min=0)], 1)).float()
        tokens.append(top.cpu())
        gt_logits.append(logits[:, 0].half().cpu())
        top_logits.append(span_logits(logits[:, 1:], span_lo, width).half().cpu())
    return Teacher(
        np.asarray(subset, dtype=np.int64), torch.cat(tokens), torch.cat(gt_logits), torch.cat(top_logits), span_lo
    )


def teacher_data(
    target_dir, target, data: Data, subset: np.ndarray, k: int, batch_size: int, device, cache_dir=None
) -> Teacher:
    """The cached teacher data for these samples, built (and written) when missing or stale (keyed by the target's
    weights, the data, K, the prompt template and the samples)."""
    key = {
        "target": fingerprint(target_dir),
        "data": data.fingerprint,
        "k": k,
        "template": data.renderer.template.to_dict(),
        "samples": hashlib.sha256(np.asarray(subset, dtype=np.int64).tobytes()).hexdigest(),
    }
    cache = Path(cache_dir) if cache_dir else Path(target_dir) / "teacher"
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache / f"teacher-{name}.safetensors"
    if path.is_file():
        print(f"teacher data: reusing {path}", file=sys.stderr)
        t = load_file(path)
        return Teacher(t["sample_index"].numpy(), t["tokens"], t["gt_logits"], t["top_logits"], t["span_lo"])
    teacher = build_teacher(target, data, subset, k, batch_size, device)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(
        {
            "sample_index": torch.from_numpy(teacher.sample_index),
            "tokens": teacher.tokens,
            "gt_logits": teacher.gt_logits,
            "top_logits": teacher.top_logits,
            "span_lo": teacher.span_lo,
        },
        tmp,
        metadata={k_: str(v) for k_, v in key.items()},
    )
    tmp.replace(path)  # a crash never leaves a half-written cache under the final name
    print(f"teacher data: wrote {path} ({path.stat().st_size / 2**20:.0f} MB)", file=sys.stderr)
    return teacher
