"""minionerec: a peer run. MiniOneRec's own evaluation (github AkaliKong/MiniOneRec, evaluate.py: `transformers`
generate with a Python hash-dict ConstrainedLogitsProcessor called per beam per step) imported at run time from a
copy the user gives (`--peer`, with their requirements installed), beside beam_search with the `minionerec` template,
on the same model and the same rows of their test CSV. Nothing of theirs is copied here: their module is loaded from
the path, and only its model loading is redirected (local files, the dtype and device asked for; their main() loads
bfloat16 on `device_map="auto"`).

Reported: lists identical (by semantic ID: their output is text), among users clear of a float32 near-tie too; score
differences (their list scored by a plain forward of prompt + codes + "\\n" + EOS against ours, position by position
where the items agree); invalid items returned by either; users/s, median (min-max) over interleaved repeats, of their
evaluate.py (its main() less its model loading: it builds its constraint dict and tokenizes its prompts each run, as
it does) and of ours (rendering and decoding; the catalog index and the template compiled once before) at their
settings (batch 4, 50 beams) and at ours (--batch).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from decoding.beam import Prefix, beam_search
from decoding.catalog import Catalog
from decoding.models import load_model, load_tokenizer, pick_device, tiny_model
from decoding.reference import sequence_logprob
from decoding.templates import PRESETS
from operators.prompts import Renderer, catalog_probes
from pipeline.bench.common import compare, fmt_spread, footer, interleaved, ratio
from pipeline.bench.params import MiniOneRecParams
from pipeline.markdown import table
from pipeline.prepare import build_text_tokenizer
from pipeline.prepare.minionerec import find_layout, prepare_minionerec

PEER_FILES = ("evaluate.py", "data.py", "LogitProcessor.py")
CODE = re.compile(r"<[a-z]_\d+>")


def run_minionerec(p: MiniOneRecParams) -> dict:
    """The minionerec section's figures."""
    peer = Path(p.peer).resolve()
    missing = [f for f in PEER_FILES if not (peer / f).is_file()]
    if missing:
        raise FileNotFoundError(f"--peer {peer}: no {', '.join(missing)}: give a copy of github AkaliKong/MiniOneRec")
    device = pick_device(p.device)
    out = Path(p.out).resolve() / "minionerec-bench"
    layout = find_layout(peer, p.category)
    summary = prepare_minionerec(peer, out / "data", p.category)
    rows = pd.read_csv(layout.csv["test"], dtype={"user_id": str}, keep_default_na=False).head(p.users)
    rows.to_csv(out / "rows.csv", index=False)
    items = pq.read_table(out / "data" / "items.parquet")
    model_dir = Path(p.model) if p.model else random_model(out / "model", items, p.seed)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, device=str(device), dtype=p.dtype)
    cat = Catalog.from_table(items, tok, on_duplicate="first", device=device)
    renderer = Renderer.compile(PRESETS["minionerec"], tok, catalog_probes(cat.item_tokens))
    histories = [ast.literal_eval(h) for h in rows.history_item_id]
    decode = partial(ours, model, cat, renderer, Prefix(renderer.prefix_ids), histories, p.beams)
    outputs, timings = timed(p, partial(theirs, peer, model_dir, out, p, device), decode, device)
    their_lists = outputs["theirs"]
    rec = outputs["ours"]
    full = renderer.render(pa.array(histories), cat.item_tokens)
    return {
        "import": {"items": summary.items, "rows": summary.rows, "category": summary.category},
        "model": str(model_dir),
        "agreement": agreement(model, full, cat, renderer, rec, their_lists, tok),
        "users_per_s": {n: t.per(lambda s: len(histories) / s) for n, t in timings.items()},
        "speed_up": {n: ratio(timings["theirs"], timings[n]) for n in ("ours_theirs", "ours")},
        "names": {
            "theirs": f"their evaluate.py, batch {p.their_batch}",
            "ours_theirs": f"beam_search, batch {p.their_batch}",
            "ours": f"beam_search, batch {p.batch}",
        },
    }


def timed(p: MiniOneRecParams, peer_run, decode, device) -> tuple[dict, dict]:
    """Their evaluate.py (`peer_run(loads)`), beam_search at their batch and at ours, interleaved -> (each one's
    outputs, its Timings with their model loading left out of their seconds)."""
    loads: list[float] = []  # their model loading, each run (the warm-up's first)
    runs = interleaved(
        {
            "theirs": partial(peer_run, loads),
            "ours_theirs": partial(decode, p.their_batch),
            "ours": partial(decode, p.batch),
        },
        p.repeats,
        device,
        desc="minionerec",
    )
    seconds = {n: list(t.seconds) for n, t in runs.timings.items()}
    seconds["theirs"] = [s - load for s, load in zip(seconds["theirs"], loads[1:])]  # their model loading left out
    return runs.outputs, {n: type(runs.timings[n])(s) for n, s in seconds.items()}


