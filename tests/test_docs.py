"""The docs a user reads are checked like code: every relative link resolves (file and heading), every command shown
in a code block parses with its own job's parser (README, docs/, infra/README), the configuration reference is what the
config's dataclasses generate, the README stays a front page, and `genrec-batch` lists and runs the jobs."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib
import io
import os
import pydoc
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.main import COMMANDS
from jobs.main import main as genrec_batch
from pipeline.config import DEMO_CONFIG, load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
MODULES = {module: name for name, (module, _) in COMMANDS.items()}


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]|<[^>]+>", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def commands(page: Path):
    """(line, subcommand, [section], flags) of every genrec-batch / python -m jobs.X command in the page's code
    blocks (continuation lines joined, comments dropped)."""
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            for i, w in enumerate(words):
                if w == "genrec-batch" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                    yield line, words[i + 1], words[i + 2 :]
                elif w == "-m" and i + 1 < len(words) and words[i + 1].startswith("jobs."):
                    yield line, MODULES.get(words[i + 1], words[i + 1]), words[i + 2 :]


def help_text(argv: list[str]) -> str:
    """What `genrec-batch ARGV --help` prints (in this process: the jobs' own parsers)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        genrec_batch([*argv, "--help"])
    return out.getvalue()


def parse(name: str, argv: list[str]):
    """`genrec-batch NAME ARGV` through its job's own `parse_args`: the parser and every check made on the parsed
    arguments (types, choices, required ones, combinations), nothing run. The namespace (or the job's parsed
    config), or the error message."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            return importlib.import_module(COMMANDS[name][0]).parse_args(argv)
        except SystemExit as e:
            if e.code == 0:  # --help
                return argparse.Namespace(config=None, set=[])
            return (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]


def test_every_job_parses_its_arguments_apart_from_running():
    missing = [
        name for name, (module, _) in COMMANDS.items() if not hasattr(importlib.import_module(module), "parse_args")
    ]
    assert missing == [], f"jobs without a parse_args(argv) the docs test can call: {missing}"
    assert isinstance(parse("prepare", ["--format", "lcrec"]), str)  # a check made after parsing counts too
    assert isinstance(parse("report", ["--run"]), str) and not isinstance(parse("report", ["--run", "x"]), str)


def test_every_command_shown_parses():
    """Every genrec-batch / python -m jobs.X command in README.md, docs/ and infra/README.md, as written: the real
    parser takes all its arguments; a nightly's --config and --set values make a valid config."""
    wrong, seen = [], 0
    for page in [*PAGES, ROOT / "infra" / "README.md"]:
        for line, name, rest in commands(page):
            seen += 1
            if name not in COMMANDS:
                wrong.append(f"{page.name}: unknown subcommand {name!r} in `{line.strip()}`")
            elif isinstance(parsed := parse(name, rest), str):
                wrong.append(f"{page.name}: `{line.strip()}`: {parsed}")
            elif name == "nightly":
                config = parsed.config and str(ROOT / parsed.config) if "://" not in (parsed.config or "") else None
                try:
                    load_config(config or str(DEMO_CONFIG), parsed.set)
                except ValueError as e:
                    wrong.append(f"{page.name}: `{line.strip()}`: {e}")
    assert seen > 10, "no command found in the pages"
    assert not wrong, "\n".join(wrong)


def test_every_make_target_shown_exists():
    targets = set(re.findall(r"(?m)^([\w-]+):", (ROOT / "Makefile").read_text()))
    shown = {
        (page.name, t)
        for page in [*PAGES, ROOT / "infra" / "README.md"]
        for block in FENCE.findall(page.read_text())
        for t in re.findall(r"(?m)^\s*make ([\w-]+)", block)
    }
    assert shown and not [f"{page}: make {t}" for page, t in shown if t not in targets]


def test_the_configuration_reference_is_current():
    from pipeline.config_docs import reference

    assert (ROOT / "docs" / "configuration.md").read_text() == reference(), (
        "docs/configuration.md is stale: run `make docs`"
    )


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_genrec_batch_lists_its_subcommands_and_versions(capsys):
    assert genrec_batch(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^  {name} +\S", out, re.M) for name in COMMANDS)
    assert genrec_batch(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("genrec-batch ") and all(f"  {name} " in out for name in ("torch", "transformers", "ray"))
    assert genrec_batch(["nope"]) == 2 and "unknown subcommand 'nope'" in capsys.readouterr().err
    for name, (module, _) in COMMANDS.items():  # every subcommand is its job's own parser, named as it was run
        words = " ".join(run_help(importlib.import_module(module)).split())
        assert " ".join(help_text([name]).split()) == words.replace(f"python -m {module} ", f"genrec-batch {name} ", 1)


def run_help(module) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(["--help"])
    return out.getvalue()


def test_the_installed_command_runs():
    """The console script pyproject.toml installs: the same as `python -m jobs.main`."""
    script = Path(sys.executable).with_name("genrec-batch")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "jobs.main"]
    done = subprocess.run([*argv, "--version"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("genrec-batch "), done.stderr


def doc_section(text: str, heading: str) -> str:
    """A page's text under `### heading`, up to the next heading."""
    return re.split(r"\n##+ ", text.split(f"\n### {heading}\n", 1)[1], maxsplit=1)[0]


def first_table(section: str) -> dict[str, str]:
    """The first Markdown table of a section -> {first cell (a `name`): second cell}."""
    rows = re.search(r"(?m)^\|.*(?:\n\|.*)*", section).group(0)
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", rows, re.M))


ARROW_FLOATS = {"float": "float32", "double": "float64"}  # pyarrow's names -> the docs' (numpy's)


def test_the_output_reference_documents_every_column_and_reject_reason():
    """docs/output.md lists every column of every published table, in the schema's order and with its type, and every
    reject reason."""
    import pyarrow as pa

    from operators import validate
    from operators.outputs import table_schema
    from pipeline.shards import DUPLICATE, METRIC_SCHEMA

    text = (ROOT / "docs" / "output.md").read_text()
    tables = {
        "recommendations": table_schema("rec", pa.int64()),
        "rejects": table_schema("reject", pa.int64()),
        "metrics": METRIC_SCHEMA,
    }
    for name, schema in tables.items():
        documented = first_table(doc_section(text, name))
        assert list(documented) == schema.names, name
        for field in schema:
            arrow = re.sub(r"\b(float|double)\b", lambda m: ARROW_FLOATS[m[1]], str(field.type).replace("item: ", ""))
            want = "integer, string or binary" if field.name == "user_id" else arrow
            assert documented[field.name].replace("\\", "") == want, (name, field.name)
    rejects = doc_section(text, "rejects")
    reasons = re.findall(r"^    (\w+) +\S", validate.__doc__, re.M) + [DUPLICATE[0], "non_finite_logits"]
    assert reasons[0] == "missing_user_id" and all(f"| `{r}` |" in rejects for r in reasons)


HISTORY = [  # phrases that tell the project's history, not the product: a reader cannot act on them
    r"\bissues?\b(?! tracker)",
    r"\bsessions?\b",
    r"\bthis (?:machine|CPU|VM|box|laptop|host)\b",
    r"\bthis \d+-core\b",
    r"\b(?:was|were) lent\b",
    r"\bthe last stop\b",
    r"\bno GPU was\b",
    r"\b(?:an|the) earlier (?:session|one)\b",
    r"\bthe (?:lead|reviewer|engineer)s?\b",
    r"\bwe (?:added|fixed|changed|removed|asked|tried)\b",
    r"\bas (?:asked|requested)\b",
    r"\bnow in every\b",  # "it grew in half of the test runs, now in every one": a change, not the product
    r"\b(?:half|some|most) of the test runs\b",
    r"\bas before\b",
    r"\bthis project before\b",
    r"\bdevice (?:calls?|time|budget)\b",  # how a GPU machine was borrowed to measure
    r"\btimeout_s\b",
    r"\bneeds? carrying\b",
    r"\blent\b",
    r"\bwhat comes back\b",
]


def test_the_pages_tell_no_history():
    """README.md, docs/ and infra/README.md speak to users: no issues, sessions, "this machine", what changed since
    an earlier version, how a GPU was borrowed, and the like (figures name their machine in benchmarks.md's
    provenance table instead). Fenced code is checked too."""
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group()!r}"
        for page in [*PAGES, ROOT / "infra" / "README.md"]
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for pattern in HISTORY
        if (m := re.search(pattern, line, re.I))
    ]
    assert not found, "internal history in the pages:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text, flagged",
    [
        ("the issue that asked for this", True),
        ("On this 2-core CPU the ratio", True),
        ("measured on this machine", True),
        ("no GPU was lent to the sessions", True),
        ("a Ray session", True),
        ("the machine that runs the driver", False),
        ("a 2-core AMD EPYC development VM", False),
        ("the issuer of the token", False),
        ("report it on the issue tracker", False),
        ("it grew in half of the test runs, now in every one", True),
        ("an item's score is its codes' log-probability, as before.", True),
        ("train only (this project before)", True),
        ("- **As a device call**: run that line with a time limit (`timeout_s: 540`)", True),
        ("Nothing needs carrying: the data is in the package", True),
        ("the GPU that was lent to it", True),
        ("the device's memory, on a CUDA device", False),
        ("each call gets the SDKs' own 3 attempts; a call that gives up", False),
        ("before the lease, and before Ray", False),
        ("a shard's files carry the attempt that wrote them", False),
        ("the 480 s budget for the cells; every test run rehearses it", False),
        ("the pool grows onto a node that joins mid-run", False),
    ],
)
def test_the_history_patterns_catch_history_and_spare_plain_words(text, flagged):
    assert any(re.search(p, text, re.I) for p in HISTORY) == flagged


def test_every_docs_page_says_what_ran_on_a_gpu():
    """Each page of docs/ opens with the same box: what has run on a GPU, what has not, where the figures are."""
    missing = [
        page.name
        for page in PAGES[1:]
        if not any(line.startswith("> **On a GPU:** ") for line in page.read_text().splitlines()[:8])
    ]
    assert not missing, f"pages without the '> **On a GPU:**' box in their first lines: {missing}"


# --- every file, config field, flag and metrics column the pages name exists ----------------------------------------

NAMED_PAGES = [*PAGES, ROOT / "infra" / "README.md"]
SPAN = re.compile(r"`([^`\n]+)`")
SECTIONS = ("models", "decoding", "compute", "storage", "runs")  # Config's sections: `section.field` is a config field
# Paths a command writes, named before they exist: `make bench-gpu` keeps each GPU report as a page there.
WRITTEN = ("docs/benchmarks", "docs/benchmarks/*")
# Flags of other programs a page names on their own (a span that starts with the program is skipped whole): Ray's
# (`ray job submit`, `ray start`, `ray get-auth-token`), kubectl's and the KubeRay operator's. Never a job's flag.
EXTERNAL_FLAGS = {
    "--address",  # ray job submit / ray job logs / ray job status
    "--working-dir",  # ray job submit
    "--runtime-env",  # ray job submit
    "--dashboard-host",  # ray start
    "--generate",  # ray get-auth-token
    "--dry-run",  # kubectl create
    "--from-file",  # kubectl create configmap
    "--from-literal",  # kubectl create secret
    "--feature-gates",  # the KubeRay operator
}
EXTENSIONS = {"py", "md", "json", "yaml", "yml", "sh", "txt", "toml", "parquet", "png", "html", "csv", "gz", "npy"}
EXTERNAL_COMMANDS = ("ray ", "kubectl ", "docker ", "pip ", "make ", "ruff ", "pytest ", "aws ", "sed ", "helm ")


def repository_files() -> set[str]:
    """What a clone has: tracked files and new ones not ignored (repository-relative, '/'-separated)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return {line for line in out.stdout.splitlines() if (ROOT / line).exists()}


def job_parsers() -> dict[str, list[argparse.ArgumentParser]]:
    """Each job's argparse parser as its own `parse_args` builds it (caught before it parses), with every subparser
    (`python -m jobs.bench` has one per benchmark) -> {subcommand: [parsers]}."""
    from unittest import mock

    class Built(Exception):
        pass

    found: dict[str, list[argparse.ArgumentParser]] = {}
    for name, (module, _) in COMMANDS.items():
        seen: list[argparse.ArgumentParser] = []

        def catch(parser, *args, **kwargs):
            seen.append(parser)
            raise Built

        with mock.patch.object(argparse.ArgumentParser, "parse_args", catch), contextlib.suppress(Built):
            importlib.import_module(module).parse_args([])
        assert seen, f"{module}.parse_args built no argparse parser"
        todo, found[name] = [seen[0]], []
        while todo:
            parser = todo.pop()
            found[name].append(parser)
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    todo.extend(action.choices.values())
    return found


def bench_sh_flags() -> set[str]:
    """infra/gpu/bench.sh's own flags (its `case` labels); it hands the rest to `python -m jobs.bench gpu`."""
    return set(re.findall(r"^\s*(--[\w-]+)\)", (ROOT / "infra" / "gpu" / "bench.sh").read_text(), re.M))


def config_fields() -> dict[str, set[str]]:
    """Config's dataclasses -> {"": top-level fields, section: its fields}."""
    import dataclasses

    from pipeline.config import Config

    out: dict[str, set[str]] = {"": set()}
    for f in dataclasses.fields(Config):
        kind = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(kind):
            out[f.name] = {g.name for g in dataclasses.fields(kind)}
        else:
            out[""].add(f.name)
    return out


def output_columns() -> set[str]:
    """Every column of every published table (recommendations, rejects, metrics)."""
    import pyarrow as pa

    from operators.outputs import table_schema
    from pipeline.shards import METRIC_SCHEMA

    return {*table_schema("rec", pa.int64()).names, *table_schema("reject", pa.int64()).names, *METRIC_SCHEMA.names}


class Names:
    """What the pages may name: the repository's files, the config's fields, the jobs' flags, the output columns."""

    def __init__(self):
        self.files = repository_files()
        self.dirs = {"/".join(f.split("/")[:i]) for f in self.files for i in range(1, f.count("/") + 1)}
        self.config = config_fields()
        parsers = job_parsers()
        self.flags = {
            name: {o for p in ps for a in p._actions for o in a.option_strings} for name, ps in parsers.items()
        }
        self.all_flags = set().union(*self.flags.values(), {"--help", "--version"})  # genrec-batch's own two
        self.bench_sh = bench_sh_flags() | self.flags["bench"]
        self.columns = output_columns()

    def is_repo(self, rel: str) -> bool:
        return rel in self.files or rel in self.dirs

    def path(self, word: str, page: Path) -> str | None:
        """A word that names a file or folder under a folder of the repository (from the root, or from the page's
        own folder: infra/README.md's `kuberay/...`) -> what is wrong with it, None when it exists or is no path."""
        word = re.sub(r"(?:#[\w-]*|:\d+)$", "", word.strip("()[],;:.'\"")).rstrip("/")
        if "/" not in word or "://" in word or word.startswith(("~", "$", "/")):
            return None
        for base in (ROOT, page.parent):
            rel = os.path.relpath(base / word, ROOT).replace(os.sep, "/")
            first = os.path.relpath(base / word.split("/")[0], ROOT).replace(os.sep, "/")
            if rel.startswith("..") or not self.is_repo(first):
                continue  # not under a folder of the repository: data/, models/, out/, run_date=D/, a table's folder
            pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", rel)
            if any(fnmatch.fnmatch(pattern, w) or fnmatch.fnmatch(rel, w) for w in WRITTEN):
                return None
            if "*" in pattern:
                if any(fnmatch.fnmatch(f, pattern) for f in self.files):
                    return None
            elif self.is_repo(rel):
                return None
            module = re.fullmatch(r"(.+)\.(\w+)", rel)  # or a module's name: `tests/helpers.float32_atol`
            if module and module[2] not in EXTENSIONS and f"{module[1]}.py" in self.files:
                return None
            return f"no file {rel}"
        return None

    def folder_row(self, row: str, page: Path) -> list[str]:
        """A table row that names a folder in its first cell (`| `configs/` | ... `demo.yaml` ... |`): every bare
        source or config file name it lists in backticks must be in that folder or one below it."""
        cells = row.strip().strip("|").split("|")
        folder = re.fullmatch(r"\s*`([\w./-]+/)`\s*", cells[0]) if len(cells) > 1 else None
        if not folder:
            return []
        wrong = []
        for name in sorted(set(SPAN.findall("|".join(cells[1:])))):
            if not re.fullmatch(r"[\w.-]+\.(?:py|sh|yaml|yml|json|toml)", name):
                continue
            if self.path(f"{folder[1]}{name}", page) and self.path(f"{folder[1]}**/{name}", page):
                wrong.append(self.path(f"{folder[1]}{name}", page))
        return wrong

    def field(self, word: str) -> str | None:
        """`section.field` (also `section.field=value`, `section.field:`) -> what is wrong, None when Config has it
        or the name is code (`runs.read_table`: pipeline/runs.py; `decoding.memory.fit_batch`)."""
        name = re.split(r"[=:]", word.strip("()[],;'\""), maxsplit=1)[0].rstrip(".")
        parts = name.split(".")
        if len(parts) < 2 or parts[0] not in SECTIONS or not all(re.fullmatch(r"[a-z_][a-z0-9_]*", p) for p in parts):
            return None
        if parts[-1] in EXTENSIONS:
            return None  # a file: `runs.py` (pipeline/runs.py) in a table of modules
        if len(parts) == 2 and parts[1] in self.config[parts[0]]:
            return None
        if any(pydoc.locate(prefix + name) is not None for prefix in ("", "pipeline.", "operators.", "jobs.")):
            return None
        return f"no config field {name}"

    def set_key(self, key: str) -> str | None:
        """A `--set KEY=VALUE`'s key -> what is wrong, None when Config has the field."""
        section, _, name = key.rpartition(".")
        if name in self.config.get(section, ()) or all(len(part) == 1 for part in key.split(".")):  # `a.b=value`
            return None
        return f"no config field {key} (--set)"

    def span_flags(self, span: str) -> list[str]:
        """The flags of one inline code span -> what is wrong with them: after a job's command, that job's flags;
        alone, any job's (or an external program's of EXTERNAL_FLAGS); nothing for another program's command."""
        if span.lstrip().startswith(EXTERNAL_COMMANDS):
            return []
        words, owner, wrong = span.split(), None, []
        for i, w in enumerate(words):
            if w == "genrec-batch" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                owner = words[i + 1]
            elif w == "-m" and i + 1 < len(words) and words[i + 1].startswith("jobs."):
                owner = MODULES.get(words[i + 1], words[i + 1])
            elif w.endswith("infra/gpu/bench.sh"):
                owner = "bench.sh"
            if not re.match(r"--[a-z]", w):
                continue
            flag = re.split(r"[=\]),.:;]", w, maxsplit=1)[0]
            if owner == "bench.sh":
                ok = flag in self.bench_sh
            elif owner is not None:
                ok = flag in self.flags.get(owner, set()) | {"--help"}
            else:
                ok = flag in self.all_flags or flag in EXTERNAL_FLAGS
            if not ok:
                wrong.append(f"no flag {flag}" + (f" in {owner}" if owner else ""))
        return wrong

    def metric_columns(self, clause: str) -> list[str]:
        """A sentence or clause that speaks of metric rows or the metrics table: its backticked snake_case names
        (up to a mention of the manifest, whose keys follow) must be columns of the published tables."""
        if not re.search(r"\bmetric(?:s'| rows?\b| table\b|s table\b| columns?\b)", clause):
            return []
        clause = re.split(r"\bmanifest\b", clause, maxsplit=1)[0]
        return [
            f"no column {name} in the published tables"
            for name in SPAN.findall(clause)
            if re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", name) and name not in self.columns
        ]

    def wrong(self, text: str, page: Path) -> list[str]:
        """Everything a page's text names that the repository lacks: files, config fields, flags, metrics columns."""
        found = []
        for block in FENCE.findall(text):  # code blocks: --set keys, and bench.sh's flags (the jobs' commands are
            for line in block.replace("\\\n", " ").splitlines():  # parsed whole by test_every_command_shown_parses)
                found += [self.set_key(k) for k in re.findall(r"--set[ =]([\w.]+)=", line)]
                if "infra/gpu/bench.sh" in line:
                    found += self.span_flags(line.split("#")[0])
        prose = FENCE.sub("", text)
        for span in SPAN.findall(prose):
            for word in span.split():
                found += [self.path(word, page), self.field(word)]
            found += [self.set_key(k) for k in re.findall(r"--set[ =]([\w.]+)=", span)]
            found += self.span_flags(span)
        for row in re.findall(r"(?m)^\|.*\|$", prose):
            found += self.folder_row(row, page)
        for paragraph in re.split(r"\n\s*\n", prose):
            for clause in re.split(r"(?<=[.;])\s+", paragraph.replace("\n", " ")):
                found += self.metric_columns(clause)
        return sorted({f"{page.relative_to(ROOT)}: {w}" for w in found if w})


@pytest.fixture(scope="module")
def names():
    return Names()


def test_every_file_field_flag_and_column_the_pages_name_exists(names):
    """Every repository path (`pipeline/items.py`, infra/README.md's `kuberay/...`), config field (`decoding.k`,
    `--set a.b=...`), command-line flag (a job's, after its command or alone) and metrics column (in a sentence about
    metric rows) that README.md, docs/ and infra/README.md name in backticks exists in the code."""
    wrong = [w for page in NAMED_PAGES for w in names.wrong(page.read_text(), page)]
    assert not wrong, "the pages name what the code lacks:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "line, page, flagged",
    [
        ("the items (`pipeline/items.py`)", "docs/x.md", False),
        ("the items (`pipeline/itemz.py`)", "docs/x.md", True),
        ("see `docs/nightly.md`", "README.md", False),
        ("see `docs/nightly2.md`", "README.md", True),
        ("`kuberay/rayjob-nightly.yaml`", "infra/README.md", False),
        ("`configs/demo.yaml` (local files)", "infra/README.md", True),
        ("| `configs/` | nightly configs: `demo.yaml` (local files) |", "infra/README.md", True),
        ("| `configs/` | `production.example.yaml`, `g5.example.yaml` |", "infra/README.md", False),
        ("`python -m jobs.nightly --config infra/configs/demo.yaml`", "docs/x.md", True),
        ("`pipeline/configs/demo.yaml`", "docs/x.md", False),
        ("`tests/helpers.float32_atol` and `pipeline/items.json`", "docs/x.md", True),
        ("`tests/helpers.float32_atol`", "docs/x.md", False),
        ("`docs/benchmarks/gpu-<device>-<date>.md`", "docs/x.md", False),
        ("`infra/kuberay/*.yaml`", "docs/x.md", False),
        ("`out/nightly/run_date=<D>/` and `data/beauty/items.parquet`", "docs/x.md", False),
        ("`decoding.k` and `compute.engine: auto`", "docs/x.md", False),
        ("`decoding.kk`", "docs/x.md", True),
        ("`compute.engines=eager`", "docs/x.md", True),
        ("`runs.read_table` and `decoding.memory.fit_batch`", "docs/x.md", False),
        ("`runs.read_tables`", "docs/x.md", True),
        ("`counts.users_short` and `precision_audit.device`", "docs/x.md", False),
        ("`--resume latest`, `--check`, `--set a.b=value`", "docs/x.md", False),
        ("`--resumes latest`", "docs/x.md", True),
        ("`python -m jobs.nightly --gpu-hour-price 2`", "docs/x.md", True),
        ("`genrec-batch report --gpu-hour-price 2`", "docs/x.md", False),
        ("`python -m jobs.bench shapes --vocabs 2048`", "docs/x.md", False),
        ("`--working-dir .`", "docs/x.md", False),
        ("`kubectl create configmap x --from-file=a=b`", "docs/x.md", False),
        ("`--set decoding.kk=20`", "docs/x.md", True),
        ("```bash\ngenrec-batch nightly --set compute.nope=1\n```\n", "docs/x.md", True),
        ("```bash\nbash infra/gpu/bench.sh --smoke --sections qwen\n```\n", "docs/x.md", False),
        ("```bash\nbash infra/gpu/bench.sh --smok\n```\n", "docs/x.md", True),
        ("Metric rows carry `engine`, `compile_s` and `engine_note`.", "docs/x.md", False),
        ("the reason is in the metric row's `engine_notes`.", "docs/x.md", True),
        ("the metrics' `users_short`; the manifest's `users_shortest`", "docs/x.md", False),
        ("`audit_device` and `audit_skiped`, and the metrics table", "docs/x.md", True),
        ("an `item_id` of the catalog and `stats['engine_note']`", "docs/x.md", False),
    ],
)
def test_the_name_check_catches_what_the_code_lacks(names, line, page, flagged):
    assert bool(names.wrong(line, ROOT / page)) == flagged, names.wrong(line, ROOT / page)


