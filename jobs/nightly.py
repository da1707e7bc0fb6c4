"""The nightly job: `python -m jobs.nightly --config FILE [--set a.b=value ...] [--resume RUN_ID|latest] [--gc]`.

On a cluster: `ray job submit --address http://HEAD:8265 --working-dir . --runtime-env infra/runtime_env.yaml --
python -m jobs.nightly --config infra/configs/production.example.yaml`. With no cluster (RAY_ADDRESS unset and none
running) it starts a local Ray. Inputs, catalog and models are checked before Ray starts. Exit codes: 0 and the
manifest on stdout on success; 2 with a message naming the bad file, field or model (nothing is published); 3 when
another run holds the date's lease (nothing is written); 4 when the object store stayed unavailable for
storage.retry_s (one `error:` line naming the store, the URI and the cause; the lease is released if the store lets
it); 5 when no shard committed for runs.stall_exit_s (one `error:` line saying what the run waited for; the lease is
released): resume it, perhaps with another compute.num_actors; 6 when SIGTERM (`ray job stop`, a pod's eviction) or
SIGINT stopped it (one `stopped:` line; the decode shut down, the interruption recorded in the run's _RUN.json, the
lease released): `--resume latest` continues it; 7 when the run is published but its export to serving.url failed
(one `error:` line; readers of the store still see the version before: `genrec-batch export` retries it); 8 the same
for its commit to table.uri; 9 when a worker node cannot read a model from the object store (one `error:` line naming
the node, the URI and the fix: credentials on every worker; nothing published, the lease released). A run that fails
or is killed keeps what it committed: `--resume RUN_ID` (or `--resume latest`: the date's newest unfinished run,
else a new one) decodes only the rest.
`--incremental [BASE]` carries every user whose inputs are unchanged since BASE (by default the newest published run
of the output) when the two runs' fingerprints agree, and decodes the rest (docs/output.md#incremental-runs).
`--gc` deletes the runs superseded more than runs.grace_s ago, then exits. `--check` runs every check the driver makes
before the date's lease (config, input, items, models, template, the store's conditional writes; with --resume, what
it would resume) and exits: 0 and a summary, or the exit code and `error:` line the run would have had.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jobs.cli import prog
from pipeline.config import DEMO_CONFIG, demo_missing, load_config, scheduled_date


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("jobs.nightly"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML config file: a path or an s3:// URI (default: the embedded demo config, which reads data/beauty "
        "and models/demo-* under the working directory: `make demo` makes them)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. decoding.k=20")
    p.add_argument("--resume", metavar="RUN_ID|latest", help="continue a killed or failed run of the date")
    p.add_argument(
        "--incremental",
        nargs="?",
        const="",
        metavar="BASE",
        help="carry the users whose inputs did not change since BASE (a run folder, a run_date= folder or an output "
        "root; default: the newest published run of this output up to the run date) and decode the rest",
    )
    p.add_argument("--gc", action="store_true", help="delete superseded runs older than runs.grace_s, then exit")
    p.add_argument("--check", action="store_true", help="run every check the driver makes before the lease, then exit")
    p.add_argument(
        "--run-date-of",
        metavar="JOB_ID",
        help="run_date = the scheduled day of a RayCronJob's RayJob, from its submission id (RAY_JOB_SUBMISSION_ID)",
    )
    return p.parse_args(argv)


STOPPED = 6  # SIGTERM or SIGINT: the decode shut down, the interruption recorded, the lease released


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipeline.storage import StoreUnavailable

    try:
        dated = [f"run_date={scheduled_date(args.run_date_of)}"] if args.run_date_of is not None else []
        incremental = [] if args.incremental is None else ["incremental.enabled=true"]
        incremental += [f"incremental.base={args.incremental}"] if args.incremental else []
        cfg = load_config(args.config or str(DEMO_CONFIG), args.set + dated + incremental)  # a path or s3:// URI
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StoreUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    if args.config is None and not args.gc and (missing := demo_missing(cfg)):
        print(f"error: {missing}", file=sys.stderr)
        return 2
    from pipeline.nightly import exit_code
    from pipeline.signals import STOP, Interrupted, exit_stopped, ray_cause, stop_note

    STOP.install()
    try:
        summary = run(cfg, args)
    except Interrupted as e:
        exit_stopped(e, bool(args.resume), STOPPED)
    except Exception as e:
        cause = ray_cause(e)  # an error in a Ray task: its own, not Ray's header and remote traceback
        code = exit_code(cause)
        if code is None:
            raise
        print(f"{'refused' if code == 3 else 'error'}: {cause}", file=sys.stderr)
        if note := stop_note(e, bool(args.resume)):  # a signal that met the job's end keeps this error's code
            print(note, file=sys.stderr)
        return code
    print(json.dumps(summary, indent=2))
    return 0


def run(cfg, args) -> dict:
    """--gc, or the nightly run (checked before Ray starts, then on the cluster) -> what main prints."""
    from pipeline.nightly import after_publish, check_run, collect_garbage, run_nightly
    from pipeline.plan import plan_run
    from pipeline.signals import connect_ray

    if args.gc:
        return {"deleted": collect_garbage(cfg)}
    if args.check:  # no lease, no Ray, nothing written: the exit code the run would have had
        return check_run(cfg, args.resume)
    plan = plan_run(cfg, args.resume)  # before Ray: a missing input, catalog or model is refused here
    connect_ray()
    manifest = run_nightly(cfg, args.resume, plan)
    summary = {k: manifest[k] for k in ("run_id", "run_date", "status", "counts", "resume", "timings", "outputs")}
    return summary | after_publish(cfg, manifest)


if __name__ == "__main__":
    sys.exit(main())