def random_model(path: Path, items: pa.Table, seed: int) -> Path:
    """A random tiny Qwen2 over a Qwen-style tokenizer with the catalog's code tokens (speed, not quality); the path
    does not say llama (their evaluate.py strips a BOS for paths that do)."""
    if not (path / "config.json").is_file():
        codes = max_code(items) + 1
        levels = len(items["semantic_id"][0].as_py())
        tok = build_text_tokenizer(levels, codes, 2000, style="qwen")
        tiny_model("qwen2", len(tok), seed=seed).save_pretrained(path)
        tok.save_pretrained(path)
    return path


def max_code(items: pa.Table) -> int:
    """The largest code of the catalog's semantic IDs."""
    return int(np.max(np.concatenate(items["semantic_id"].to_numpy(zero_copy_only=False))))


@torch.no_grad()
def ours(model, cat, renderer, prefix, histories, k: int, batch: int):
    """beam_search with the template's answer tokens over the histories, `batch` at a time -> one Recommendations."""
    from decoding.beam import Recommendations

    answer = torch.from_numpy(renderer.answer).to(cat.device)
    parts = []
    for a in range(0, len(histories), batch):
        p = renderer.render(pa.array(histories[a : a + batch]), cat.item_tokens, len(prefix))
        ids, mask = p.input_ids.to(cat.device), p.attention_mask.to(cat.device)
        parts.append(beam_search(model, ids, mask, cat, k, prefix=prefix, answer=answer))
    return Recommendations.concat(parts)


def theirs(peer: Path, model_dir: Path, out: Path, p: MiniOneRecParams, device, loads: list) -> list[list[str]]:
    """Their evaluate.py main() on the rows -> each row's predicted semantic IDs, as text, best first; the seconds
    their model loading took appended to `loads`."""
    module, loaded = peer_module(peer, p.dtype, device)
    result = out / "theirs.json"
    module.main(
        base_model=str(model_dir),
        info_file=str(find_layout(peer, p.category).info),
        category=p.category,
        test_data_path=str(out / "rows.csv"),
        result_json_data=str(result),
        batch_size=p.their_batch,
        num_beams=p.beams,
        length_penalty=0.0,
    )
    loads.append(loaded["seconds"])
    return [list(r["predict"]) for r in json.loads(result.read_text())]


def peer_module(peer: Path, dtype: str, device):
    """Their evaluate.py, loaded from `peer` (their data.py and LogitProcessor.py beside it), its model loading
    redirected to local files in `dtype` on `device` -> (module, {"seconds": its last model load})."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("data", "LogitProcessor"):  # theirs (evaluate.py imports them), not modules of the same name
        sys.modules.pop(name, None)
    spec = importlib.util.spec_from_file_location("minionerec_evaluate", peer / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(peer))
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise FileNotFoundError(
            f"{peer / 'evaluate.py'}: {e}; install their requirements (pip install fire accelerate bitsandbytes)"
        ) from None
    finally:
        sys.path.remove(str(peer))
    loaded = {"seconds": 0.0}

    class Model:  # their AutoModelForCausalLM.from_pretrained(base_model, torch_dtype=bfloat16, device_map="auto")
        @staticmethod
        def from_pretrained(path, **_):
            t0 = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, dtype), local_files_only=True, trust_remote_code=False
            ).to(device)
            loaded["seconds"] = time.perf_counter() - t0
            return model

    class Tokenizer:
        @staticmethod
        def from_pretrained(path, **_):
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)

    module.AutoModelForCausalLM, module.AutoTokenizer, module.device = Model, Tokenizer, str(device)
    return module, loaded


def sid_texts(tokens: torch.Tensor, tok) -> list[list[str]]:
    """token ids [U, K, L] (-1 = none) -> each row's semantic IDs as text ('' = none)."""
    names = np.asarray(tok.convert_ids_to_tokens(tokens.clamp(min=0).flatten().tolist()), dtype=object)
    names = names.reshape(tokens.shape)
    return [["".join(n) if t[0] >= 0 else "" for n, t in zip(nr, tr)] for nr, tr in zip(names, tokens.tolist())]


@torch.no_grad()
def score_lists(model, full, lists: list[list[str]], tok, answer: np.ndarray, k: int) -> torch.Tensor:
    """Each row's listed semantic IDs (text) scored by a plain forward of prompt + codes + answer tokens: the sum of
    their log_softmax over the full vocabulary -> [U, k] (-inf where the text is not L code tokens)."""
    u = len(lists)
    scores = torch.full((u, k), float("-inf"))
    for r, row in enumerate(lists):
        ids = [tok.convert_tokens_to_ids(CODE.findall(s)) for s in row[:k]]
        good = [j for j, t in enumerate(ids) if t and all(isinstance(x, int) for x in t)]
        if not good:
            continue
        seqs = torch.tensor([ids[j] + answer.tolist() for j in good])  # [G, L + T]
        prompt = full.input_ids[r : r + 1].expand(len(good), -1)
        mask = full.attention_mask[r : r + 1].expand(len(good), -1)
        seq = torch.cat([prompt, seqs], 1).to(model.device)
        scores[r, good] = sequence_logprob(model, seq, mask.to(model.device), seqs.shape[1]).float().cpu()
    return scores


