"""genrec-batch's public Python API: what a program may rely on across versions. Everything else (the `decoding`,
`operators`, `pipeline` and `jobs` packages it re-exports from) is internal and may change.

    import genrec_batch as gb

    # the decoders, on prompts of your own (left-padded [B, S]); docs/decoding.md
    tok = gb.load_tokenizer("models/demo-target")
    catalog = gb.Catalog.from_parquet("data/beauty/items.parquet", tok, on_duplicate="first")
    rec = gb.beam_search(gb.load_model("models/demo-target"), input_ids, attention_mask, catalog, k=10)

    # one step of your own Ray Data pipeline, in Ray Data LLM's shape; docs/library.md
    config = gb.ProcessorConfig(models=gb.Models(target="models/demo-target"), catalog="data/beauty/items.parquet")
    processor = gb.build_processor(config, postprocess=lambda row: {"user": row["user_id"], "items": row["item_ids"]})
    processor(ray.data.read_parquet("histories/")).write_parquet("lists/")

    # the nightly job, and reading what it published; docs/nightly.md, docs/output.md
    cfg = gb.load_config("nightly.yaml")
    gb.check_run(cfg)                       # every driver check, nothing run
    manifest = gb.run_nightly(cfg)          # on the current Ray cluster
    recs = gb.open_run(cfg.output).table("recommendations")

Names are imported on first use (PEP 562), so `import genrec_batch` loads neither torch nor Ray.
"""

# ruff: noqa: F401
# ^ the TYPE_CHECKING imports below re-export the surface to type checkers (tests/test_library.py checks that they name
# what `_SURFACE` does)
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_SURFACE = {
    # the decoders and the catalog they keep to (docs/decoding.md)
    "beam_search": "decoding.beam",
    "speculative_beam_search": "decoding.speculative",
    "disc_sample": "decoding.disc",
    "Recommendations": "decoding.beam",
    "Catalog": "decoding.catalog",
    "Exclusions": "decoding.catalog",
    # models and prompt templates (docs/models.md)
    "load_model": "decoding.models",
    "load_tokenizer": "decoding.models",
    "PromptTemplate": "decoding.templates",
    "get_template": "decoding.templates",
    "read_template": "decoding.templates",
    # the nightly job and its check (docs/nightly.md)
    "Config": "pipeline.config",
    "load_config": "pipeline.config",
    "run_nightly": "pipeline.nightly",
    "check_run": "pipeline.nightly",
    # reading a published run, and a user's list from the serving store it was exported to (docs/output.md)
    "open_run": "pipeline.output",
    "PublishedRun": "pipeline.output",
    "Reader": "pipeline.stores.redis",
    # the processor: a step of your own Ray Data pipeline (docs/library.md)
    "build_processor": "pipeline.processor",
    "Processor": "pipeline.processor",
    "ProcessorConfig": "pipeline.config",
    "load_processor_config": "pipeline.config",
    # the config's sections, by the names the config file uses (docs/configuration.md)
    "Models": "pipeline.config",
    "Decoding": "operators.spec",
    "Compute": "pipeline.config",
    "Columns": "pipeline.config",
    "Storage": "pipeline.storage",
}

__all__ = ["__version__", *_SURFACE]


def __getattr__(name: str):
    """A name of the surface, imported from its module on first use (then cached here); `__version__`: the
    installed package's version."""
    if name == "__version__":
        value = _version()
    elif name in _SURFACE:
        value = getattr(importlib.import_module(_SURFACE[name]), name)
    else:
        raise AttributeError(f"module 'genrec_batch' has no attribute {name!r}")
    globals()[name] = value
    return value


def _version() -> str:
    """The installed distribution's version; in a clone on PYTHONPATH (not installed), its pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("genrec-batch")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        return tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports them
    from decoding.beam import Recommendations, beam_search
    from decoding.catalog import Catalog, Exclusions
    from decoding.disc import disc_sample
    from decoding.models import load_model, load_tokenizer
    from decoding.speculative import speculative_beam_search
    from decoding.templates import PromptTemplate, get_template, read_template
    from operators.spec import Decoding
    from pipeline.config import Columns, Compute, Config, Models, ProcessorConfig, load_config, load_processor_config
    from pipeline.nightly import check_run, run_nightly
    from pipeline.output import PublishedRun, open_run
    from pipeline.processor import Processor, build_processor
    from pipeline.storage import Storage
    from pipeline.stores.redis import Reader
