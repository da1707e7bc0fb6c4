"""The CPU kernel families (ATEN_CPU_CAPABILITY) this machine can run, besides the one torch picks by itself.

Each family selects other vectorised kernels, so other summation orders and other rounding: a tolerance measured
under one of them may not hold under another. `make test` runs the numerics-sensitive tests (marker `numerics`)
once more under each family printed here, so that a bound tuned on one machine fails in CI, not on a user's.

    python -m tests.kernels   ->   e.g. "default avx2" on an AVX-512 machine, "default" on an AVX2 one
"""

from __future__ import annotations

import os
import subprocess
import sys

FAMILIES = ("default", "avx2", "avx512")
PROBE = "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"


def capability(family: str | None) -> str:
    """The family torch runs with ATEN_CPU_CAPABILITY=family (None: unset): an unsupported request falls back."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if family is not None:
        env["ATEN_CPU_CAPABILITY"] = family
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def other_families() -> list[str]:
    """The families this CPU offers other than torch's own choice."""
    native = capability(None)
    return [f for f in FAMILIES if f != native and capability(f) == f]


if __name__ == "__main__":
    print(" ".join(other_families()))
