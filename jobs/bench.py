"""Benchmarks, side by side in one run: `python -m jobs.bench {all,decode,speculative,disc,disc-bias,nightly,processor,
templates,shapes,compile,gpu,precision,exclude,padding,minionerec,items,delisted} ...`.

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
processor: the processor in a Ray Data pipeline (read_parquet -> processor -> write_parquet) vs the nightly job on the
same synthetic users, interleaved: users/s, every user once, each driver's peak memory.
templates: rendering cost of each prompt template (renderer vs tokenizer), and the nightly job's users/s with each.
shapes: beam_search vs transformers over vocabulary x prompt length x K, each method in its own process (memory).
compile: the compiled engine's cold compile (a fresh process, an empty inductor cache) at 2, 8 and 28 decoder layers.
gpu: on CUDA in one process and one report (`make bench-gpu`): parity, the shapes grid, NVIDIA SID-GR's shape (the
anchor), each cell's useful-FLOP fraction of the matmul rate measured in the same run; DISC and speculative on demand.
precision: what half precision costs in ranking: beam_search in each dtype (float32 head, and logits rounded to the
model's dtype) against transformers in float32 on real users: identical top-K lists, set overlap, score differences.
exclude: what per-user exclusions cost beam_search: none vs 50 vs 1,000 excluded items per user (history first).
padding: Beauty users in batches cut in input order vs ordered by prompt length (as the actor decodes them): users/s,
target and KV tokens per user, the padding share of prompt positions, the compiled engine's buckets; --prompt-tokens
stretches Beauty's length distribution to a prefill-heavy length.
items: the constraint index over a synthetic catalog and over a recommendable subset of it (seconds, peak memory),
and what a nightly actor holds for its items, in bytes per item; each in a fresh process.
delisted: the demo nightly with items delisted: taken out of the catalog, and left out of the recommendable set.
minionerec: a peer run: MiniOneRec's evaluate.py, imported from --peer (a copy of their repository), against
beam_search with the minionerec template on the same model and test rows: lists, invalid items, scores, users/s.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path

from jobs.cli import dataclass_args, prog
from pipeline.bench import params as P
from pipeline.bench.budget import since_process_start
from pipeline.bench.sections import BENCHES, run_section
from pipeline.config import DEMO_CONFIG

ROOT = Path()  # the working directory, as `make demo` lays it out (data/, models/, bench-out/)
DEMO = ROOT / "models" / "demo-target"
PATHS = {
    "data": str(ROOT / "data" / "beauty"),
    "target": str(DEMO),
    "out": str(ROOT / "bench-out"),
    "config": str(DEMO_CONFIG),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog("jobs.bench"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="bench", required=True)
    for name, section in BENCHES.items():
        cls = section.params
        s = sub.add_parser(
            name, help=section.help, description=section.help, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        names = {f.name for f in fields(cls)}
        paths = {k: v for k, v in PATHS.items() if k in names and (name, k) != ("gpu", "target")}  # gpu: random
        values = {**P.field_defaults(cls), **paths}
        special = {"seed", "drafts", "overrides", *P.CHOICES, *P.LISTS} & names
        dataclass_args(s, cls, skip=special, zero_ok=("trie_max_items",), helps=P.FLAG_HELP, defaults=values)
        for field_name in [f.name for f in fields(cls) if f.name in special and f.name in P.CHOICES]:  # in order
            choices = P.GPU_SECTIONS if (name, field_name) == ("gpu", "sections") else P.CHOICES[field_name]
            s.add_argument(
                "--" + field_name.replace("_", "-"),
                dest=field_name,
                choices=choices,
                default=values[field_name],
                help=P.FLAG_HELP.get(field_name),
                nargs="+" if field_name in P.LISTS else None,
            )
        if "seed" in names:
            s.add_argument("--seed", type=int, default=values["seed"])
        if "drafts" in names:  # may be given empty: a clear error then
            s.add_argument("--drafts", nargs="*", help=P.FLAG_HELP["drafts"])
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
    cls = BENCHES[args.bench].params
    params = cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
    try:
        command = "python -m jobs.bench " + shlex.join(argv)
        started = time.monotonic() - since_process_start()  # gpu's budget counts the imports and the data
        kw = {"started": started} if args.bench == "gpu" else {}
        result, md = run_section(args.bench, params, command, **kw)
    except FileNotFoundError as e:  # missing data or models: the message says how to make them
        print(f"error: {e}", file=sys.stderr)
        return 2
    if getattr(params, "plan", False):  # bench gpu --plan: expected seconds, nothing measured or written
        print(md)
        return 0
    from pipeline.bench.common import write_result

    write_result(Path(args.out), args.bench, result, md)
    if getattr(params, "page", None):  # bench gpu --page DIR: the report kept as a dated page
        from pipeline.bench.gpu import write_page

        print(f"page: {write_page(Path(params.page), result, md)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
