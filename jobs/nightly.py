"""The nightly job: `python -m jobs.nightly --config FILE [--set a.b=value ...]`.

On a cluster: `ray job submit --address http://HEAD:8265 --working-dir . --runtime-env infra/runtime_env.yaml --
python -m jobs.nightly --config infra/configs/production.example.yaml`. With no cluster (RAY_ADDRESS unset and none
running) it starts a local Ray. Exit code 0 and the manifest on stdout on success; 2 with a message naming the bad
file, field or model otherwise (no _SUCCESS is published).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline.config import load_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.nightly", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (infra/configs/demo.yaml is the embedded default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. decoding.k=20")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.set)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import ray

    from pipeline.nightly import run_nightly

    ray.init(ignore_reinit_error=True, log_to_driver=True)  # RAY_ADDRESS / a running cluster, else a local one
    try:
        manifest = run_nightly(cfg)
    except (FileNotFoundError, ValueError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("run_id", "run_date", "status", "counts", "timings", "outputs")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
