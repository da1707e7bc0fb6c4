"""Offline evaluation of a published run: `python -m jobs.evaluate --run URI [--input URI] [--out URI]`.

Recall@K and NDCG@K (K = 1, 5, 10, 20 by default) of the run's recommendations against the input's `target_items`
(users without targets skipped, the paper's convention). --input defaults to the run's configured input. Writes
evaluation.json and evaluation.md next to the report (default: `<run>/report`); `python -m jobs.report` then adds a
quality section.
"""
from __future__ import annotations

import argparse
import json
import sys

from jobs.cli import storage_args
from pipeline import storage as S
from pipeline.config import Storage


def main(argv=None) -> int:
    from pipeline.evaluate import KS, evaluate_run, to_markdown
    from pipeline.runs import load_run, report_dir

    p = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a run folder, run date folder or output root (local or s3://)")
    p.add_argument("--input", help="histories with target_items (default: the run's input)")
    p.add_argument("--out", help="output folder (default: <run>/report)")
    p.add_argument("--ks", type=int, nargs="+", default=list(KS))
    storage_args(p)
    args = p.parse_args(argv)
    if min(args.ks) < 1:
        p.error(f"--ks must be >= 1, got {args.ks}")
    storage = Storage(endpoint=args.endpoint, region=args.region)
    try:
        run = load_run(args.run, storage)
        result = evaluate_run(run, args.input or run.manifest["config"]["input"], storage, tuple(args.ks))
    except (FileNotFoundError, ValueError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or report_dir(run.uri)
    S.write_bytes(S.join(out, "evaluation.json"), json.dumps(result, indent=2).encode(), storage)
    S.write_bytes(S.join(out, "evaluation.md"), to_markdown(result).encode(), storage)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
