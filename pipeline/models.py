"""Model directories as users bring them: attach the prompt template a model was trained with, checked first."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from decoding.catalog import Catalog
from decoding.models import load_config, load_tokenizer
from decoding.templates import PromptTemplate, get_template, write_template
from operators.prompts import Renderer, catalog_probes


def attach_template(model_dir, template: str | PromptTemplate, catalog, max_items: int | None = None) -> dict:
    """Writes `template` (a preset, a JSON file or a template) into a local model directory after checking it against
    the model and a catalog (items.parquet): a causal LM, every code token the catalog needs in its tokenizer, the
    template compiling against the tokenizer -> a summary (the template, its longest prompt in tokens)."""
    model_dir = Path(model_dir)
    load_config(model_dir)
    template = get_template(template).with_max_items(max_items)
    tokenizer = load_tokenizer(model_dir)
    cat = Catalog.from_table(
        pq.read_table(catalog), tokenizer, on_duplicate="first", source=str(catalog), code_token=template.code
    )
    renderer = Renderer.compile(template, tokenizer, catalog_probes(cat.item_tokens))
    path = write_template(model_dir, template)
    return {"file": str(path), "template": template.to_dict(), "max_prompt_tokens": renderer.max_len}
