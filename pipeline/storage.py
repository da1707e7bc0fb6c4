"""Storage: local paths and s3:// URIs (pyarrow's S3FileSystem for tables, boto3 for small objects), whole small
objects written atomically, file hashes, and model directories copied once per node into a verified cache.
The layout of a run's outputs is pipeline/runs.py.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

from pipeline.config import Storage


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


def filesystem(uri: str, storage: Storage) -> tuple[pafs.FileSystem, str]:
    """URI -> (pyarrow filesystem, path inside it). s3:// uses the environment's credentials (default chain)."""
    if not is_s3(uri):
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    kwargs = {"region": storage.region}
    if storage.endpoint:
        endpoint = urlparse(storage.endpoint)
        kwargs.update(endpoint_override=endpoint.netloc, scheme=endpoint.scheme)
    bucket, key = split_s3(uri)
    return pafs.S3FileSystem(**kwargs), f"{bucket}/{key}".rstrip("/")


def s3_client(storage: Storage):
    """A boto3 client resolving credentials now (a fresh session: the environment may have changed)."""
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=storage.endpoint, region_name=storage.region)


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


# ------------------------------------------------------------------ small objects (manifests, markers)


def write_bytes(uri: str, data: bytes, storage: Storage) -> None:
    """One put on S3; write-then-rename locally: either way a reader sees the old or the new object, whole."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3_client(storage).put_object(Bucket=bucket, Key=key, Body=data)
        return
    path = Path(uri).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_bytes(uri: str, storage: Storage) -> bytes | None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        client = s3_client(storage)
        try:
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
    path = Path(uri).expanduser()
    return path.read_bytes() if path.is_file() else None


def read_versioned(uri: str, storage: Storage) -> tuple[bytes, str] | None:
    """An S3 object's bytes and ETag (its version for `put_if`), or None."""
    bucket, key = split_s3(uri)
    client = s3_client(storage)
    try:
        got = client.get_object(Bucket=bucket, Key=key)
    except client.exceptions.NoSuchKey:
        return None
    return got["Body"].read(), got["ETag"]


def put_if(uri: str, data: bytes, storage: Storage, etag: str | None) -> str | None:
    """A conditional put on S3: etag None creates the object only if it does not exist (If-None-Match: *), an ETag
    replaces it only if it is still that version (If-Match) -> the new ETag, or None if the condition failed."""
    import botocore.exceptions

    bucket, key = split_s3(uri)
    cond = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
    try:
        return s3_client(storage).put_object(Bucket=bucket, Key=key, Body=data, **cond)["ETag"]
    except botocore.exceptions.ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):  # lost the race
            return None
        raise


def content_id(path: str, fs: pafs.FileSystem, storage: Storage) -> str:
    """A file's content identity: on S3 its ETag (the store's digest of the bytes, read with a HEAD), locally the
    sha256 of its bytes. `path` is the filesystem's own (`bucket/key` on S3)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return "sha256:" + sha256_file(Path(path))
    bucket, key = path.split("/", 1)
    head = s3_client(storage).head_object(Bucket=bucket, Key=key)
    return f"etag:{head['ETag'].strip(chr(34))}:{head['ContentLength']}"


def list_files(uri: str, storage: Storage) -> list[str]:
    """Names of the files directly in a folder ([] if it does not exist)."""
    fs, path = filesystem(uri, storage)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return sorted(Path(i.path).name for i in infos if i.type == pafs.FileType.File)


def delete_files(uri: str, names: list[str], storage: Storage) -> None:
    fs, path = filesystem(uri, storage)
    for name in names:
        fs.delete_file(f"{path}/{name}")


def exists(uri: str, storage: Storage) -> bool:
    fs, path = filesystem(uri, storage)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def delete_tree(uri: str, storage: Storage) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        client = s3_client(storage)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/"):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                client.delete_objects(Bucket=bucket, Delete={"Objects": objects})
    else:
        shutil.rmtree(Path(uri).expanduser(), ignore_errors=True)


def list_children(uri: str, storage: Storage) -> list[str]:
    """Names of the immediate sub-folders of a URI."""
    fs, path = filesystem(uri, storage)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    return sorted(Path(i.path).name for i in infos if i.type == pafs.FileType.Directory)


def check_access(uri: str, storage: Storage) -> None:
    """Fails fast, naming the URI, when the object store rejects the credentials; never prints a secret."""
    if not is_s3(uri):
        return
    import botocore.exceptions

    bucket, _ = split_s3(uri)
    try:
        s3_client(storage).head_bucket(Bucket=bucket)
    except botocore.exceptions.NoCredentialsError:
        raise PermissionError(f"{uri}: no object-store credentials (set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                              "or use the cloud's default credential chain)") from None
    except botocore.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        raise PermissionError(f"{uri}: the object store refused access to bucket {bucket!r} ({code}); check the "
                              "credentials in the environment and storage.endpoint") from None


# ------------------------------------------------------------------ model directories


def sha256_file(path: Path, h=None) -> str:
    """The sha256 of a file's bytes (or, given `h`, those bytes fed into that hash)."""
    h = hashlib.sha256() if h is None else h
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(model_dir) -> str:
    """sha256 over a model directory's safetensors weight files (name and bytes, sorted by name)."""
    from decoding.models import check_model_dir

    h = hashlib.sha256()
    for f in sorted(check_model_dir(model_dir).glob("*.safetensors")):
        h.update(f.name.encode())
        sha256_file(f, h)
    return h.hexdigest()


def upload_model_dir(local: str, uri: str, storage: Storage) -> None:
    """Copies a model directory to s3:// with a sha256sums.json that `local_model_dir` verifies."""
    files = sorted(p for p in Path(local).iterdir() if p.is_file())
    sums = {p.name: sha256_file(p) for p in files}
    bucket, key = split_s3(uri)
    client = s3_client(storage)
    for p in files:
        client.upload_file(str(p), bucket, f"{key.rstrip('/')}/{p.name}")
    client.put_object(Bucket=bucket, Key=f"{key.rstrip('/')}/sha256sums.json", Body=json.dumps(sums).encode())


def local_model_dir(uri: str, cache_dir: str, storage: Storage) -> Path:
    """A local directory holding the model: the path itself, or an s3:// prefix copied once per node into the cache
    (a file lock serialises the actors of one node) and checked against the prefix's sha256sums.json."""
    if not is_s3(uri):
        path = Path(uri).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {uri} not found (no config.json)")
        return path
    target = Path(cache_dir).expanduser() / hashlib.sha256(uri.encode()).hexdigest()[:16]
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            return target
        bucket, key = split_s3(uri)
        client = s3_client(storage)
        raw = read_bytes(join(uri, "sha256sums.json"), storage)
        if raw is None:
            raise FileNotFoundError(f"model {uri}: no sha256sums.json (upload it with pipeline.storage.upload_model_dir)")
        sums = json.loads(raw)
        for name, digest in sums.items():
            client.download_file(bucket, f"{key.rstrip('/')}/{name}", str(target / name))
            if sha256_file(target / name) != digest:
                raise ValueError(f"model {uri}: {name} does not match its sha256 in sha256sums.json")
        (target / ".complete").write_text(uri)
    return target
