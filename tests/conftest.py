"""Marks the numerics-sensitive tests: those that compare floating-point results computed by torch kernels (engines
against transformers, decoders against each other, exact laws against sampled frequencies). Whole modules are listed
here; a test elsewhere that compares such results carries `@pytest.mark.numerics` itself (test_bench's scorer
checks, the nightly actor's sliced decode). `make test-kernels` runs them once more under every other CPU kernel
family and oneDNN ISA limit this machine offers (tests/kernels.py). Their tolerances come from the dtype's spacing,
the magnitudes and counts involved (tests/helpers.float32_atol) or from errors measured in the same run, and tests
that need clear cases draw more of them until they can decide (tests/test_engine.py), so that a verdict depends on
the engine, never on the CPU."""

import os
import sys
import warnings
from pathlib import Path

import pytest

# The repository stands alone: a folder beside the checkout (CI lays a `shared/` there) is never read by a test or
# the code it runs in this process. The hook sees every open and directory listing; tests/test_repository.py scans
# the tracked files for the same in code that runs elsewhere.
BESIDE = str(Path(__file__).resolve().parents[1].parent / "shared")  # guard: never read


def _never_beside(event: str, args: tuple) -> None:
    if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | bytes | os.PathLike):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path == BESIDE or path.startswith(BESIDE + os.sep):
            raise PermissionError(f"{path}: tests never read outside the repository")


sys.addaudithook(_never_beside)

# Parallel workers (pytest-xdist, `make test`) share the cores: each worker's torch takes its share of them, or their
# OpenMP threads wait on each other's cores (a CPU-bound test then runs several times slower beside another one).
# Processes a test starts (jobs, Ray's nodes and actors) keep their own settings.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // WORKERS))

NUMERICS = {
    "test_alignment",
    "test_beam",
    "test_compiled",
    "test_disc",
    "test_engine",
    "test_exclusions",
    "test_models",
    "test_shared_ids",
    "test_speculative",
    "test_stats",
    "test_tree",
}

# The fault-injection modules: drivers, Ray nodes and the store killed, paused, restarted or failing (a proxy's
# errors) from outside, several processes each, minutes of waiting on the timeouts they test. `make test-faults`
# runs them (`-m faults`), with the tests of other modules marked `faults` (test_nightly_s3's leases lost, drivers
# paused or overlapping, nodes without credentials); `make test` the rest (`-m "not faults"`); CI runs both, each
# against its budget (tests/budget.py).
FAULTS = {"test_cluster", "test_nightly_faults", "test_store_faults", "test_store_retries", "test_incremental_faults"}
FAULTS |= {"test_tables_faults", "test_iceberg_faults"}


# The modules that take longest (setup included, measured with `python -m tests.budget`) run first, so that no worker
# is left running a long one alone at the end (`make test` keeps this order: --no-loadscope-reorder). A module's own
# order is kept; a stale list costs minutes, never a verdict.
SLOW_FIRST = [
    "test_cluster",
    "test_nightly_faults",
    "test_nightly_s3",
    "test_nightly",
    "test_store_faults",
    "test_tables",
    "test_tables_faults",
    "test_incremental",
    "test_bench",
    "test_iceberg",
    "test_compile_store",
    "test_serving",
    "test_library",
    "test_iceberg_faults",
    "test_incremental_faults",
    "test_compiled",
    "test_store_retries",
    "test_report",
    "test_bring_your_own_model",
    "test_gpu_rehearsal",
    "test_servers",
    "test_training",
    "test_prepare_data",
    "test_exclusions",
    "test_items",
    "test_repository",
    "test_minionerec",
    "test_engine_auto",
    "test_engine",
    "test_disc",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))  # stable
    for item in items:
        if item.module.__name__.rpartition(".")[2] in NUMERICS:
            item.add_marker(pytest.mark.numerics)
        if item.module.__name__.rpartition(".")[2] in FAULTS:
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="module")
def ray_session_plain():
    """A local Ray of 2 CPUs for the module's tests, without fault injection."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def compile_cache():
    """The module compiles into COMPILE_CACHE, as the nightly's actor does; TORCHINDUCTOR_CACHE_DIR is restored
    when the module is done."""
    from decoding.compiled import use_compile_cache
    from tests.helpers import COMPILE_CACHE

    with pytest.MonkeyPatch.context() as env:
        env.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        use_compile_cache(COMPILE_CACHE)
        yield COMPILE_CACHE


class _StrictDeprecations:
    """transformers.utils.deprecation's `warnings` in the suite: a FutureWarning it raises (`deprecate_kwarg`: an
    argument renamed or going away) is an error, whoever called the deprecated function. Its warnings name the
    caller's module (stacklevel=2: ours, or torch's Module.__call__ for a decorated forward), which no module filter
    can scope to transformers without catching other libraries' warnings too; pyproject.toml's filter catches the
    FutureWarnings transformers' other code attributes to itself. It raises whatever filters say (an `ignore`, a
    `pytest.warns`): a test of a deprecated path expects the FutureWarning with `pytest.raises`."""

    def __getattr__(self, name):
        return getattr(warnings, name)

    @staticmethod
    def warn(message, category=UserWarning, stacklevel=1, **kwargs):
        if isinstance(category, type) and issubclass(category, FutureWarning):
            raise category(message)
        warnings.warn(message, category, stacklevel + 1, **kwargs)


@pytest.fixture(autouse=True, scope="session")
def transformers_deprecations_fail():
    import transformers.utils.deprecation as deprecation

    with pytest.MonkeyPatch.context() as m:
        m.setattr(deprecation, "warnings", _StrictDeprecations())
        yield
