"""The CPU kernel settings this machine can run besides the ones torch picks by itself, each emulating a CPU that
exists, one per line as environment assignments joined by `+` for `make test-kernels`:

- ATEN_CPU_CAPABILITY: default, avx2, avx512. Each family selects other vectorised ATen kernels, so other summation
  orders and other rounding. It goes with the oneDNN ISA of a CPU of that family (ONEDNN_MAX_CPU_ISA: SSE41 with
  default, AVX2 with avx2, AVX512_CORE_BF16 with avx512): oneDNN chooses its matrix kernels (bfloat16 ones
  included) by its own detection, whatever ATEN_CPU_CAPABILITY says, and a reduced ATen family beside the full
  oneDNN ISA is a CPU that does not exist (on an AMX CPU, bfloat16 attention then fails: `pack_vnni2 is only
  supported when avx512 is supported`).
- ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 alone where the CPU has AMX: the same AVX-512 CPU without it.

A tolerance measured under one setting may not hold under another: `make test` runs the numerics-sensitive tests
(marker `numerics`) once more under each setting printed here, so that a bound tuned on one machine fails in CI, not
on a user's.

    python -m tests.kernels   ->   e.g. "ATEN_CPU_CAPABILITY=default+ONEDNN_MAX_CPU_ISA=SSE41
                                   ATEN_CPU_CAPABILITY=avx2+ONEDNN_MAX_CPU_ISA=AVX2" on an AVX-512 machine,
                                   "ATEN_CPU_CAPABILITY=default+ONEDNN_MAX_CPU_ISA=SSE41" on an AVX2 one
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
ONEDNN = {"default": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_BF16"}  # the oneDNN ISA of each family's CPUs


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


def settings_for(flags: set[str], others: list[str]) -> list[str]:
    """The settings of a CPU with these flags whose other offered ATen families are `others`: each family with its
    CPUs' oneDNN ISA, and where the CPU has AMX the same CPU without it (oneDNN limited alone)."""
    out = [f"ATEN_CPU_CAPABILITY={f}+ONEDNN_MAX_CPU_ISA={ONEDNN[f]}" for f in others]
    return out + ([f"ONEDNN_MAX_CPU_ISA={ONEDNN['avx512']}"] if any(f.startswith("amx") for f in flags) else [])


def settings() -> list[str]:
    """Every other kernel setting of this machine, as VAR=value[+VAR=value]."""
    flags = cpu_flags()
    return settings_for(flags, other_families(flags))


if __name__ == "__main__":
    print(" ".join(settings()))
