"""Prepare data: `python -m jobs.prepare_data [--source DIR] [--out DIR] [--history-len N]` (Amazon Beauty),
`python -m jobs.prepare_data --format lcrec --source DIR --out DIR [--index FILE] [--id-offset N]` (the LC-Rec /
AtSpeed layout: an index JSON mapping item ids to code tokens, e.g. `beauty.LCRec-1e-3lr.json`, and
`sequential_{train,valid,test}.txt`, one line per user `user item item ...`; the AtSpeed authors' text files count
from 1 where their index counts from 0: `--id-offset -1`),
`python -m jobs.prepare_data --format minionerec --source DIR --out DIR [--category NAME]` (MiniOneRec's layout, its
repository or data/Amazon: index/, info/, train|valid|test/ CSVs; every CSV row a unit keyed `<user_id>#<row>`),
`python -m jobs.prepare_data --format openonerec --source DIR --out DIR [--pid2sid FILE]` (OpenOneRec's RecIF release:
onerec_bench_release.parquet and video_ad_pid2sid.parquet; every row a user, histories of pids as their video prompt
writes them, the items' popularity beside their semantic IDs),
or `python -m jobs.prepare_data --synthetic --users N --items M [--levels 4 --codes 256 --seed 0] --out DIR`.

Add `--allow-mismatch` to import a source whose item ids or semantic ids disagree with its index (refused otherwise,
exit 2, naming file, row and values); prepare.json and the summary record it. Prints the summary as JSON; a bad input
exits 2 with one line naming the file, row, column and value. The logic lives in pipeline/prepare/ (a module per
source; contract.py writes the folder, items.parquet last: a folder without it is not prepared, and a rerun imports
it again).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from jobs.cli import positive, prog, synthetic_flags
from pipeline.prepare import BEAUTY_SOURCE, prepare_source, write_synthetic
from pipeline.prepare.openonerec import HIST_MAX_LEN

DEFAULT_SOURCE = BEAUTY_SOURCE


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("jobs.prepare_data"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source_flags(p)
    p.add_argument("--out", type=Path, default=Path("data/beauty"), help="output folder, default %(default)s")
    p.add_argument(
        "--history-len", type=positive, default=None, help="items per prompt, default 20 (openonerec: their 512)"
    )
    synthetic_flags(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def source_flags(p: argparse.ArgumentParser) -> None:
    """The source's format and folder, and the LC-Rec layout's index, id offset and code-token naming."""
    p.add_argument(
        "--format",
        choices=["beauty", "lcrec", "minionerec", "openonerec"],
        default="beauty",
        help="beauty: items/train/valid/test.parquet; lcrec: *.index.json + sequential_*.txt; minionerec: "
        "index/<Category>.index.json + info/ + train|valid|test/<Category>_*.csv; openonerec: "
        "onerec_bench_release.parquet + video_ad_pid2sid.parquet",
    )
    p.add_argument("--pid2sid", type=Path, default=None, help="openonerec: the pid2sid parquet (default: beside)")
    p.add_argument("--category", default=None, help="minionerec: the category, e.g. Office_Products (default: the one)")
    p.add_argument(
        "--source", type=Path, default=None, help=f"the source folder (default for --format beauty: {DEFAULT_SOURCE})"
    )
    p.add_argument(
        "--index",
        type=Path,
        default=None,
        help="lcrec: the index JSON (default: the one JSON file in --source mapping item ids to code tokens)",
    )
    p.add_argument(
        "--id-offset",
        type=int,
        default=None,
        help="lcrec: added to every user and item id of the interaction files (e.g. -1 for files that "
        "count from 1 against an index from 0); without it, ids that look shifted are refused",
    )
    p.add_argument(
        "--code-token", default="<{level}_{code}>", help="how the LC-Rec index names code tokens, default %(default)s"
    )
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="import even where item ids or semantic ids disagree with the index (else exit 2 naming them); "
        "prepare.json and the summary record it",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags that go together (p.error names what is missing or misplaced)."""
    if args.synthetic:
        if args.users is None or args.items is None:
            p.error("--synthetic needs --users and --items")
        if args.levels > 26:
            p.error(f"--levels must be at most 26, got {args.levels}")
        if args.items > args.codes**args.levels:
            p.error(f"--items {args.items} > codes**levels = {args.codes**args.levels}")
    elif args.users is not None or args.items is not None:
        p.error("--users / --items need --synthetic")
    if args.format != "openonerec" and args.pid2sid is not None:
        p.error("--pid2sid needs --format openonerec")
    if args.format == "openonerec" and args.allow_mismatch:
        p.error("--allow-mismatch: an openonerec import counts the pids pid2sid lacks (their prompts skip them)")
    if args.history_len is None:
        args.history_len = HIST_MAX_LEN if args.format == "openonerec" else 20
    if args.format in ("lcrec", "minionerec", "openonerec") and args.source is None:
        p.error(f"--format {args.format} needs --source DIR")
    if args.format != "minionerec" and args.category is not None:
        p.error("--category needs --format minionerec")
    if args.format != "lcrec" and (args.index is not None or args.id_offset is not None):
        p.error("--index / --id-offset need --format lcrec")
    source = args.source or (None if args.synthetic or args.format != "beauty" else DEFAULT_SOURCE)
    if source is not None and args.out.resolve().is_relative_to(source.resolve()):
        p.error(f"--out {args.out} is inside the source folder {source}: write the prepared copy elsewhere")
    if args.synthetic and args.allow_mismatch:
        p.error("--allow-mismatch is for imports, not --synthetic")


def main(argv=None) -> int:
    """Exit 0 with the summary on stdout; 2 with one `prepare_data: error:` line naming the bad file, row, column
    and value, or the ids that disagree with the index (nothing prepared)."""
    args = parse_args(argv)
    try:
        summary = prepare(args)
    except ValueError as e:  # a bad input file: name it, no traceback
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(summary), indent=2))
    return 0


def prepare(args: argparse.Namespace):
    """The import or the synthetic data the flags ask for -> its summary."""
    if args.synthetic:
        return write_synthetic(args.out, args.users, args.items, args.levels, args.codes, args.seed,
                               history_len=args.history_len, chunk_users=args.chunk_users)  # fmt: skip
    options = {k: getattr(args, k) for k in ("code_token", "index", "id_offset", "allow_mismatch", "pid2sid")}
    return prepare_source(args.format, args.source or DEFAULT_SOURCE, args.out, args.history_len,
                          category=args.category, **options)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
