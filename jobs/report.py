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
import tempfile
from pathlib import Path

from jobs.cli import storage_args
from pipeline import storage as S
from pipeline.config import Storage


def main(argv=None) -> int:
    from pipeline.report import screenshot, write_report
    from pipeline.runs import load_run, report_dir

    p = argparse.ArgumentParser(prog="python -m jobs.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the run to report")
    p.add_argument("--compare", help="a second run, side by side (the baseline of the speed-up)")
    p.add_argument("--gpu-hour-price", type=float, default=2.5, help="USD per accelerator-hour (default 2.5)")
    p.add_argument("--out", help="output folder or s3:// prefix (default: inside the run)")
    p.add_argument("--screenshot", help="also render the HTML in headless Chromium to this PNG (local --out only)")
    storage_args(p)
    args = p.parse_args(argv)
    storage = Storage(endpoint=args.endpoint, region=args.region)
    if args.gpu_hour_price < 0:
        p.error(f"--gpu-hour-price must be >= 0, got {args.gpu_hour_price}")
    try:
        run = load_run(args.run, storage)
        compare = load_run(args.compare, storage) if args.compare else None
        out = args.out or report_dir(run.uri, compare.run_id if compare else None)
        doc = write_report([run] + ([compare] if compare else []), out, storage, args.gpu_hour_price)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.screenshot:
        html = Path(out) / "report.html"
        if S.is_s3(out):
            html = Path(tempfile.mkdtemp()) / "report.html"
            html.write_bytes(S.read_bytes(S.join(out, "report.html"), storage))
        try:
            screenshot(html, Path(args.screenshot))
        except (FileNotFoundError, RuntimeError) as e:
            print(f"error: the report is written, but --screenshot failed: {e}", file=sys.stderr)
            return 2
    print(S.read_bytes(S.join(out, "report.md"), storage).decode())
    print(f"report: {S.join(out, 'report.html')}" + (f", speed-up {doc['speedup']['users_per_s']:.2f}x, outputs "
          f"{'identical' if doc['outputs']['identical'] else 'differ'}" if doc["outputs"] else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
