"""What the benchmarks run on: Amazon Beauty prompts from a prepared data dir, random prompts, the models, consecutive
batches and what the decoders return over them."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
import torch

from decoding.catalog import Catalog
from decoding.models import load_model, load_tokenizer, pick_device, tiny_model
from decoding.templates import PRESETS, TEMPLATE_FILE, read_template
from operators.prompts import Renderer, catalog_probes
from pipeline.bench.common import Interleaved, interleaved
from pipeline.bench.params import ModelParams

HOW_TO_TRAIN = (
    "train the demo models with `make models` (python -m jobs.train_target --preset demo, then "
    "python -m jobs.train_draft --preset demo; about 15 minutes on a CPU), or pass your own"
)


def load_beauty(data: Path, users: int, history_len: int, device, model_dir: Path | None = None):
    """Prepared data dir -> (tokenizer, catalog, input_ids [U, S], attention_mask [U, S]) of the first `users` test
    users with a history, written by the model directory's prompt template (the `codes` preset without one) with
    its last `history_len` items."""
    for name in ("items.parquet", "test.parquet", "tokenizer"):
        if not (data / name).exists():
            raise FileNotFoundError(f"{data / name} not found: run `python -m jobs.prepare_data --out {data}` first")
    tok = load_tokenizer(model_dir or data / "tokenizer")
    has_template = model_dir is not None and (Path(model_dir) / TEMPLATE_FILE).is_file()
    template = (read_template(model_dir) if has_template else PRESETS["codes"]).with_max_items(history_len)
    catalog = Catalog.from_parquet(
        data / "items.parquet", tok, on_duplicate="first", device=device, code_token=template.code
    )
    histories = pq.read_table(data / "test.parquet", columns=["history"]).column("history").to_pylist()
    histories = [h for h in histories if h][:users]
    prompts = Renderer.compile(template, tok, catalog_probes(catalog.item_tokens)).render(
        histories, catalog.item_tokens
    )
    return tok, catalog, prompts.input_ids.to(device), prompts.attention_mask.to(device)


def beauty_section(p, model_dir: str | Path | None = None, users: int | None = None) -> tuple:
    """A section on Beauty's users, from its parameters: its device, torch seeded with p.seed, and load_beauty's
    (tokenizer, catalog, input_ids, attention_mask [U, S]) of the first `users` (p.users) users in `model_dir`'s
    template -> (device, tokenizer, catalog, input_ids, attention_mask)."""
    device = pick_device(p.device)
    torch.manual_seed(p.seed)
    model_dir = Path(model_dir) if model_dir else None
    return device, *load_beauty(Path(p.data), users or p.users, p.history_len, device, model_dir)


def load_beauty_catalog(data: Path, device) -> Catalog:
    """The prepared catalog alone (for the index timings)."""
    return Catalog.from_parquet(
        data / "items.parquet", load_tokenizer(data / "tokenizer"), on_duplicate="first", device=device
    )


def bench_model(p: ModelParams, vocab_size: int, device: torch.device):
    """p.model loaded, or a random Llama of p.layers x p.hidden over `vocab_size` tokens."""
    if p.model:
        return load_model(p.model, device=str(device), dtype=p.dtype, attn_implementation=p.attn)
    model = tiny_model(
        "llama", vocab_size, seed=p.seed, attn_implementation=p.attn, **llama(p.hidden, p.layers, p.heads)
    )
    return model.to(device)


def llama(hidden: int, layers: int, heads: int, mlp: int | None = None) -> dict:
    """tiny_model's overrides for a random Llama of layers x hidden: `heads` attention heads and as many KV heads, an
    MLP of `mlp` (4 x hidden by default)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=mlp or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )


def random_prompts(users: int, length: int, high: int, seed: int, device) -> torch.Tensor:
    """Random text prompts [users, length]: token ids in [4, high) (after the special tokens, before the code tokens
    that end the vocabulary), drawn from a CPU generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, high, (users, length), generator=g).to(device)


def require_models(target: str | None, drafts: list[str] | None = None) -> None:
    """FileNotFoundError, with how to train them, when the target (or every draft) is missing."""
    if not target or not (Path(target) / "config.json").is_file():
        raise FileNotFoundError(f"no target model at {target}: {HOW_TO_TRAIN} with --target / --model DIR")
    if drafts is not None and not drafts:
        raise FileNotFoundError(f"no draft models (models/demo-draft*): {HOW_TO_TRAIN} with --drafts DIR [DIR ...]")
    for d in drafts or []:
        if not (Path(d) / "config.json").is_file():
            raise FileNotFoundError(f"no draft model at {d}: {HOW_TO_TRAIN} with --drafts DIR [DIR ...]")


def load_drafts(paths: list[str], device: torch.device) -> dict:
    """Draft dirs -> {name: model}, named by the objective in their training.json (else the folder name)."""
    drafts = {}
    for path in paths:
        report_file = Path(path) / "training.json"
        report = json.loads(report_file.read_text()) if report_file.is_file() else {}
        name = report.get("objective", Path(path).name)
        beta = report.get("config", {}).get("beta", 1.0)
        name += "" if name != "atspeed-s" or beta == 1.0 else f" (beta={beta:g})"
        drafts[name] = load_model(path, device=str(device), dtype="float32")
    return drafts


def in_batches(fn, ids: torch.Tensor, mask: torch.Tensor, batch: int) -> list:
    """fn(ids, mask) over consecutive batches of the users [U, S] -> the outputs, one per batch."""
    return [fn(ids[a : a + batch], mask[a : a + batch]) for a in range(0, ids.shape[0], batch)]


def interleaved_in_batches(
    fns: dict, ids: torch.Tensor, mask: torch.Tensor, batch: int, repeats: int, g: torch.Generator, seed: int, desc: str
) -> Interleaved:
    """Every decoder fn(ids, mask) over all the users [U, S] in batches, `repeats` interleaved runs after a warm-up
    on the first batch; the sampling generator `g` re-seeded with `seed` before every call, so that every run draws
    the same (a sampler's outputs are the same in every repeat)."""

    def seeded(fn, i, m):
        g.manual_seed(seed)
        return in_batches(fn, i, m, batch)

    return interleaved(
        {name: partial(seeded, fn, ids, mask) for name, fn in fns.items()},
        repeats,
        ids.device,
        warmup={name: partial(seeded, fn, ids[:batch], mask[:batch]) for name, fn in fns.items()},
        desc=desc,
    )


def ranked(outputs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder's outputs over consecutive batches (Recommendations, or generate_beam_search's (item ids, token ids,
    scores, KV tokens) tuples) -> item ids [U, K], scores [U, K]."""
    if isinstance(outputs[0], tuple):
        return torch.cat([o[0] for o in outputs]), torch.cat([o[2] for o in outputs])
    return torch.cat([r.item_ids for r in outputs]), torch.cat([r.scores for r in outputs])


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
