"""The two protocols of pipeline/stores (a source, a sink) and what every store module shares: the Input a source
opens, its footers read, a version's files checked present, and the record of a table sink's commit. The registry
naming each store's module is pipeline/stores/__init__.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import pyarrow.dataset as pads

    from pipeline.config import Config
    from pipeline.storage import Storage


@dataclass(frozen=True)
class Input:
    """An input opened at one version: what the plan reads (a source's `open`)."""

    data: pads.Dataset  # its data files, their footers read, in the scan order of the units, in the input's schema
    fs: object  # their filesystem
    version: int | None = None  # the version read (a Delta version, an Iceberg snapshot id); None: unversioned
    names: dict = field(default_factory=dict)  # per file that names the input's columns otherwise (an Iceberg file's,
    # matched by field id): {the input's column: the file's, None where the file lacks it}


class Source(Protocol):
    """An input format: a module of this package, listed in SOURCES (pipeline/stores/__init__.py)."""

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
    """A store a published run goes to: a module of this package, listed in SINKS (pipeline/stores/__init__.py)."""

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