# Terms a reader may not know, each defined in docs/glossary.md: a page that uses one links the glossary first.
JARGON = {
    "tree attention": r"\btree attention\b",
    "CSR": r"\bCSR\b",
    "PPV": r"\bPPV\b",
    "near-tie": r"\bnear-ties?\b",
    "IRSA": r"\bIRSA\b",
    "attempt": r"`attempt`|<attempt>|\battempt's\b|\beach attempt\b",  # the run's attempts, not "a failed attempt"
    "unit": r"\bunits?\b(?!(?: and integration)? tests?\b|,)",  # not "unit tests"
}


def jargon_before_glossary(text: str) -> list[str]:
    """The terms of JARGON a page uses before it links the glossary (a link named by the term counts; the names of
    files such as `pipeline/units.py` are left out)."""
    text = re.sub(r"`[\w./-]+/[\w.-]+\.(?:py|sh|md|yaml|json)`", "``", text)
    link = re.search(r"\[[^\]\n]*\]\((?:[^)]*/)?glossary\.md[)#]", text)
    first_link = link.start() if link else len(text)
    return [term for term, pattern in JARGON.items() if (m := re.search(pattern, text)) and m.start() < first_link]


def test_every_term_is_in_the_glossary_and_linked_before_its_first_use():
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    missing = [term for term in JARGON if not re.search(rf"^\*\*{re.escape(term)}\b", glossary, re.M | re.I)]
    assert not missing, f"terms without a glossary entry: {missing}"
    early = [
        f"{page.relative_to(ROOT)}: {', '.join(terms)}"
        for page in NAMED_PAGES
        if page.name != "glossary.md"
        if (terms := jargon_before_glossary(page.read_text()))
    ]
    assert not early, "pages that use a term before they link the glossary:\n" + "\n".join(early)


