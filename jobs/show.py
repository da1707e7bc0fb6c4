"""Show a published run: `genrec-batch show RUN [--json]`.

RUN is an output root (its newest date's published run), `<output>/run_date=D` (that date's) or a run folder; local
or s3:// (credentials from the environment). Prints the run's summary (date, id, status, mode, models, counts, time)
and every file of its tables as the manifest lists them: what readers read (docs/output.md). `--json` prints the
manifest instead. A run folder must be its date's published run (_LATEST names it); `--any` shows it anyway, labelled
UNPUBLISHED. Exit 0; 2 when there is no published run there.
"""

from __future__ import annotations

import argparse
import json
import sys

from jobs.cli import prog, storage_args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("jobs.show"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run", metavar="RUN", help="output root, run_date= folder or run folder (path or s3:// URI)")
    p.add_argument("--json", action="store_true", help="print the run's manifest (JSON) instead of the summary")
    p.add_argument(
        "--any", action="store_true", help="show a run folder even if its date's _LATEST does not name it (unpublished)"
    )
    storage_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.output import describe, open_run
    from pipeline.storage import Storage

    try:
        run = open_run(args.run, Storage(args.endpoint, args.region), allow_unpublished=args.any)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(run.manifest, indent=2) if args.json else describe(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
