"""The benchmark sections `python -m jobs.bench NAME` runs: each one's parameters (params.py), a line of help, its
measurement (params) -> its own figures and its Markdown (result) -> str, imported only when the section runs (the
benchmarks load torch, which reading the flags does not need). run_section adds what every result carries
(common.report_head: the parameters and the environment) before the Markdown is rendered."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pipeline.bench import params as P

CPU = "cpu"  # a section that runs on the CPU whatever its parameters' device


@dataclass(frozen=True)
class Section:
    params: type
    help: str
    run: str  # "module:function" in pipeline.bench: (params, **kw) -> the section's own figures
    markdown: str | None  # "module:function": (result) -> Markdown; None: `run` makes the whole (result, Markdown)
    device: str | None = None  # the environment's device, where not the parameters'


BENCHES = {
    "all": Section(
        P.AllParams,
        "every claim in one run (decode, speculative, disc, disc-bias) -> all.{md,json}",
        "all:bench_all",
        None,
    ),
    "decode": Section(
        P.DecodeParams,
        "transformers beam search vs beam_search, and the catalog index",
        "decode:run_decode",
        "decode:markdown_decode",
    ),
    "speculative": Section(
        P.SpeculativeParams,
        "AtSpeed Table 1: speculative vs beam_search, every draft, strict/relaxed",
        "speculative:run_speculative",
        "speculative:markdown_speculative",
    ),
    "disc": Section(
        P.DiscParams,
        "DISC (rounds 1..R, exact and PPV) vs constrained sampling vs beam_search",
        "disc:run_disc",
        "disc:markdown_disc",
    ),
    "disc-bias": Section(
        P.DiscBiasParams,
        "DISC's bias: TV / KL of each sampler to the exact constrained P_S",
        "disc:run_disc_bias",
        "disc:markdown_disc_bias",
    ),
    "nightly": Section(
        P.NightlyParams,
        "the nightly job on one actor vs direct calls on the same users",
        "nightly:run_nightly_bench",
        "nightly:markdown_nightly",
    ),
    "templates": Section(
        P.TemplatesParams,
        "prompt templates: rendering cost, and the nightly job's users/s with each",
        "templates:run_templates",
        "templates:markdown_templates",
        CPU,
    ),
    "nightly-scale": Section(
        P.ScaleParams,
        "the nightly job on synthetic users at scale: exactly once, driver RSS, object store peak",
        "scale:run_scale",
        "scale:markdown_scale",
        CPU,
    ),
    "processor": Section(
        P.ProcessorParams,
        "the processor in a Ray Data pipeline vs the nightly on the same users: users/s, driver memory",
        "processor:run_processor",
        "processor:markdown_processor",
        CPU,
    ),
    "items": Section(
        P.ItemsParams,
        "the constraint index over a catalog and a recommendable subset, and an actor's items: seconds, bytes per item",
        "items:run_items",
        "items:markdown_items",
        CPU,
    ),
    "incremental": Section(
        P.IncrementalParams,
        "incremental nights against full nights: wall seconds, users decoded, carry cost, driver memory",
        "incremental:run_incremental",
        "incremental:markdown_incremental",
        CPU,
    ),
    "export": Section(
        P.ExportParams,
        "a published run exported into a local Redis: users/s, MB/s, memory per user at K 10 and K 50",
        "export:run_export",
        "export:markdown_export",
        CPU,
    ),
    "table": Section(
        P.TableParams,
        "a published run committed to fresh local Delta and Iceberg tables: seconds, rows/s, against the nightly",
        "table:run_table",
        "table:markdown_table",
        CPU,
    ),
    "delisted": Section(
        P.DelistedParams,
        "a night with items delisted: taken out of the catalog against left out of the recommendable set",
        "delisted:run_delisted",
        "delisted:markdown_delisted",
        CPU,
    ),
    "shapes": Section(
        P.ShapesParams,
        "beam_search vs transformers over vocabulary x prompt x K, users/s and working memory",
        "shapes:run_shapes",
        "shapes:markdown_shapes",
    ),
    "compile": Section(
        P.CompileParams,
        "the compiled engine's cold compile (empty inductor cache) at each depth of a random Qwen3",
        "compile:run_compile",
        "compile:markdown_compile",
    ),
    "gpu": Section(
        P.GpuParams,
        "on CUDA: parity, shapes, the SID-GR anchor, roofline (+ disc, speculative); one report, one process",
        "gpu:run_gpu",
        None,
    ),
    "precision": Section(
        P.PrecisionParams,
        "half precision's cost in ranking: each dtype's top-K against transformers float32",
        "precision:run_precision",
        "precision:markdown",
    ),
    "minionerec": Section(
        P.MiniOneRecParams,
        "a peer run: MiniOneRec's evaluate.py (imported from --peer) vs beam_search, same model and users",
        "minionerec:run_minionerec",
        "minionerec:markdown_minionerec",
    ),
    "padding": Section(
        P.PaddingParams,
        "users ordered by prompt length against input order: users/s, target and KV tokens, padding, buckets",
        "padding:run_padding",
        "padding:markdown_padding",
    ),
    "exclude": Section(
        P.ExcludeParams,
        "per-user exclusions: beam_search with 0, 50 and 1,000 excluded items per user",
        "exclude:run_exclude",
        "exclude:markdown_exclude",
    ),
}


def run_section(name: str, params, command: str, **kw) -> tuple[dict, str]:
    """Runs benchmark `name` with its parameters (and `kw`, such as gpu's started) -> (result, Markdown): the
    parameters, the environment (with `command`) and the section's figures; `all` and `gpu` make their whole result
    (all: every section's; gpu: rewritten after every cell, and --plan's, which measures nothing)."""
    from pipeline.bench.common import report  # torch: not for reading the flags

    section = BENCHES[name]
    if section.markdown is None:
        return function(section.run)(params, command, **kw)
    return report(params, command, function(section.run), function(section.markdown), section.device, **kw)


def function(where: str):
    """'module:function' in pipeline.bench -> the function."""
    module, name = where.split(":")
    return getattr(importlib.import_module(f"pipeline.bench.{module}"), name)
