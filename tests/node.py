"""What an actor does on its node, run in a process of its own (a multiprocessing child): this module imports only
the storage layer, so that a spawned child starts in a second, not in the seconds torch and the tests take."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline import storage as S


def fetched(uri: str, cache: str, endpoint: str, sha256: str, hold: float = 0, out=None) -> tuple[str, dict]:
    """An actor's fetch of a model (`S.local_model_dir`) -> the directory and its files' sha256, also put on the
    queue `out`; then it keeps using the model (its lock held) for `hold` seconds."""
    path = Path(S.local_model_dir(uri, cache, S.Storage(endpoint), sha256))
    got = str(path), {f.name: S.sha256_file(f) for f in path.iterdir() if not f.name.startswith(".")}
    if out is not None:
        out.put(got)
    time.sleep(hold)
    return got
