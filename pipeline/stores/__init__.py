"""Where the nightly reads histories from and where a published run goes: one module per store, two protocols, one
registry (docs/architecture.md#adding-a-store): this module, which imports no store (each is imported when a URI names
it). The protocols and what every store shares are in pipeline/stores/base.py.

A source (`input`) is a module implementing `base.Source`: it opens the input at one version and lists its data files
with the schema the run reads them in; the plan reads their footers, cuts their row groups into units and records
what a resume must find unchanged (pipeline/plan.py). A sink (`table.uri`, `serving.url`, `genrec-batch export --to`)
is a module implementing `base.Sink`: it commits a published run once, idempotently, and says what it did. The nightly
(pipeline/plan.py, pipeline/nightly.py) and `genrec-batch export` (jobs/export.py) reach every store through
`source(uri)` and `sink(uri)`, never by name.

    SOURCES  parquet (a file, a folder, an s3:// prefix)      pipeline/stores/parquet.py
             delta+URI                                         pipeline/stores/delta.py
             iceberg+CATALOG/NAMESPACE.TABLE                   pipeline/stores/iceberg.py
    SINKS    delta+URI, iceberg+CATALOG/NAMESPACE.TABLE        a run's rows, one commit per run (table.uri)
             redis://, rediss://                               pipeline/stores/redis.py (serving.url)
"""

from __future__ import annotations

import importlib
from types import ModuleType

SOURCES = {"delta+": "delta", "iceberg+": "iceberg", "": "parquet"}  # a URI's prefix -> the module reading it
SINKS = {"delta+": "delta", "iceberg+": "iceberg", "redis://": "redis", "rediss://": "redis"}


def _module(registry: dict[str, str], uri: str):
    """The module of the longest prefix of `registry` that `uri` starts with, or None."""
    prefix = max((p for p in registry if (uri or "").startswith(p)), key=len, default=None)
    return None if prefix is None else importlib.import_module(f"pipeline.stores.{registry[prefix]}")


def source(uri: str) -> ModuleType:
    """The source reading `uri` (a module implementing `base.Source`; parquet when no prefix names another)."""
    return _module(SOURCES, uri)


def sink(uri: str) -> ModuleType | None:
    """The sink `uri` names (a module implementing `base.Sink`), or None."""
    return _module(SINKS, uri)


def sinks_of(section: str) -> list[str]:
    """The URI prefixes of the sinks a config section names (for its error messages)."""
    return [p for p, name in SINKS.items() if importlib.import_module(f"pipeline.stores.{name}").SECTION == section]