def agreement(model, full, cat: Catalog, renderer, rec, their_lists: list[list[str]], tok) -> dict:
    """Ours against theirs, by semantic ID text: lists identical (all users; users clear of a float32 near-tie),
    invalid items in either, score differences where the items agree (numerics) and at the first rank they do not."""
    k = rec.item_ids.shape[1]
    our_lists = sid_texts(rec.token_ids.cpu(), tok)
    catalog = set(sid_texts(cat.tokens.cpu()[None], tok)[0])
    their = [[s.strip() for s in row[:k]] for row in their_lists]
    same = np.array([a == b for a, b in zip(our_lists, their)])
    their_scores = score_lists(model, full, their, tok, renderer.answer, k)  # [U, k]
    ours_scores = rec.scores.cpu()
    agree = torch.tensor([[x == y for x, y in zip(a, b)] for a, b in zip(our_lists, their)])  # [U, k]
    diff = (ours_scores - their_scores).abs()[agree & torch.isfinite(their_scores)]
    # the float32 noise of a score, measured in this run (the same items scored by the tree and by a plain forward),
    # at least one rounding of the largest score: a user is clear of a near-tie when its tie gap is twice that
    eps = torch.finfo(torch.float32).eps
    bound = max(
        float(diff.max()) if diff.numel() else 0.0, float(eps * ours_scores[torch.isfinite(ours_scores)].abs().max())
    )
    clear = (rec.stats["tie_gap"].cpu() > 2 * bound).numpy()
    first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(our_lists, their)]
    gaps = [float(ours_scores[r, j] - their_scores[r, j]) for r, j in enumerate(first) if j is not None]
    return {
        "users": len(their),
        "identical": int(same.sum()),
        "clear_users": int(clear.sum()),
        "identical_clear": int(same[clear].sum()),
        "invalid_theirs": int(sum(s not in catalog for row in their for s in row)),
        "invalid_ours": int(sum(s not in catalog for row in our_lists for s in row if s)),
        "short_theirs": int(sum(len(row) < k for row in their)),
        "max_abs_score_diff_same_item": float(diff.max()) if diff.numel() else 0.0,
        "float32_bound": bound,  # the measured noise: a near-tie is a tie gap below twice this
        "first_difference": {
            "users": len(gaps),
            "our_minus_their_score": {"min": min(gaps), "max": max(gaps)} if gaps else None,
        },
    }


def markdown_minionerec(result: dict) -> str:
    a, names = result["agreement"], result["names"]
    speed_up = {n: f"{r['median']:.1f}x ({r['low']:.1f}-{r['high']:.1f})" for n, r in result["speed_up"].items()}
    rows = [
        [names[n], fmt_spread(result["users_per_s"][n]), speed_up.get(n, "1x")]
        for n in ("theirs", "ours_theirs", "ours")
    ]
    f = a["first_difference"]
    lines = [
        f"## MiniOneRec's evaluate.py vs beam_search ({result['args']['category']}, {a['users']} test rows)",
        "",
        f"Model: `{result['model']}` ({result['args']['dtype']}), {result['args']['beams']} beams and items per user.",
        "",
        table(["method", "users/s", "speed-up over theirs"], rows, ["left", "right", "right"]),
        "",
        f"- lists identical (by semantic ID): {a['identical']} of {a['users']} users; among the {a['clear_users']} "
        f"clear of a float32 near-tie (tie gap > 2 x {a['float32_bound']:.1e}): {a['identical_clear']}",
        f"- invalid items returned: theirs {a['invalid_theirs']}, ours {a['invalid_ours']}; their lists shorter "
        f"than {result['args']['beams']}: {a['short_theirs']}",
        f"- score differences where the items agree: at most {a['max_abs_score_diff_same_item']:.2e} (their items "
        "scored by a plain forward of prompt + codes + answer tokens)",
        f"- users whose lists differ: {f['users']}"
        + (
            f"; at the first differing rank our item scores {f['our_minus_their_score']['min']:+.2e} .. "
            f"{f['our_minus_their_score']['max']:+.2e} over theirs"
            if f["users"]
            else ""
        ),
        "- " + compare("beam_search", "their evaluate.py", result["speed_up"]["ours_theirs"]) + " at their settings",
        "",
        footer(result["environment"]),
    ]
    return "\n".join(lines)
