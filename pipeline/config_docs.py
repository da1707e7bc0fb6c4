"""docs/configuration.md, generated from the config's dataclasses: every field of the nightly config with its type,
default, meaning (the comment beside the field in pipeline/config.py, pipeline/storage.py and operators/spec.py, the
one place each is written) and an example (from infra/configs/production.example.yaml where it sets the field, else
the default).

    python -m pipeline.config_docs > docs/configuration.md     (make docs; tests/test_docs.py fails when stale)
"""

from __future__ import annotations

import inspect
import io
import sys
import tokenize
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import yaml

from pipeline.config import SECTIONS as CONFIG_SECTIONS
from pipeline.config import Config

SECTIONS = {"": Config, **CONFIG_SECTIONS}
EXAMPLE = Path(__file__).resolve().parents[1] / "infra" / "configs" / "production.example.yaml"
INTRO = """\
# Configuration reference

> **On a GPU:** the `compute` fields place the work on GPUs. What fits a GPU: [sizing.md](sizing.md); what has run
> on one, with its figures: [benchmarks.md](benchmarks.md).

The nightly job reads one YAML file (`genrec-batch nightly --config FILE`) and `--set a.b=value` overrides (values
parsed as YAML), and validates every field before anything runs: a wrong one fails with exit 2 and a message naming
it (`config: decoding.k must be an integer >= 1, got 0`). Credentials never come from the file; a key that looks like
one is refused. `pipeline/configs/demo.yaml` is the demo's config (the default),
`infra/configs/production.example.yaml` a GPU cluster's. How the job uses these fields: [the operator's
manual](nightly.md); the terms: [the glossary](glossary.md). The processor, the same decode as a step of your own Ray
Data pipeline, reads the fields that say what to decode and how (the items, `columns`, `models`, `decoding`,
`compute`, `storage`) under the same names ([library.md](library.md#its-config)).

This page is generated from `pipeline/config.py`, `pipeline/storage.py` and `operators/spec.py` (`make docs`);
`tests/test_docs.py` fails when it is stale.
"""


def field_comments(cls) -> dict[str, str]:
    """Field name -> the comment beside it in the class's source, continuation comment lines included."""
    source = inspect.getsource(cls)
    out: dict[str, list[str]] = {}
    current, line_start = None, True
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and line_start and tok.start[1] == 4:
            current = tok.string if tok.string not in ("def", "class", "return") else None
        if tok.type == tokenize.OP and tok.string == "@" and tok.start[1] == 4:
            current = None  # a property or method: the fields are over
        if tok.type == tokenize.COMMENT and current:
            out.setdefault(current, []).append(tok.string.lstrip("#").strip())
        line_start = tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    return {name: " ".join(parts) for name, parts in out.items()}


def default_of(f) -> object:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is MISSING:
        return None
    return "(section)" if is_dataclass(f.default_factory) else f.default_factory()


def cell(value) -> str:
    text = "null" if value is None else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
    return f"`{text.strip() or chr(34) * 2}`"


def examples() -> dict[str, object]:
    """Dotted field name -> the value production.example.yaml gives it."""
    raw = yaml.safe_load(EXAMPLE.read_text()) or {}
    flat = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def section_table(prefix: str, cls, given: dict) -> str:
    notes = field_comments(cls)
    rows = ["| field | type | default | meaning | example |", "|---|---|---|---|---|"]
    for f in fields(cls):
        if f.name in SECTIONS:
            continue
        name = f"{prefix}.{f.name}" if prefix else f.name
        example = given.get(name, default_of(f))
        shown = "—" if example in ("", None, []) else f"`--set {name}={cell(example)[1:-1]}`"
        meaning = notes.get(f.name, "").replace("|", "\\|")
        kind = str(f.type).replace("|", "or")
        rows.append(f"| `{name}` | {kind} | {cell(default_of(f))} | {meaning} | {shown} |")
    return "\n".join(rows)


def reference() -> str:
    given = examples()
    parts = [INTRO]
    for prefix, cls in SECTIONS.items():
        title = f"`{prefix}`" if prefix else "Top level"
        doc = (inspect.getdoc(cls) or "").splitlines()[0] if prefix == "decoding" else ""
        parts.append(f"## {title}\n\n" + (f"{doc}\n\n" if doc else "") + section_table(prefix, cls, given) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(reference())
