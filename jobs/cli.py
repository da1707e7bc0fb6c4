"""Argument types and flag groups shared by the command-line entry points (no logic beyond parsing)."""
from __future__ import annotations

import argparse
import os


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


def storage_args(p: argparse.ArgumentParser) -> None:
    """--endpoint / --region for s3:// URIs (credentials come from the environment, never from flags)."""
    p.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"),
                   help="S3-compatible endpoint for s3:// URIs (default: $AWS_ENDPOINT_URL)")
    p.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
