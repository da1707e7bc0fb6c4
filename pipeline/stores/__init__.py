"""Where the nightly reads histories from and where a published run goes: one module per store, two protocols, one
registry (docs/architecture.md#adding-a-store).

A source (`input`) is a module implementing `Source`: it opens the input at one version and lists its data files
with the schema the run reads them in; the plan reads their footers, cuts their row groups into units and records
what a resume must find unchanged (pipeline/plan.py). A sink (`table.uri`, `serving.url`, `genrec-batch export --to`)
is a module implementing `Sink`: it commits a published run once, idempotently, and says what it did. The nightly
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
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import pyarrow.dataset as pads

    from pipeline.config import Config
    from pipeline.storage import Storage

SOURCES = {"delta+": "delta", "iceberg+": "iceberg", "": "parquet"}  # a URI's prefix -> the module reading it
SINKS = {"delta+": "delta", "iceberg+": "iceberg", "redis://": "redis", "rediss://": "redis"}


@dataclass(frozen=True)
class Input:
    """An input opened at one version: what the plan reads (a source's `open`)."""

    data: pads.Dataset  # its data files, their footers read, in the scan order of the units, in the input's schema
    fs: object  # their filesystem
    version: int | None = None  # the version read (a Delta version, an Iceberg snapshot id); None: unversioned
    names: dict = field(default_factory=dict)  # per file that names the input's columns otherwise (an Iceberg file's,
    # matched by field id): {the input's column: the file's, None where the file lacks it}


class Source(Protocol):
    """An input format: a module of this package, listed in SOURCES."""

    VERSIONED: bool  # `open` pins a version: input_version names one, a resume reads the one its run started on

    def check_uri(self, uri: str) -> str | None:
        """Why `uri` cannot name such an input (the config's check, nothing read), else None."""

    def location(self, uri: str) -> str | None:
        """The local path or s3:// URI whose access the plan checks first (None: the source checks its own)."""

    def open(self, cfg: Config, version: int | None) -> Input:
        """cfg.input at `version` (None: the newest) -> its files, footers read (`read_footers`), its schema and
        the version read. A version that cannot be read is FileNotFoundError naming it (exit 2); an input read in
        a way this reader does not apply (deleted rows, columns it cannot match) is ValueError naming it (exit 2)."""


class Sink(Protocol):
    """A store a published run goes to: a module of this package, listed in SINKS."""

    NAME: str  # what it is, in messages: "Delta table", "Iceberg table", "Redis"
    SECTION: str  # the config section naming it and its settings: "table" or "serving"
    BEFORE: str  # what its readers see while a commit fails: "the date's rows before"

    def check_uri(self, uri: str) -> str | None:
        """Why `uri` cannot name such a sink (the config's check, nothing contacted), else None."""

    def target(self, uri: str, options: dict):
        """`genrec-batch export --to URI` -> the config section to commit with (options: the command's flags)."""

    def check(self, target, storage: Storage) -> None:
        """The plan's checks of the sink before the date's lease (access, what its commits rest on)."""

    def commit_run(self, run, target):
        """A published run (pipeline.output.PublishedRun) committed once -> what this call did (`.record()`, a dict
        whose `skipped` says why it did nothing: already committed, by this or another call; no longer its date's
        published run). Raises what `refusals` maps to exit codes."""

    def refusals(self) -> list[tuple[tuple[type, ...], int]]:
        """The errors `genrec-batch export` exits with a code for, [(kinds, code)], first match: 2 refused (a bad
        run, URI or store state), 3 raced, 4 the store stayed unavailable (docs/output.md)."""

    def shown(self, uri: str) -> str:
        """The URI as logs and manifests show it (no secrets)."""

    def export_flags(self, target) -> str:
        """The flags `genrec-batch export RUN --to URI` needs to commit as `target` does ("" for none)."""


def _module(registry: dict[str, str], uri: str):
    """The module of the longest prefix of `registry` that `uri` starts with, or None."""
    prefix = max((p for p in registry if (uri or "").startswith(p)), key=len, default=None)
    return None if prefix is None else importlib.import_module(f"pipeline.stores.{registry[prefix]}")


def source(uri: str) -> Source:
    """The source reading `uri` (parquet when no prefix names another)."""
    return _module(SOURCES, uri)


def sink(uri: str) -> Sink | None:
    """The sink `uri` names, or None."""
    return _module(SINKS, uri)


def sinks_of(section: str) -> list[str]:
    """The URI prefixes of the sinks a config section names (for its error messages)."""
    return [p for p, name in SINKS.items() if importlib.import_module(f"pipeline.stores.{name}").SECTION == section]


def read_footers(data: pads.Dataset, storage: Storage) -> None:
    """Every file's footer read (a dataset reads them once), so that a corrupt file fails here, named (ValueError:
    exit 2), before any work."""
    import pyarrow as pa

    from pipeline import storage as S

    for fragment in data.get_fragments():
        try:
            S.retrying(fragment.ensure_complete_metadata, storage, f"read the footer of {fragment.path}")
        except (OSError, pa.ArrowInvalid) as e:
            raise ValueError(f"input file {fragment.path}: corrupt or not parquet ({e})") from None


def check_present(fs, paths: list[str], what: str, storage: Storage, why: str = "") -> None:
    """FileNotFoundError naming `what` (a table's version) when some of its data files are gone (`why`: how that
    comes about, for the message)."""
    import pyarrow.fs as pafs

    from pipeline import storage as S

    infos = S.retrying(lambda: fs.get_file_info(paths), storage, f"HEAD the files of {what}")
    gone = [i.path for i in infos if i.type == pafs.FileType.NotFound]
    if gone:
        raise FileNotFoundError(f"{what}: {len(gone)} of its {len(paths)} data files are gone{why}, e.g. {gone[0]}")


@dataclass(frozen=True)
class Commit:
    """What a table sink's commit of a published run did (the nightly prints it under `table`)."""

    table: str  # the table's URI (delta+..., iceberg+...)
    run_id: str
    run_date: str
    version: int | None  # the table version (Delta) or snapshot id (Iceberg) that holds the run; None: skipped
    files: int  # data files added
    rows: int
    seconds: float
    skipped: str | None = None  # why nothing was committed now (already committed, superseded)

    def record(self) -> dict:
        return asdict(self)
