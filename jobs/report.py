"""Cost/throughput report of a published nightly run:
`python -m jobs.report --run URI [--compare URI] [--gpu-hour-price 2.5] [--out URI] [--screenshot PNG]`.

URI: a run folder (`<output>/run_date=D/run_id=R`), a run date folder (its _LATEST run) or an output root (its
newest published run); local or s3:// (endpoint from --endpoint or AWS_ENDPOINT_URL, credentials from the
environment). Writes report.md, report.html (self-contained: plots embedded), report.json and figures/*.png into
--out (default: `<run>/report`, or `<run>/report-vs-<compare run id>` with --compare). With --compare, the speed-up is
the users/s of --run over those of --compare, and the outputs are checked for identity user by user, rank by rank.
A run evaluated by `python -m jobs.evaluate` (its `<run>/report/evaluation.json`) adds a quality section.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs.cli import non_negative_float, prog, storage_args
from pipeline import storage as S
from pipeline.storage import Storage


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("jobs.report"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", required=True, help="the run to report")
    p.add_argument("--compare", help="a second run, side by side (the baseline of the speed-up)")
    p.add_argument("--gpu-hour-price", type=non_negative_float, default=2.5, help="USD per accelerator-hour")
    p.add_argument("--out", help="output folder or s3:// prefix (default: inside the run)")
    p.add_argument(
        "--screenshot",
        nargs="?",
        const="report.png",
        metavar="PNG",
        help="also render the HTML in headless Chromium to this PNG (default file: %(const)s); $CHROMIUM or "
        "chromium on PATH",
    )
    storage_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    from pipeline.report import report_run, screenshot_report

    args = parse_args(argv)
    storage = Storage(endpoint=args.endpoint, region=args.region)
    try:
        doc, out = report_run(args.run, storage, args.compare, args.out, args.gpu_hour_price)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.screenshot:
        try:
            screenshot_report(out, Path(args.screenshot), storage)
        except (FileNotFoundError, RuntimeError) as e:
            print(f"error: the report is written, but --screenshot failed: {e}", file=sys.stderr)
            return 2
    print(S.read_bytes(S.join(out, "report.md"), storage).decode())
    print(
        f"report: {S.join(out, 'report.html')}"
        + (
            f", speed-up {doc['speedup']['users_per_s']:.2f}x, outputs "
            f"{'identical' if doc['outputs']['identical'] else 'differ'}"
            if doc["outputs"]
            else ""
        ),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
