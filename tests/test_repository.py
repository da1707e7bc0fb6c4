"""The repository stands alone: no tracked file names a path outside it, the data the demo uses and the schemas the
infra tests use are tracked, it carries a licence, and it builds a wheel that runs from anywhere with its configs and
data as package data."""

from __future__ import annotations

import json
import os
import re
import shutil
import site as sitepackages
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.prepare import BEAUTY_SOURCE

ROOT = Path(__file__).resolve().parents[1]
# Ways a file names a place outside the repository: the folder beside the checkout, an absolute workspace path, a
# path built by walking above the repository root (`.parent` of the root, a ".." component). A line ending in
# "# guard: never read" is the test guard that forbids it.
OUTSIDE = re.compile(
    r"\.\./shared\b|(?<![\w.-])/work/|[\"']shared[\"']|parents\[\d\]\.parent\b|ROOT\.parent\b|(?:/|,)\s*[\"']\.\.[\"']|\bjoinpath\([\"']\.\."
)
GUARD = "# guard: never read"
RELATIVE = re.compile(r"(?<![\w.])((?:\.\./)+[\w.-][\w./-]*)")


def tracked() -> list[Path]:
    """The files a clone has: tracked ones and new ones not ignored (what the next commit would carry)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        return None  # parquet, png


def context(before: str) -> tuple[bool, bool]:
    """(built from the script's own folder, a Markdown link in a page that code writes into docs/)."""
    return before.endswith(")/"), before.endswith("](")


def escapes(path: Path, target: str, own_folder: bool = False, page_link: bool = False) -> bool:
    """A relative path escapes when it leaves the repository: a Markdown link, or a path a script builds from its
    own folder (`$(dirname "$0")/..`), from the file's folder; a link in a page that code generates, from docs/;
    anything else from the file's folder or from the root (where commands run)."""
    if page_link and path.suffix != ".md":
        return not (ROOT / "docs" / target).resolve().is_relative_to(ROOT)
    bases = (path.parent,) if own_folder or path.suffix == ".md" else (path.parent, ROOT)
    return any(not (base / target).resolve().is_relative_to(ROOT) for base in bases)


def test_no_tracked_file_names_a_path_outside_the_repository():
    wrong = []
    for path in tracked():
        text = text_of(path)
        if text is None or path == Path(__file__):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if line.rstrip().endswith(GUARD):
                continue
            hits = [m[0] for m in OUTSIDE.finditer(line)]
            hits += [m[1] for m in RELATIVE.finditer(line) if escapes(path, m[1], *context(line[: m.start()]))]
            wrong += [f"{path.relative_to(ROOT)}:{n}: {hit}" for hit in hits]
    assert wrong == [], "\n".join(wrong)


def test_the_check_catches_each_way_out(tmp_path):
    """The pattern above is not vacuous: each way out it names is found, a link inside the repository is not."""
    for line in (
        'BEAUTY = ROOT.parent / "shared" / "x"',
        "see ../shared/ARCHITECTURE.md",
        "/work/shared/x",
        'os.path.join(ROOT, "..", "shared")',
        'ROOT / ".." / "data"',
        "Path(__file__).parents[2] / 'shared'",
        'ROOT.parent.joinpath("datasets")',
    ):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search("https://github.com/org/work/tree") and not OUTSIDE.search("shared-prefix")
    docs, code = ROOT / "docs" / "page.md", ROOT / "jobs" / "x.py"
    assert escapes(docs, "../../elsewhere/x.md") and not escapes(docs, "../README.md")
    assert escapes(code, "../datasets/x") and not escapes(ROOT / "infra" / "local" / "x.sh", "../..", True)
    assert not OUTSIDE.search('lo, hi = c.split("..")')


def test_the_demo_data_and_the_schemas_are_tracked():
    files = {p.relative_to(ROOT).as_posix() for p in tracked()}
    beauty = BEAUTY_SOURCE.relative_to(ROOT).as_posix()
    assert {f"{beauty}/{name}" for name in ("README.md", "items.parquet", "train.parquet", "test.parquet")} <= files
    readme = (BEAUTY_SOURCE / "README.md").read_text()
    assert all(word in readme for word in ("Provenance", "0-based", "Terms of use"))
    assert pq.read_metadata(BEAUTY_SOURCE / "items.parquet").num_rows == 12035
    assert {"tests/schemas/manifest.json", "tests/schemas/k8s-v1.33.0-strict.json"} <= files
    assert (ROOT / "LICENSE").read_text().startswith("\n                                 Apache License")
    assert (ROOT / "docs" / "architecture.md").is_file()


PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tracked tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for path in tracked():
        dest = src / path.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    built = subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)])
    assert built.returncode == 0
    (found,) = (tmp / "dist").glob("genrec_batch-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed without dependencies into a folder of its own."""
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([*PIP, "install", "--no-deps", "--target", str(site), str(wheel)])
    assert done.returncode == 0
    return site


def from_wheel(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    """The wheel's console script, run from a folder outside the checkout, the wheel first on the path."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [str(site / "bin" / "genrec-batch"), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_wheel_runs_from_another_folder(installed, tmp_path):
    version = from_wheel(installed, tmp_path, "--version")
    assert version.returncode == 0 and version.stdout.startswith("genrec-batch 0."), version.stderr
    assert re.search(r"(?m)^  torch >=2\.11", version.stdout)
    usage = from_wheel(installed, tmp_path, "--help")
    assert usage.returncode == 0 and "nightly" in usage.stdout
    where = subprocess.run(
        [sys.executable, "-c", "import jobs, pipeline.config as c; print(jobs.__file__, c.DEMO_CONFIG.is_file())"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
    )
    assert where.stdout.split() == [str(installed / "jobs" / "__init__.py"), "True"], where.stderr
    # The default config is package data; with nothing prepared it names the command that prepares the data.
    night = from_wheel(installed, tmp_path, "nightly")
    assert night.returncode == 2 and "genrec-batch prepare --out data/beauty" in night.stderr, night.stderr
    assert len(night.stderr.strip().splitlines()) == 1
    # That command works from the wheel: Amazon Beauty is package data.
    prepared = from_wheel(installed, tmp_path, "prepare", "--out", "data/beauty")
    assert prepared.returncode == 0, prepared.stderr
    assert pq.read_metadata(tmp_path / "data" / "beauty" / "test.parquet").num_rows > 0
    night = from_wheel(installed, tmp_path, "nightly")
    assert night.returncode == 2 and "genrec-batch train-target" in night.stderr, night.stderr


def test_import_genrec_batch_from_the_wheel_in_a_fresh_environment(wheel, tmp_path):
    """A venv of its own with the wheel installed, its dependencies seen in this environment's site-packages (a .pth
    line, whose folder's own .pth files, the checkout's editable install among them, never run): from a folder
    outside the checkout, `import genrec_batch` is the wheel's, loads no dependency, has the wheel's version, and
    every name of its surface resolves."""
    venv = tmp_path / "venv"
    assert subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0
    python = venv / "bin" / "python"
    assert subprocess.run([*PIP, "--python", str(python), "install", "--no-deps", str(wheel)]).returncode == 0
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True)
    (Path(site.stdout.decode().strip()) / "dependencies.pth").write_text("\n".join(sitepackages.getsitepackages()))
    code = (
        "import json, sys, genrec_batch as gb; light = sorted({m.split('.')[0] for m in sys.modules}); "
        "names = [n for n in gb.__all__ if getattr(gb, n) is None]; "
        "print(json.dumps({'file': gb.__file__, 'version': gb.__version__, 'light': light, 'none': names}))"
    )
    out = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=without_paths())
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["file"].startswith(str(venv)) and got["none"] == []
    assert got["version"] == wheel.name.split("-")[1] == version("genrec-batch")
    assert not {"torch", "ray", "pyarrow", "decoding", "pipeline"} & set(got["light"]), got["light"]


def without_paths() -> dict:
    """The environment without what would put the checkout on a child's path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_nothing_reads_the_folder_beside_the_checkout(tmp_path):
    """conftest's audit hook: opening or listing `../shared` fails in this process, whether it exists or not."""
    beside = ROOT.parent / "shared"
    with pytest.raises(PermissionError, match="never read outside the repository"):
        open(beside / "datasets" / "x.parquet", "rb")  # noqa: SIM115
    with pytest.raises(PermissionError):
        os.listdir(beside)


def test_prepare_never_writes_into_its_source(tmp_path):
    from jobs.prepare_data import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--out", str(BEAUTY_SOURCE / "prepared")])
    assert parse_args(["--out", str(tmp_path / "beauty")]).out == tmp_path / "beauty"


def test_the_time_budget_reads_pytests_own_record(tmp_path):
    """tests.budget on the JUnit XML of a real pytest run: the wall time against the budget and the slowest tests,
    slowest first; exit 0 within 1.2 x the budget, 1 above it or when no test ran, 2 for a file that is not pytest's
    XML. The suite's own time is never asserted inside a test: CI runs the check after `make test`."""
    (tmp_path / "test_two.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(0.3)\n\ndef test_fast():\n    pass\n"
    )
    xml = tmp_path / "times.xml"
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_two.py"]
    assert subprocess.run(run, cwd=tmp_path, capture_output=True).returncode == 0

    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tests.budget", *args], cwd=ROOT, capture_output=True, text=True)

    within = check(str(xml), "--budget-s", "60")
    assert within.returncode == 0 and "2 tests" in within.stdout and "within" in within.stdout, within.stdout
    slowest = [line.split()[-1] for line in within.stdout.splitlines() if line.startswith("  ")]
    assert slowest == ["test_two::test_slow", "test_two::test_fast"]  # slowest first, with pytest's test ids
    over = check(str(xml), "--budget-s", "0.2")  # the run took over 0.3 s: above 1.2 x 0.2 s
    assert over.returncode == 1 and "OVER" in over.stdout
    empty = tmp_path / "empty.xml"
    empty.write_text('<testsuites><testsuite name="pytest" time="1.0"/></testsuites>')
    assert check(str(empty)).returncode == 1
    (tmp_path / "bad.xml").write_text("<html/>")
    bad = check(str(tmp_path / "bad.xml"))
    assert bad.returncode == 2 and "bad.xml" in bad.stderr
