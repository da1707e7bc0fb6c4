"""The docs a user reads are checked like code: every relative link resolves (file and heading), every command shown
in a code block parses with its own job's parser (README, docs/, infra/README), the configuration reference is what the
config's dataclasses generate, the README stays a front page, and `genrec-batch` lists and runs the jobs."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
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
    for name, (module, _) in COMMANDS.items():  # every subcommand is its job's own parser
        assert help_text([name]) == run_help(importlib.import_module(module))


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
    from operators.recommender import table_schema
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
]


def test_the_pages_tell_no_history():
    """README.md and docs/ speak to users: no issues, sessions, "this machine" and the like (figures name their
    machine in benchmarks.md's provenance table instead). Fenced code is checked too."""
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group()!r}"
        for page in PAGES
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
