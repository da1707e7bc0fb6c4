"""The compiled engine's cache folders on a node: private to the user the actors run as, since inductor runs the code
it finds there (it unpickles graphs, imports wrapper modules, loads shared objects)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_dirs(base: Path, leaf: Path) -> None:
    """Every folder from `base` down to `leaf`, made where missing with mode 0700 -> None; ValueError naming the first
    folder that another user could write: one below base that another user owns, that group or others may write or
    that is a link; base itself followed (an operator's link), owned by this user and writable by no one else; and
    every folder above base writable by no one but its owner (this user or root) unless sticky (/tmp), so that nobody
    can swap base for another folder."""
    rel = leaf.relative_to(base).parts
    for depth in range(len(rel) + 1):
        path = base.joinpath(*rel[:depth])
        try:
            path.mkdir(mode=0o700, parents=depth == 0, exist_ok=True)
            st = path.stat() if depth == 0 else path.lstat()
        except OSError as e:  # a file where a folder goes, a dangling link
            raise ValueError(f"compile cache folder {path} cannot be made ({e.strerror})") from None
        if depth == 0:  # the folders above base, now that they exist
            for parent in reversed(base.parents):
                _check(parent, parent.stat(), above=True)
        _check(path, st, above=False)


def _check(path: Path, st: os.stat_result, above: bool) -> None:
    owner_ok = st.st_uid in ((os.geteuid(), 0) if above else (os.geteuid(),))
    shared = bool(st.st_mode & 0o022) and not (above and st.st_mode & stat.S_ISVTX)
    if not stat.S_ISDIR(st.st_mode) or not owner_ok or shared:
        raise ValueError(
            f"compile cache folder {path} is not private (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}; "
            f"this process runs as uid {os.geteuid()}): whoever can write it can plant code the actors load. Give it "
            "to this user with mode 0700, or set compute.compile_cache to a private folder"
        )
