"""Argument types and flag groups shared by the command-line entry points, and the training jobs' shared main (no
logic beyond parsing, calling the packages and exit codes)."""

from __future__ import annotations

import argparse
import os
import sys

INVOKED: list[str] = []  # the subcommand `genrec-batch SUBCOMMAND` runs (jobs/main.py), none under `python -m jobs.X`


def prog(module: str) -> str:
    """A job's name in its usage and --help: `genrec-batch SUBCOMMAND` when the installed command runs it, else
    `python -m jobs.MODULE` (`module`: the job's module, e.g. jobs.export)."""
    return f"genrec-batch {INVOKED[-1]}" if INVOKED else f"python -m {module}"


def _integer(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
    return value


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1)


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0)


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def dataclass_args(p: argparse.ArgumentParser, cls, skip=(), zero_ok=(), helps=None, defaults=None) -> None:
    """One flag per field of dataclass `cls` (`--batch-size` for `batch_size`), default `defaults[name]` (None when
    not given, so that only the flags given override a preset: `config_from_args`). int fields take
    integers >= 1 (>= 0 for the fields named in `zero_ok`), float fields numbers >= 0, list[int] / list[str] fields
    one or more values, bool fields --name / --no-name, the rest strings; fields in `skip` are left to the caller;
    `helps` maps field names to help texts."""
    for name, f in cls.__dataclass_fields__.items():
        if name in skip:
            continue
        base = str(f.type).split(" |")[0]
        flag, default = "--" + name.replace("_", "-"), (defaults or {}).get(name)
        help_ = (helps or {}).get(name, " " if defaults else None)  # " ": argparse then shows the default
        if base == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        kind = {"int": non_negative if name in zero_ok else positive, "float": non_negative_float}
        item = base.removeprefix("list[").removesuffix("]")
        p.add_argument(
            flag, type=kind.get(item, str), nargs="+" if base.startswith("list[") else None, default=default, help=help_
        )


def config_from_args(args: argparse.Namespace, cls, preset: dict):
    """cls(**values): the preset's values, then every flag that was given (not None) and names a field of cls."""
    values = dict(preset)
    values.update({k: v for k, v in vars(args).items() if k in cls.__dataclass_fields__ and v is not None})
    return cls(**values)


def training_config(p: argparse.ArgumentParser, argv, cls, presets: dict, skip: tuple):
    """A training job's remaining flags, one per field of dataclass `cls` but those in `skip` (--seed and --warmup
    may be 0), parsed -> cls: the --preset's values, then the flags given."""
    dataclass_args(p, cls, skip=skip, zero_ok=("seed", "warmup"))
    args = p.parse_args(argv)
    return config_from_args(args, cls, presets.get(args.preset, {}))


def train_main(cfg, train, summary) -> int:
    """A training job's main: train(cfg) -> its report; a bad config or data (ValueError, raised before any
    training) prints `error: ...` and exits 2, else prints summary(cfg, report) and exits 0."""
    try:
        report = train(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(cfg, report))
    return 0


def storage_args(p: argparse.ArgumentParser) -> None:
    """--endpoint / --region for s3:// URIs (credentials come from the environment, never from flags)."""
    p.add_argument(
        "--endpoint",
        default=os.environ.get("AWS_ENDPOINT_URL"),
        help="S3-compatible endpoint for s3:// URIs (default: $AWS_ENDPOINT_URL)",
    )
    p.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))


def synthetic_flags(p: argparse.ArgumentParser) -> None:
    """`prepare --synthetic`'s flags: the catalog's and the users' sizes and seed."""
    p.add_argument("--synthetic", action="store_true", help="write a synthetic catalog and users instead")
    p.add_argument("--users", type=positive, help="synthetic users")
    p.add_argument("--items", type=positive, help="synthetic catalog items")
    p.add_argument("--levels", type=positive, default=4, help="synthetic semantic-ID levels, default %(default)s")
    p.add_argument("--codes", type=positive, default=256, help="synthetic codes per level, default %(default)s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chunk-users",
        type=positive,
        default=1_000_000,
        help="synthetic users per parquet row group, default %(default)s",
    )