@pytest.mark.parametrize(
    "text, early",
    [
        ("Beam search on a CSR index ([glossary](glossary.md)).", ["CSR"]),
        ("The words are in the [glossary](glossary.md). Beam search on a CSR index.", []),
        ("See [PPV](docs/glossary.md#terms): PPV checks candidates.", []),
        ("users clear of a near-tie", ["near-tie"]),
        ("`recommendations/<shard>-<attempt>.parquet`", ["attempt"]),
        ("the RayJob retries a failed attempt", []),
        ("make test runs unit tests; the suite: unit, local Ray", []),
        ("every CSV row is a unit of its own; see `pipeline/units.py`", ["unit"]),
        ("see `pipeline/units.py`", []),
    ],
)
def test_the_jargon_check_finds_terms_used_before_the_glossary(text, early):
    assert jargon_before_glossary(text) == early


def test_the_data_pages_example_passes_the_jobs_own_checks(tmp_path, monkeypatch):
    """docs/data.md's example, written as shown, passes what the driver checks (the input's columns and user_id type,
    the items) and what an actor checks per row (every row decodes: no reject)."""
    import numpy as np
    import yaml

    from decoding.catalog import ItemTokens
    from decoding.codes import semantic_id_matrix
    from operators.validate import validate
    from pipeline.config import Config
    from pipeline.items import Sources, read_items
    from pipeline.plan import open_input

    text = (ROOT / "docs" / "data.md").read_text()
    section = text.split("\n### An example\n", 1)[1].split("\n## ", 1)[0]
    python = next(b for b in FENCE.findall(section) if "pq.write_table" in b)
    config = next(b for b in FENCE.findall(section) if b.startswith("input:"))
    monkeypatch.chdir(tmp_path)
    exec(compile(python, "docs/data.md", "exec"), {})
    cfg = Config(**{k: str(tmp_path / v) for k, v in yaml.safe_load(config).items()})
    data = open_input(cfg)[0].data
    items = read_items(Sources.of(cfg), cfg.storage)
    assert items.info["recommendable"] == 2 and items.info["items"] == 3
    ids = np.array(items.table.column("item_id").to_numpy())  # a writable copy
    good, rejects = validate(data.to_table(), ItemTokens.from_arrays(ids, semantic_id_matrix(items.table)), 20)
    assert rejects.num_rows == 0 and good.column("user_id").to_pylist() == [7, 8]


def test_each_command_names_itself_as_it_was_run(capsys):
    """`genrec-batch SUBCOMMAND --help` says `genrec-batch SUBCOMMAND`, `python -m jobs.X --help` says that."""
    from jobs import export
    from jobs.main import main

    for run, name in (
        (lambda: main(["export", "--help"]), "genrec-batch export"),
        (lambda: main(["nightly", "--help"]), "genrec-batch nightly"),
        (lambda: export.main(["--help"]), "python -m jobs.export"),
    ):
        with pytest.raises(SystemExit):
            run()
        assert capsys.readouterr().out.startswith(f"usage: {name} [-h]")
