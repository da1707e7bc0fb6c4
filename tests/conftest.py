"""Marks the numerics-sensitive test modules: those that compare floating-point results (engines against
transformers, decoders against each other, exact laws against sampled frequencies). `make test` runs them once more
under every other CPU kernel family this machine offers (tests/kernels.py)."""

import pytest

NUMERICS = {
    "test_alignment",
    "test_beam",
    "test_compiled",
    "test_disc",
    "test_engine",
    "test_exclusions",
    "test_models",
    "test_speculative",
    "test_stats",
    "test_tree",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in NUMERICS:
            item.add_marker(pytest.mark.numerics)
