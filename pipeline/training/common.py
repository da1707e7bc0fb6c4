"""Training shared by the target and the draft (`pipeline/training/target.py`, `draft.py`): data, loop, checkpoints.

Samples: every prefix of every training history; the prompt is the last `history_len` items before position j,
written by the model's prompt template (operators/prompts.py), the label is item j's L code tokens. The losses live
in `decoding/alignment.py`.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

from decoding.beam import beam_search
from decoding.catalog import Catalog, ItemTokens
from decoding.codes import ragged_ranges
from decoding.metrics import recall_ndcg
from decoding.models import load_model
from decoding.templates import PromptTemplate, write_template
from operators.prompts import Renderer, catalog_probes
from pipeline.evaluate import split_protocol
from pipeline.storage import Storage, sha256_file


@dataclass(kw_only=True)
class TrainConfig:
    """Settings shared by target and draft training (presets in target.py / draft.py; the jobs' flags override)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    epochs: int = 3
    batch_size: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 200
    clip: float = 1.0
    patience: int = 2  # epochs without improvement before stopping
    history_len: int | None = None  # items per prompt (None: the template's max_items)
    template: str | None = None  # prompt template: a preset (codes, lcrec) or a JSON file; see target.py / draft.py
    max_samples: int | None = None  # a seeded random subset of the training samples
    eval_users: int = 1000  # validation users scored each epoch
    test_users: int | None = None  # test users scored with the kept checkpoint (None: all)
    eval_batch: int = 64
    device: str | None = None
    seed: int = 0


@dataclass
class Data:
    tokenizer: object
    catalog: Catalog  # on the training device
    item_tokens: ItemTokens
    renderer: Renderer  # the model's prompt template, compiled against the tokenizer
    values: np.ndarray  # [T] all training interactions, users concatenated
    sample_end: np.ndarray  # [N] position of each sample's label item in `values`
    sample_start: np.ndarray  # [N] first position of the sample's user in `values`
    eval_histories: list  # validation users with targets
    eval_targets: list
    fingerprint: str

    @property
    def history_len(self) -> int:
        """Items per prompt."""
        return self.renderer.max_items


def sha256_files(paths) -> str:
    """One fingerprint for several files: sha256 over their sha256s, in order."""
    return hashlib.sha256("".join(sha256_file(Path(p)) for p in paths).encode()).hexdigest()


def load_data(data_dir, tokenizer, template: PromptTemplate, eval_users: int, device, split: str = "valid") -> Data:
    """Reads a `prepare_data` folder, checks the catalog against the tokenizer (every code token named by the
    template must exist) and the template against the tokenizer, and builds the samples."""
    data_dir = Path(data_dir)
    files = [data_dir / name for name in ("items.parquet", "train.parquet", f"{split}.parquet")]
    for f in files:
        if not f.is_file():
            raise ValueError(f"{f} not found: run `python -m jobs.prepare_data --out {data_dir}`")
    try:  # a catalog/tokenizer mismatch fails here, before any training
        catalog = Catalog.from_parquet(
            files[0], tokenizer, on_duplicate="first", device=device, code_token=template.code
        )
    except ValueError as e:
        raise ValueError(f"catalog and tokenizer do not match: {e}") from None
    renderer = Renderer.compile(template, tokenizer, catalog_probes(catalog.item_tokens))
    values, end, start = training_samples(files[1], catalog.item_tokens, renderer.max_items)
    histories, targets = load_eval_users(data_dir, split, eval_users)
    fingerprint = sha256_files(files)
    return Data(tokenizer, catalog, catalog.item_tokens, renderer, values, end, start, histories, targets, fingerprint)


def training_samples(train_file: Path, item_tokens: ItemTokens, history_len: int):
    """Every prefix of every training history whose label and prompt items are all in the catalog -> (values [T]:
    all training interactions, users concatenated; sample_end [N]: each sample's label position in values;
    sample_start [N]: the first position of its user)."""
    train = pq.read_table(train_file, columns=["history"]).column("history").combine_chunks()
    values = train.flatten().to_numpy().astype(np.int64)  # [T]
    offsets = train.offsets.to_numpy().astype(np.int64)  # [U + 1]
    lengths = np.diff(offsets)
    known = item_tokens.lookup(values)[1]  # [T]
    # sample = (user, j) for 1 <= j < n: label values[start + j], prompt the items before it
    per_user = np.maximum(lengths - 1, 0)
    end = ragged_ranges(offsets[:-1] + 1, per_user)  # [N]
    start = np.repeat(offsets[:-1], per_user)
    # drop samples whose label or any prompt item is not in the catalog
    unknown_before = np.concatenate([[0], np.cumsum(~known)])
    window = np.maximum(start, end - history_len)
    ok = known[end] & (unknown_before[end] - unknown_before[window] == 0) if len(end) else np.zeros(0, bool)
    if not ok.any():
        raise ValueError(f"{train_file}: empty training set (no history with two known items)")
    return values, end[ok], start[ok]


def load_eval_users(data_dir, split: str, limit: int | None) -> tuple[list, list]:
    """The first `limit` users of a split that have a history and targets -> (histories, target lists)."""
    path = Path(data_dir) / f"{split}.parquet"
    if not path.is_file():
        raise ValueError(f"{path} not found")
    ev = pq.read_table(path, columns=["history", "target_items"]).to_pydict()
    keep = [i for i, (h, t) in enumerate(zip(ev["history"], ev["target_items"])) if h and t][:limit]
    return [ev["history"][i] for i in keep], [ev["target_items"][i] for i in keep]


def prompts(data: Data, histories, device):
    """Histories -> left-padded (input_ids, attention_mask) on the device; all rows must be valid."""
    p = data.renderer.render(histories, data.item_tokens)
    return p.input_ids.to(device), p.attention_mask.to(device)


def sample_batch(data: Data, idx: np.ndarray, device):
    """Sample indices [B] -> (input_ids [B, S], attention_mask [B, S], label tokens [B, L])."""
    end, start = data.sample_end[idx], data.sample_start[idx]
    window = np.maximum(start, end - data.history_len)
    histories = [data.values[a:b] for a, b in zip(window, end)]
    ids, mask = prompts(data, histories, device)
    labels = torch.from_numpy(data.item_tokens.lookup(data.values[end])[0]).to(device)
    return ids, mask, labels


def batches(data: Data, subset: np.ndarray, batch_size: int, rng: np.random.Generator):
    """Shuffled batches of sample indices, length-bucketed (sorted within chunks of 50 batches) to cut padding."""
    order = rng.permutation(subset)
    lengths = np.minimum(data.sample_end[order] - data.sample_start[order], data.history_len)
    out = []
    chunk = 50 * batch_size
    for a in range(0, len(order), chunk):
        part = order[a : a + chunk][np.argsort(lengths[a : a + chunk], kind="stable")]
        out += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    return [out[i] for i in rng.permutation(len(out))]


def optimizer_and_schedule(model, lr: float, weight_decay: float, warmup: int, total_steps: int):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    return opt, get_cosine_schedule_with_warmup(opt, min(warmup, total_steps // 10 + 1), total_steps)


def autocast(device: torch.device):
    """bf16 mixed precision on GPU; full precision on CPU."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_epoch(model, step_loss, data: Data, subset, batch_size, rng, opt, sched, clip, device, desc: str) -> float:
    """One pass over `subset`; step_loss(model, batch_idx) -> scalar loss. Returns the mean training loss."""
    model.train()
    total, count = 0.0, 0
    bar = tqdm(batches(data, subset, batch_size, rng), desc=desc, mininterval=5, leave=False)
    for idx in bar:
        with autocast(device):
            loss = step_loss(model, idx)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{desc}: loss became {loss.item()}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        total += loss.item() * len(idx)
        count += len(idx)
        bar.set_postfix(loss=f"{total / count:.4f}", refresh=False)
    return total / max(count, 1)


def fit(
    model,
    tokenizer,
    step_loss,
    validate,
    data: Data,
    subset,
    cfg: TrainConfig,
    rng,
    device,
    out: Path,
    report: dict,
    name: str,
):
    """Trains for cfg.epochs; after each epoch validate(model) -> (metrics, score). The best-scoring checkpoint is
    written to `out` (with training.json); training stops after cfg.patience epochs without improvement.
    Returns the kept checkpoint, reloaded from disk."""
    opt, sched = optimizer_and_schedule(
        model, cfg.lr, cfg.weight_decay, cfg.warmup, total_steps(len(subset), cfg.batch_size, cfg.epochs)
    )
    best, bad_epochs, clock = float("-inf"), 0, Timer()
    for epoch in range(1, cfg.epochs + 1):
        loss = train_epoch(
            model, step_loss, data, subset, cfg.batch_size, rng, opt, sched, cfg.clip, device, f"{name} epoch {epoch}"
        )
        metrics, score = validate(model)
        report["epochs"].append({"epoch": epoch, "train_loss": loss, "valid": metrics, "seconds": clock()})
        print(f"{name} epoch {epoch}: loss {loss:.4f}, valid {json.dumps(metrics)} ({clock():.0f}s)", file=sys.stderr)
        if score > best:
            best, bad_epochs = score, 0
            report["best_epoch"] = epoch
            save_checkpoint(model, tokenizer, data.renderer.template, out)
        else:
            bad_epochs += 1
        write_report(out, report)
        if bad_epochs >= cfg.patience:
            break
    return load_model(out, device=str(device), dtype="float32")


@torch.no_grad()
def evaluate_recommendations(model, data: Data, histories, targets, batch_size: int, device, ks=(5, 10, 20)) -> dict:
    """Recall@K / NDCG@K of beam_search on held-out users (targets = the split's items)."""
    model.eval()
    recs = []
    for a in range(0, len(histories), batch_size):
        ids, mask = prompts(data, histories[a : a + batch_size], device)
        recs.append(beam_search(model, ids, mask, data.catalog, max(ks)).item_ids.cpu().numpy())
    if not recs:
        return {"users": 0}
    return recall_ndcg(np.concatenate(recs), targets, ks)


def save_checkpoint(model, tokenizer, template: PromptTemplate, out: Path) -> None:
    """Writes safetensors weights + config + tokenizer + the prompt template into `out`, replacing what was there
    atomically enough: a temporary folder is filled first, then swapped in."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        _rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    write_template(tmp, template)
    for f in out.glob("*") if out.exists() else []:
        if f.name != "training.json" and f.is_file():
            f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        f.replace(out / f.name)
    tmp.rmdir()


def _rmtree(path: Path) -> None:
    for f in path.iterdir():
        f.unlink()
    path.rmdir()


def report_head(cfg, template: PromptTemplate, data: Data, subset: np.ndarray) -> dict:
    """What a training report starts with: the config, the prompt template, the data it read, its samples."""
    return {
        "config": config_dict(cfg),
        "template": template.to_dict(),
        "data_fingerprint": data.fingerprint,
        "samples": int(len(subset)),
    }


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def write_final_report(out: Path, report: dict, data_dir) -> None:
    """training.json with each split's protocol (how valid and test were split, from the folder's prepare.json)."""
    data_dir = Path(data_dir)
    report["protocol"] = {s: split_protocol(str(data_dir / f"{s}.parquet"), Storage()) for s in ("valid", "test")}
    write_report(out, report)


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps(report, indent=2, default=_json_default))


def _json_default(x):
    return x.item() if isinstance(x, (np.integer, np.floating)) else str(x)


def seed_everything(seed: int) -> np.random.Generator:
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def subset_of(n: int, max_samples: int | None, rng: np.random.Generator) -> np.ndarray:
    """All sample indices, or a seeded random subset of at most max_samples."""
    if max_samples is None or max_samples >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=max_samples, replace=False))


def total_steps(n: int, batch_size: int, epochs: int) -> int:
    return max(1, math.ceil(n / batch_size) * epochs)


def config_dict(cfg) -> dict:
    return asdict(cfg) if hasattr(cfg, "__dataclass_fields__") else dict(cfg)


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
