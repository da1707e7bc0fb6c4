"""Parquet input: a file, a folder of files or an s3:// prefix (`input: s3://bucket/histories/`). Unversioned: what a
resume must find unchanged is every file's content (pipeline/plan.py `content_identity`). Its schema is every file's
unified (`S.unified_schema`): a column some files lack reads as nulls in those; a column the run reads with two
kinds of value is refused naming two of its files (the user id by the plan, which checks each file's first: a type
that is no id, two kinds of id)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from pipeline import storage as S
from pipeline.config import Config
from pipeline.stores.base import Input, read_footers

VERSIONED = False


def check_uri(uri: str) -> str | None:
    return None if "://" not in uri or uri.startswith("s3://") else "must be a local path or an s3:// URI"


def location(uri: str) -> str:
    return uri


def open(cfg: Config, version: int | None = None) -> Input:
    """The parquet input (`version`: always None) -> its files, footers read, under their unified schema."""
    fs, path = S.filesystem(cfg.input, cfg.storage)
    data = dataset(cfg, fs, path)
    read_footers(data, cfg.storage)
    read = [cfg.columns.history, cfg.decoding.exclude_column]  # the user id's types: the plan's per-file checks
    return Input(S.unified_dataset(data, f"input {cfg.input}", read), fs)


def dataset(cfg: Config, fs, path: str) -> pads.Dataset:
    """A parquet input (a file, a folder, an s3:// prefix) as a pyarrow dataset; refused naming it when it is not
    there, not readable, or the store refuses access."""
    try:
        info = S.retrying(lambda: fs.get_file_info(path), cfg.storage, f"HEAD {cfg.input}")
    except OSError as e:
        if "ACCESS_DENIED" in str(e) or "AccessDenied" in str(e):
            raise PermissionError(
                f"input {cfg.input}: the object store refused access; check the credentials in "
                "the environment and storage.endpoint"
            ) from None
        raise
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"input {cfg.input} not found")
    try:
        return S.retrying(lambda: pads.dataset(path, filesystem=fs, format="parquet"), cfg.storage, f"LIST {cfg.input}")
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"input {cfg.input}: not readable as parquet ({e})") from None
