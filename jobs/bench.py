"""Benchmarks, side by side in one run: `python -m jobs.bench {all,decode,speculative,disc,disc-bias,nightly} ...`.

Every timed comparison runs its methods interleaved (A B, B A, ...) --repeats times (default 5) after a warm-up run
of each and records every repeat's seconds; reports give medians with (min-max), ratios of medians with their range,
and verdicts say "within noise" where two methods' ranges overlap. The code lives in pipeline/bench/.

all: decode, speculative, disc and disc-bias in one process (about 10 minutes on 2 CPU cores with the demo models;
flags scale it up on a GPU) -> all.md + all.json: hardware, versions, seeds, command, every repeat, verdicts.
decode: `transformers` constrained beam search vs `beam_search` on the same prompts and batches; then the catalog
index per decoding step (CSR `allowed_next`, PPV `verify`) against a CPU trie.
speculative: AtSpeed speculative beam search (strict, relaxed) with every draft vs `beam_search`, in the AtSpeed
Table 1 layout (WS@K walltime speed-up, AS@K accepted steps per verification), at batch 1 and a throughput batch.
disc: ms per user of `disc_sample` (rounds 1..R, exact and PPV) vs `constrained_sample` and `beam_search`.
disc-bias: DISC's bias: TV / KL / mean valid mass of each sampler's draws against the exact constrained P_S.
nightly: the nightly Ray job (one actor) vs the recommender called directly on the same batches.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from jobs.cli import non_negative, non_negative_float, positive
from pipeline.bench import params as P

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo-target"
PARAMS = {"all": P.AllParams, "decode": P.DecodeParams, "speculative": P.SpeculativeParams, "disc": P.DiscParams,
          "disc-bias": P.DiscBiasParams, "nightly": P.NightlyParams}
HELP = {"all": "every claim in one run (decode, speculative, disc, disc-bias) -> all.{md,json}",
        "decode": "transformers beam search vs beam_search, and the catalog index",
        "speculative": "AtSpeed Table 1: speculative vs beam_search, every draft, strict/relaxed",
        "disc": "DISC (rounds 1..R, exact and PPV) vs constrained sampling vs beam_search",
        "disc-bias": "DISC's bias: TV / KL of each sampler to the exact constrained P_S",
        "nightly": "the nightly job on one actor vs direct calls on the same users"}


def defaults(cls) -> dict:
    """The dataclass's field defaults, as a subparser's defaults."""
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(cls)
            if f.default is not MISSING or f.default_factory is not MISSING}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", required=True)
    sp = {name: sub.add_parser(name, help=HELP[name], description=HELP[name],
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter) for name in PARAMS}
    for name, s in sp.items():
        s.set_defaults(**defaults(PARAMS[name]))  # explicit defaults below (paths) take precedence
        if name != "nightly":  # every benchmark on Beauty: data, precision, device, seed
            s.add_argument("--data", default=str(ROOT / "data" / "beauty"), help="prepared data (jobs.prepare_data)")
            s.add_argument("--history-len", type=positive)
            s.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
            s.add_argument("--seed", type=int)
        s.add_argument("--device", help="cpu or cuda (None: cuda if available)")
        s.add_argument("--out", default=str(ROOT / "bench-out"), help="folder for NAME.json and NAME.md")
        if name != "disc-bias":
            s.add_argument("--repeats", type=positive, help="timed runs of each method, interleaved, after one "
                           "warm-up run each (fewer than 5 only for smoke tests)")
    for s in (sp["decode"], sp["disc"]):  # the model when none is given: a random Llama of --layers x --hidden
        for flag in ("--layers", "--hidden", "--heads"):
            s.add_argument(flag, type=positive)
        s.add_argument("--attn", choices=["sdpa", "eager"])
    d = sp["decode"]
    d.add_argument("--model", help="local model dir (None: a random Llama of --layers x --hidden)")
    for flag in ("--users", "--batch", "--k", "--top-m"):
        d.add_argument(flag, type=positive)
    d.add_argument("--index-items", type=positive, nargs="*", help="synthetic catalog sizes for the index benchmark")
    d.add_argument("--trie-max-items", type=non_negative, help="skip the CPU trie above this size")
    s = sp["speculative"]
    s.add_argument("--target", default=str(DEMO))
    s.add_argument("--drafts", nargs="*", default=None, help="draft model dirs (None: models/demo-draft*)")
    s.add_argument("--ks", type=positive, nargs="+")
    s.add_argument("--users", type=positive, help="users at batch size 1")
    s.add_argument("--batch", type=positive, help="the throughput batch size")
    for flag in ("--throughput-users", "--draft-beams", "--gamma"):
        s.add_argument(flag, type=positive)
    s.add_argument("--temperature", type=non_negative_float)
    s.add_argument("--with-transformers", action=argparse.BooleanOptionalAction)
    dc = sp["disc"]
    dc.add_argument("--model", default=str(DEMO) if (DEMO / "config.json").is_file() else None,
                    help="local model dir (models/demo-target if trained, else None: a random Llama)")
    for flag in ("--k", "--users", "--batch", "--max-rounds", "--top-m"):
        dc.add_argument(flag, type=positive)
    dc.add_argument("--temperature", type=non_negative_float)
    db = sp["disc-bias"]
    db.add_argument("--model", default=str(DEMO), help="trained model dir")
    db.add_argument("--users", type=positive)
    db.add_argument("--draws", type=positive, help="items drawn per user and method (k=1 each)")
    db.add_argument("--batch", type=positive, help="draws per batch")
    db.add_argument("--rounds", type=positive, nargs="+", help="DISC rounds to compare")
    al = sp["all"]
    al.add_argument("--target", default=str(DEMO), help="the target model of every section")
    al.add_argument("--drafts", nargs="*", default=None, help="draft model dirs (None: models/demo-draft*)")
    al.add_argument("--sections", nargs="+", choices=P.SECTIONS)
    al.add_argument("--users", type=positive, help="users of decode, disc and the speculative throughput batch")
    al.add_argument("--batch", type=positive, help="batch size of decode, disc and speculative")
    al.add_argument("--k", type=positive, help="K of decode")
    al.add_argument("--index-items", type=positive, nargs="*", help="synthetic catalog sizes for the index benchmark")
    al.add_argument("--ks", type=positive, nargs="+", help="speculative K (the Table 1 columns)")
    al.add_argument("--batch1-users", type=positive, help="speculative users at batch size 1")
    al.add_argument("--disc-k", type=positive, help="items per user of the disc timing")
    al.add_argument("--rounds", type=positive, nargs="+", help="DISC rounds of disc-bias (the disc timing: 1..max)")
    al.add_argument("--bias-users", type=positive)
    al.add_argument("--draws", type=positive, help="disc-bias draws per user and method")
    for s in (db, al):
        s.add_argument("--temperature", type=non_negative_float)
        s.add_argument("--chunk", type=positive, help="disc-bias: catalog items per forward when scoring P_S (lower "
                       "it for large vocabularies: the chunk holds [chunk, L, vocab] float64)")
    nb = sp["nightly"]
    nb.add_argument("--config", default=str(ROOT / "infra" / "configs" / "demo.yaml"))
    nb.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    nb.add_argument("--cpus", type=positive, help="CPUs of the local Ray")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.bench in ("speculative", "all") and args.drafts is None:
        args.drafts = sorted(str(d) for d in (ROOT / "models").glob("demo-draft*") if (d / "config.json").is_file())
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cls = PARAMS[args.bench]
    params = cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
    command = "python -m jobs.bench " + shlex.join(argv)
    from pipeline.bench import common, decode, disc, nightly, speculative
    from pipeline.bench.all import bench_all

    run = {"all": bench_all, "decode": decode.run_decode, "speculative": speculative.run_speculative,
           "disc": disc.run_disc, "disc-bias": disc.run_disc_bias, "nightly": nightly.run_nightly_bench}[args.bench]
    try:
        result, md = run(params, command)
    except FileNotFoundError as e:  # missing data or models: the message says how to make them
        print(f"error: {e}", file=sys.stderr)
        return 2
    common.write_result(Path(args.out), args.bench, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
