"""Commit a published run to a store (pipeline/stores): serve it from Redis,
`genrec-batch export RUN --to redis://HOST:PORT/DB [--namespace NS]`, or `genrec-batch export --rollback --to
redis://...` (docs/output.md#serving-from-redis); or commit it to a table: `genrec-batch export RUN --to
delta+s3://bucket/prefix` (or delta+/local/path) or `--to iceberg+CATALOG/NAMESPACE.TABLE` (the catalog as pyiceberg
configures it; docs/output.md#reading-the-lists-as-a-table), one commit that replaces the run's date's rows, made
once. A run already committed (by this command or another at once), or no longer its date's published run, is left
as it is (the JSON result says `skipped`).

RUN is an output root (its newest date's published run), `<output>/run_date=D` or a run folder, local or s3://.
Every user's list is written under the run's own version, counted against the manifest, then the namespace's pointer
is switched to it by a compare-and-set against the version the export started from; the previous `--keep` versions
stay for `--rollback`, older ones are removed, readable for `--grace-s` more (a reader that read the pointer just
before keeps its list). A run superseded by a rerun of its date while it is exported is never switched to (the
result says `skipped`). An export killed or failed part-way leaves the pointer where it was;
run it again: it writes only the shards not yet written, then switches. `rediss://` for TLS; the ACL user and
password come from the URL or REDIS_USERNAME and REDIS_PASSWORD, and are never printed.

Exit codes: 0 committed, switched or skipped (the result on stdout as JSON); 2 a bad run, URL or namespace, a run
older than the one served (unless --allow-older), a store that could silently drop keys (an evicting
maxmemory-policy, or no persistence) unless --allow-eviction / --allow-no-persistence, a table whose columns or
partitioning are not the run's, an Iceberg catalog not configured, or an error the store gives that trying again
does not mend (a refused password or permission, out of memory); 3 another export or a rollback changed the pointer
first (this one's version is removed; readers see the other's); 4 the store, the catalog or the object store stayed
unavailable for --retry-s (one `error:` line; nothing changed for readers: run it again).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jobs.cli import prog, storage_args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("jobs.export"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run", metavar="RUN", nargs="?", help="output root, run_date= folder or run folder")
    p.add_argument(
        "--to",
        required=True,
        metavar="URL",
        help="redis:// or rediss://[user:password@]host:port/db, delta+URI or iceberg+CATALOG/NAMESPACE.TABLE",
    )
    p.add_argument("--rows-per-file", type=int, default=2_000_000, help="a table: rows in each data file (2,000,000)")
    p.add_argument("--namespace", default="genrec", help="the keys' namespace (default genrec)")
    p.add_argument("--keep", type=int, default=2, help="previous versions kept for --rollback (default 2)")
    p.add_argument(
        "--grace-s", type=float, default=60.0, help="a removed version stays readable this long (default 60)"
    )
    p.add_argument("--rollback", action="store_true", help="point readers back at the previous version")
    p.add_argument("--writers", type=int, default=4, help="Ray tasks writing at once (default 4)")
    p.add_argument("--retry-s", type=float, default=300.0, help="how long the store's transient errors are retried")
    p.add_argument("--allow-eviction", action="store_true", help="export into a store whose policy may evict")
    p.add_argument("--allow-no-persistence", action="store_true", help="export into a store that does not persist")
    p.add_argument("--allow-older", action="store_true", help="export a run of an earlier date than the current one")
    storage_args(p)
    args = p.parse_args(argv)
    if (args.run is None) != args.rollback:
        p.error("give RUN, or --rollback alone")
    from pipeline import stores
    from pipeline.config import masked_url

    sink = stores.sink(args.to)
    if sink is None:
        p.error(f"--to {masked_url(args.to)}: name a store: {', '.join(f'{x}...' for x in stores.SINKS)}")
    if args.rollback and not hasattr(sink, "rollback"):
        p.error(f"--rollback is for Redis; a {sink.NAME} keeps its history (roll it back with its own tools)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return export(args)


def export(args) -> int:
    """The run committed to the store --to names (pipeline/stores: its sink), or --rollback -> the exit code."""
    from pipeline import stores
    from pipeline.output import open_run
    from pipeline.signals import connect_ray
    from pipeline.storage import Storage

    sink = stores.sink(args.to)
    try:
        t = sink.target(args.to, vars(args))
        sink.check(t, Storage(args.endpoint, args.region, args.retry_s))
        if args.rollback:
            was, now = sink.rollback(t)
            print(json.dumps({"namespace": t.namespace, "rolled_back": was, "current": now}))
            return 0
        run = open_run(args.run, Storage(args.endpoint, args.region, args.retry_s), allow_unpublished=True)
        connect_ray()
        print(json.dumps(sink.commit_run(run, t).record(), indent=2))
        return 0
    except Exception as e:
        return failed(e, sink.refusals())


def failed(e: Exception, codes: list) -> int:
    """The exit code of the error that ended the command, by the error behind Ray's wrappers (`ray_cause`: a writer
    task's own, never Ray's task header and remote traceback), the first of `codes` [(kinds, code)] it is, after its
    one line on stderr (`refused:` for 3, else `error:`); anything else is raised as it is (a traceback, exit 1)."""
    from pipeline.signals import ray_cause

    cause = ray_cause(e)
    code = next((code for kinds, code in codes if isinstance(cause, kinds)), None)
    if code is None:
        raise e
    print(f"{'refused' if code == 3 else 'error'}: {cause}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
