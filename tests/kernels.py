"""The CPU kernel settings this machine can run besides the ones torch picks by itself, one per line as an
environment assignment for `make test-kernels`:

- ATEN_CPU_CAPABILITY: default, avx2, avx512. Each family selects other vectorised ATen kernels, so other summation
  orders and other rounding.
- ONEDNN_MAX_CPU_ISA=AVX2, where the CPU offers more (AVX-512, AVX-512 BF16 or AMX): oneDNN chooses its matrix
  kernels (bfloat16 ones included) by its own detection, whatever ATEN_CPU_CAPABILITY says, so it is limited apart.

A tolerance measured under one setting may not hold under another: `make test` runs the numerics-sensitive tests
(marker `numerics`) once more under each setting printed here, so that a bound tuned on one machine fails in CI, not
on a user's.

    python -m tests.kernels   ->   e.g. "ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"
                                   on an AVX-512 machine, "ATEN_CPU_CAPABILITY=default" on an AVX2 one
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FAMILIES = ("default", "avx2", "avx512")
# torch reports a requested family even where the CPU lacks it (torch 2.13 on an AVX2-only CPU says AVX512, then
# dies of SIGILL in softmax): a family is offered where the CPU's flags have its instructions and the probe, which
# runs a few vectorised kernels first, answers with it.
PROBE = (
    "import torch; x = torch.randn(64, 64); (x.softmax(-1) @ x).exp().sum().item(); "
    "x.bfloat16().float().sum().item(); print(torch.backends.cpu.get_cpu_capability().lower())"
)
NEEDS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
BEYOND_AVX2 = ("avx512", "amx")  # /proc/cpuinfo flag prefixes of the ISAs oneDNN uses above AVX2


def capability(family: str | None) -> str | None:
    """The family torch runs with ATEN_CPU_CAPABILITY=family (None: unset): an unsupported request falls back, or
    crashes (then None)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if family is not None:
        env["ATEN_CPU_CAPABILITY"] = family
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def other_families(flags: set[str]) -> list[str]:
    """The families this CPU offers other than torch's own choice (flags: the CPU's; empty where unknown)."""
    native = capability(None)
    return [f for f in FAMILIES if f != native and (not flags or NEEDS[f] <= flags) and capability(f) == f]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux; none elsewhere)."""
    if not cpuinfo.exists():
        return set()
    return {f for line in cpuinfo.read_text().splitlines() if line.startswith("flags") for f in line.split()[2:]}


def onednn_limits(flags: set[str]) -> list[str]:
    """ONEDNN_MAX_CPU_ISA values below what the CPU offers: AVX2 where it has AVX-512 or AMX."""
    return ["AVX2"] if any(f.startswith(BEYOND_AVX2) for f in flags) else []


def settings() -> list[str]:
    """Every other kernel setting, as VAR=value."""
    flags = cpu_flags()
    return [f"ATEN_CPU_CAPABILITY={f}" for f in other_families(flags)] + [
        f"ONEDNN_MAX_CPU_ISA={isa}" for isa in onednn_limits(flags)
    ]


if __name__ == "__main__":
    print(" ".join(settings()))
