"""The oldest versions pyproject.toml admits, as pip requirements for `make test-oldest`: the lower end of each range
that the numerics-sensitive tests depend on and that a CPU index serves (transformers; torch's lower end, the GPU
image's 2.11, is a CUDA build on the default index and runs where a GPU is lent). Also the constraints to install
them with: constraints.txt less those packages and the ones they pin in turn (huggingface-hub, tokenizers).

    python -m tests.oldest requirements   ->   transformers==5.17.0
    python -m tests.oldest constraints    ->   constraints.txt's lines less transformers, huggingface-hub, tokenizers
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLDEST = ("transformers",)
FOLLOW = ("transformers", "huggingface-hub", "tokenizers")  # pinned by transformers' own requirements


def name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def lower_end(requirement: str) -> str:
    found = re.search(r">=\s*([0-9][\w.]*)", requirement)
    if not found:
        raise ValueError(f"pyproject.toml: {requirement!r} has no lower end")
    version = found[1]
    return version if version.count(".") >= 2 else f"{version}.0"


def requirements() -> list[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [f"{name(d)}=={lower_end(d)}" for d in deps if name(d) in OLDEST]


def constraints() -> list[str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return [ln for ln in lines if ln and not ln.startswith("#") and name(ln) not in FOLLOW]


if __name__ == "__main__":
    print("\n".join(requirements() if sys.argv[1:] == ["requirements"] else constraints()))
