"""Benchmarks, side by side in one run: `python -m jobs.bench {all,decode,speculative,disc,disc-bias,nightly,
templates,shapes,gpu,precision,exclude} ...`.

Every timed comparison runs its methods interleaved (A B, B A, ...) --repeats times (default 5) after a warm-up run
of each and records every repeat's seconds; reports give medians with (min-max), ratios of medians with their range,
and verdicts say "within noise" where two methods' ranges overlap. The code lives in pipeline/bench/; every flag is a
field of that section's parameters (pipeline/bench/params.py).

all: decode, speculative, disc and disc-bias in one process (about 3 minutes on 2 quiet CPU cores with the demo
models; flags scale it up on a GPU) -> all.md + all.json: hardware, versions, seeds, command, every repeat, verdicts.
decode: `transformers` constrained beam search vs `beam_search` on the same prompts and batches; then the catalog
index per decoding step (CSR `allowed_next`, PPV `verify`) against a CPU trie.
speculative: AtSpeed speculative beam search (strict, relaxed) with every draft vs `beam_search`, in the AtSpeed
Table 1 layout (WS@K walltime speed-up, AS@K accepted steps per verification), at batch 1 and a throughput batch.
disc: ms per user of `disc_sample` (rounds 1..R, exact and PPV) vs `constrained_sample` and `beam_search`.
disc-bias: DISC's bias: TV / KL / mean valid mass of each sampler's draws against the exact constrained P_S.
nightly: the nightly Ray job (one actor) vs the recommender called directly on the same batches.
templates: rendering cost of each prompt template (renderer vs tokenizer), and the nightly job's users/s with each.
shapes: beam_search vs transformers over vocabulary x prompt length x K, each method in its own process (memory).
gpu: on CUDA in one process and one report (`make bench-gpu`): parity, the shapes grid, NVIDIA SID-GR's shape (the
anchor), each cell's useful-FLOP fraction of the matmul rate measured in the same run; DISC and speculative on demand.
precision: what half precision costs in ranking: beam_search in each dtype (float32 head, and logits rounded to the
model's dtype) against transformers in float32 on real users: identical top-K lists, set overlap, score differences.
exclude: what per-user exclusions cost beam_search: none vs 50 vs 1,000 excluded items per user (history first).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from jobs.cli import dataclass_args
from pipeline.bench import params as P

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo-target"
PARAMS = {
    "all": P.AllParams,
    "decode": P.DecodeParams,
    "speculative": P.SpeculativeParams,
    "disc": P.DiscParams,
    "disc-bias": P.DiscBiasParams,
    "nightly": P.NightlyParams,
    "templates": P.TemplatesParams,
    "nightly-scale": P.ScaleParams,
    "shapes": P.ShapesParams,
    "gpu": P.GpuParams,
    "precision": P.PrecisionParams,
    "exclude": P.ExcludeParams,
}
HELP = {
    "all": "every claim in one run (decode, speculative, disc, disc-bias) -> all.{md,json}",
    "decode": "transformers beam search vs beam_search, and the catalog index",
    "speculative": "AtSpeed Table 1: speculative vs beam_search, every draft, strict/relaxed",
    "disc": "DISC (rounds 1..R, exact and PPV) vs constrained sampling vs beam_search",
    "disc-bias": "DISC's bias: TV / KL of each sampler to the exact constrained P_S",
    "nightly": "the nightly job on one actor vs direct calls on the same users",
    "templates": "prompt templates: rendering cost, and the nightly job's users/s with each",
    "nightly-scale": "the nightly job on synthetic users at scale: exactly once, driver RSS, object store peak",
    "shapes": "beam_search vs transformers over vocabulary x prompt x K, users/s and working memory",
    "gpu": "on CUDA: parity, shapes, the SID-GR anchor, roofline (+ disc, speculative); one report, one process",
    "precision": "half precision's cost in ranking: each dtype's top-K against transformers float32",
    "exclude": "per-user exclusions: beam_search with 0, 50 and 1,000 excluded items per user",
}
PATHS = {
    "data": str(ROOT / "data" / "beauty"),
    "target": str(DEMO),
    "out": str(ROOT / "bench-out"),
    "config": str(ROOT / "infra" / "configs" / "demo.yaml"),
}
FLAG_HELP = {
    "data": "prepared data (python -m jobs.prepare_data)",
    "device": "cpu or cuda (None: cuda if available)",
    "repeats": "timed runs of each method, interleaved, after one warm-up run each (fewer than 5: smoke tests only)",
    "model": "local model dir (None: a random Llama of --layers x --hidden)",
    "drafts": "draft model dirs (default: models/demo-draft*)",
    "index_items": "synthetic catalog sizes (index)",
    "trie_max_items": "no CPU trie above this size",
    "users": "users (speculative: at batch size 1; all: of decode, disc and the speculative throughput batch)",
    "rounds": "DISC rounds (disc-bias; the disc timing runs 1..max)",
    "chunk": "disc-bias: catalog items per forward when scoring P_S (lower it for large vocabularies)",
    "draws": "items drawn per user and method (k=1 each)",
    "cpus": "CPUs of the local Ray",
    "out": "results folder (the nightly job writes under OUT/nightly-bench)",
    "ks": "speculative K (Table 1 columns)",
    "simulate_oom": "methods made to run out of memory at every batch (checks that the report records it)",
    "dtypes": "engine dtypes to compare with transformers in float32",
    "tie": "near-tie threshold on the float32 search's tie gap",
    "counts": "excluded items per user (each against none)",
    "engines": "beam_search engines (decoding/compiled.py): with compiled, eager vs compiled side by side",
    "methods": "shapes: the methods compared (beam_search is the eager engine)",
}
CHOICES = {
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "dtypes": ["float32", "bfloat16", "float16"],
    "attn": ["sdpa", "eager"],
    "sections": P.SECTIONS,
    "templates": ["codes", "lcrec"],
    "simulate_oom": ["beam_search", "transformers"],
    "engines": ["eager", "compiled"],
    "methods": ["beam_search", "beam_search_compiled", "transformers"],
}
LISTS = ("sections", "templates", "simulate_oom", "dtypes", "engines", "methods")  # flags that take several values


def defaults(cls) -> dict:
    """The dataclass's field defaults, as a subparser's defaults."""
    return {
        f.name: f.default_factory() if f.default_factory is not MISSING else f.default
        for f in fields(cls)
        if f.default is not MISSING or f.default_factory is not MISSING
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="bench", required=True)
    for name, cls in PARAMS.items():
        s = sub.add_parser(
            name, help=HELP[name], description=HELP[name], formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        names = {f.name for f in fields(cls)}
        values = {**defaults(cls), **{k: v for k, v in PATHS.items() if k in names}}
        special = {"dtype", "attn", "seed", "drafts", "overrides", *LISTS} & names
        dataclass_args(s, cls, skip=special, zero_ok=("trie_max_items",), helps=FLAG_HELP, defaults=values)
        for field_name in special & set(CHOICES):
            choices = P.GPU_SECTIONS if (name, field_name) == ("gpu", "sections") else CHOICES[field_name]
            s.add_argument(
                "--" + field_name.replace("_", "-"),
                dest=field_name,
                choices=choices,
                default=values[field_name],
                help=FLAG_HELP.get(field_name),
                nargs="+" if field_name in LISTS else None,
            )
        if "seed" in names:
            s.add_argument("--seed", type=int, default=values["seed"])
        if "drafts" in names:  # may be given empty: a clear error then
            s.add_argument("--drafts", nargs="*", help=FLAG_HELP["drafts"])
        if "overrides" in names:
            s.add_argument(
                "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="as jobs.nightly"
            )
        if "out" not in names:
            s.add_argument("--out", default=PATHS["out"], help="folder for NAME.json and NAME.md")
    if (DEMO / "config.json").is_file():  # disc: the trained target when there is one, else a random Llama
        sub.choices["disc"].set_defaults(model=str(DEMO))
        sub.choices["exclude"].set_defaults(model=str(DEMO))
    sub.choices["disc-bias"].set_defaults(model=str(DEMO))
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if getattr(args, "drafts", ...) is None and args.bench != "gpu":
        args.drafts = sorted(str(d) for d in (ROOT / "models").glob("demo-draft*") if (d / "config.json").is_file())
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cls = PARAMS[args.bench]
    params = cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
    try:
        result, md = runner(args.bench)(params, "python -m jobs.bench " + shlex.join(argv))
    except FileNotFoundError as e:  # missing data or models: the message says how to make them
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pipeline.bench.common import write_result

    write_result(Path(args.out), args.bench, result, md)
    return 0


def runner(name: str):
    """The section's function (params, command) -> (result, Markdown), imported only now (the benchmarks load torch,
    which parsing the flags does not need)."""
    from pipeline.bench import decode, disc, exclude, gpu, nightly, precision, scale, shapes, speculative, templates
    from pipeline.bench.all import bench_all

    return {
        "all": bench_all,
        "decode": decode.run_decode,
        "speculative": speculative.run_speculative,
        "disc": disc.run_disc,
        "disc-bias": disc.run_disc_bias,
        "nightly": nightly.run_nightly_bench,
        "templates": templates.run_templates,
        "shapes": shapes.run_shapes,
        "gpu": gpu.run_gpu,
        "nightly-scale": scale.run_scale,
        "precision": precision.run_precision,
        "exclude": exclude.run_exclude,
    }[name]


if __name__ == "__main__":
    sys.exit(main())
