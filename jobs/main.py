"""`genrec-batch SUBCOMMAND [flags]`: one installed command for every job.

Each subcommand is the job's own parser and main, the same as `python -m jobs.MODULE [flags]` (which keeps working:
Ray job entrypoints and the manifests use it). `genrec-batch --help` lists them; `genrec-batch SUBCOMMAND --help`
shows the job's flags; `genrec-batch --version` prints this package's version and the torch, transformers and Ray
ranges it supports (pyproject.toml; constraints.txt pins the tested ones) beside the ones installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import sys

# subcommand -> (module, one-line purpose)
COMMANDS = {
    "nightly": ("jobs.nightly", "run the nightly job: every user's top-K, published to local or s3:// storage"),
    "prepare": (
        "jobs.prepare_data",
        "import histories and a catalog (Amazon Beauty, LC-Rec, MiniOneRec, OpenOneRec, synthetic)",
    ),
    "train-target": ("jobs.train_target", "train the target generative recommender on semantic-ID tokens"),
    "train-draft": ("jobs.train_draft", "train a draft aligned with a target (AtSpeed-S / -R, KD, SFT)"),
    "template": ("jobs.template", "give a model directory its prompt template, checked against its tokenizer"),
    "upload-model": ("jobs.upload_model", "check a model folder, upload it to s3:// with its checksums, verify it"),
    "export": ("jobs.export", "serve a published run from Redis behind an atomic version switch, with rollback"),
    "show": ("jobs.show", "a published run's summary and the files of its tables (what readers read)"),
    "evaluate": ("jobs.evaluate", "Recall@K and NDCG@K of a published run against the input's targets"),
    "report": ("jobs.report", "the cost and throughput report of a published run (Markdown, HTML, figures)"),
    "bench": ("jobs.bench", "benchmarks: decode, speculative, DISC, shapes, precision, GPU, ..."),
}
CORE = ("torch", "transformers", "ray")


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {purpose}" for name, (_, purpose) in COMMANDS.items())
    return (
        "usage: genrec-batch [--version] SUBCOMMAND [flags]\n\n"
        "Distributed offline batch recommendation for LLM-based generative recommenders.\n\n"
        f"subcommands:\n{rows}\n\n"
        "`genrec-batch SUBCOMMAND --help` shows its flags; `python -m jobs.MODULE` runs the same parser."
    )


def versions() -> str:
    """This package's version, then each core dependency: its supported range (installed)."""
    try:
        version, requires = md.version("genrec-batch"), md.requires("genrec-batch") or []
    except md.PackageNotFoundError:
        return "genrec-batch: not installed (pip install -e .)"
    ranges = dict(m.groups() for r in requires if (m := re.match(r"([\w.-]+)(?:\[[^]]*\])?\s*([<>=!~][^;]*)", r)))
    lines = [f"genrec-batch {version}"]
    for name in CORE:
        try:
            installed = md.version(name)
        except md.PackageNotFoundError:
            installed = "not installed"
        spec = ",".join(sorted(ranges.get(name, "any").strip().split(","), key=lambda s: s[0] != ">"))  # lower first
        lines.append(f"  {name} {spec} (installed: {installed})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(versions())
        return 0
    if argv[0] not in COMMANDS:
        print(
            f"{usage()}\n\nerror: unknown subcommand {argv[0]!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr
        )
        return 2
    from jobs.cli import INVOKED

    module = importlib.import_module(COMMANDS[argv[0]][0])
    INVOKED.append(argv[0])  # its parser names it `genrec-batch SUBCOMMAND` (jobs.cli.prog)
    try:
        return module.main(argv[1:])
    finally:
        INVOKED.pop()


if __name__ == "__main__":
    sys.exit(main())
