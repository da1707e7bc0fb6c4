"""Offline evaluation of a published run: `python -m jobs.evaluate --run URI [--input URI] [--out URI]`.

Recall@K and NDCG@K (K = 1, 5, 10, 20 by default) of the run's recommendations against the input's `target_items`
(users without targets skipped, the paper's convention). --input defaults to the run's configured input. Writes
evaluation.json and evaluation.md next to the report (default: `<run>/report`); `python -m jobs.report` then adds a
quality section. The report states the run's exclusion setting (decoding.exclude); --targets unseen scores against
each user's targets without its history items (the protocol of a run with exclude: history; default: all, as the
AtSpeed paper scores).
"""

from __future__ import annotations

import argparse
import sys

from jobs.cli import positive, prog, storage_args
from pipeline.storage import Storage


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.evaluate import KS, TARGETS

    p = argparse.ArgumentParser(
        prog=prog("jobs.evaluate"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", required=True, help="a run folder, run date folder or output root (local or s3://)")
    p.add_argument("--input", help="histories with target_items (default: the run's input)")
    p.add_argument("--out", help="output folder (default: <run>/report)")
    p.add_argument("--ks", type=positive, nargs="+", default=list(KS))
    p.add_argument(
        "--targets",
        choices=list(TARGETS),
        default="all",
        help="; ".join(f"{name}: targets {meaning}" for name, meaning in TARGETS.items()),
    )
    storage_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from pipeline.evaluate import evaluate, to_markdown

    args = parse_args(argv)
    try:
        result = evaluate(
            args.run,
            Storage(endpoint=args.endpoint, region=args.region),
            args.input,
            args.out,
            tuple(args.ks),
            args.targets,
        )
    except (FileNotFoundError, ValueError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
