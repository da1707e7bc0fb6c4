"""all: decode, speculative, disc and disc-bias in one process, on one target (and its drafts), called directly with
their parameters; one Markdown report and one JSON with the hardware, versions, seeds, the command, every timed
repeat, and a verdict per claim decided from medians ('within noise' where the ranges overlap)."""

from __future__ import annotations

import time
from dataclasses import asdict
from datetime import UTC, datetime

from decoding.models import pick_device
from pipeline.bench import decode, disc, speculative
from pipeline.bench.common import hardware, progress, report, versions
from pipeline.bench.inputs import require_models
from pipeline.bench.params import AllParams, DecodeParams, DiscBiasParams, DiscParams, SpeculativeParams
from pipeline.markdown import table

SEED_USES = (
    "torch.manual_seed at the start of every section; every sampling torch.Generator (relaxed speculative, "
    "DISC, constrained sampling, the exact sampler) re-seeded with it before every call (every warm-up and "
    "timed repeat of every method); the random model when none is given; the synthetic index catalogs"
)

RUN = {  # each section's measurement and Markdown (sections.py's)
    "decode": (decode.run_decode, decode.markdown_decode),
    "speculative": (speculative.run_speculative, speculative.markdown_speculative),
    "disc": (disc.run_disc, disc.markdown_disc),
    "disc-bias": (disc.run_disc_bias, disc.markdown_disc_bias),
}
VERDICTS = {
    "decode": decode.verdict_decode,
    "speculative": speculative.verdict_speculative,
    "disc": disc.verdict_disc,
    "disc-bias": disc.verdict_disc_bias,
}


def section_params(p: AllParams) -> dict:
    """The `all` parameters -> each selected section's own; a field not named keeps that section's default."""
    common = dict(data=p.data, history_len=p.history_len, dtype=p.dtype, device=p.device, seed=p.seed)
    timed = dict(common, repeats=p.repeats)
    params = {
        "decode": DecodeParams(
            **timed, model=p.target, users=p.users, batch=p.batch, k=p.k, index_items=list(p.index_items)
        ),
        "speculative": SpeculativeParams(
            **timed,
            target=p.target,
            drafts=list(p.drafts),
            ks=list(p.ks),
            users=p.batch1_users,
            batch=p.batch,
            throughput_users=p.users,
            temperature=p.temperature,
        ),
        "disc": DiscParams(
            **timed,
            model=p.target,
            users=p.users,
            batch=p.batch,
            k=p.disc_k,
            max_rounds=max(p.rounds),
            temperature=p.temperature,
        ),
        "disc-bias": DiscBiasParams(
            **common,
            model=p.target,
            users=p.bias_users,
            draws=p.draws,
            rounds=list(p.rounds),
            temperature=p.temperature,
            chunk=p.chunk,
        ),
    }
    return {name: params[name] for name in p.sections}


def bench_all(p: AllParams, command: str) -> tuple[dict, str]:
    """Every selected section in this process, in order -> (all.json content, all.md). Fails before any work when
    a model is missing."""
    require_models(p.target, p.drafts if "speculative" in p.sections else None)
    started, t0 = datetime.now(UTC).isoformat(timespec="seconds"), time.perf_counter()
    result = {
        "command": command,
        "started": started,
        "hardware": hardware(pick_device(p.device), p.dtype),
        "versions": versions(),
        "seeds": {"seed": p.seed, "where": SEED_USES},
        "repeats": p.repeats,
        "args": asdict(p),
        "sections": {},
    }
    md = {}
    bar = progress(section_params(p).items(), "bench all: sections", total=len(p.sections), leave=True)
    for name, params in bar:
        bar.set_postfix_str(name)
        t_section = time.perf_counter()
        section, md[name] = report(params, command, *RUN[name])
        section.update(seconds=time.perf_counter() - t_section, verdict=VERDICTS[name](section))
        result["sections"][name] = section
    result["seconds"] = time.perf_counter() - t0
    return result, markdown_all(result, md)


def markdown_all(result: dict, sections_md: dict[str, str]) -> str:
    lines = [
        "# genrec-batch: the project's claims on Amazon Beauty",
        "",
        f"`{result['command']}`: {result['seconds'] / 60:.1f} min, started {result['started']}",
        "",
        table(["", ""], setup_rows(result), "left"),
        "",
        "## verdicts",
        "",
    ]
    lines += [f"- **{name}** ({s['seconds']:.0f} s): {s['verdict']}" for name, s in result["sections"].items()]
    for name, s in result["sections"].items():
        heading, rest = sections_md[name].split("\n", 1)
        lines += ["", heading, "", f"**verdict**: {s['verdict']}", rest]
    return "\n".join(lines)


def setup_rows(result: dict) -> list[list[str]]:
    """What the run ran on and how: hardware, device, versions, commit, seeds, the timing protocol, the models."""
    h, v, a = result["hardware"], result["versions"], result["args"]
    gpu = f"{h['gpu']} ({h['gpu_memory_gib']} GiB) x {h['gpus']}, CUDA {h['cuda']}" if "gpu" in h else "none"
    return [
        [
            "hardware",
            f"{h['cpu']}, {h['cpu_cores']} cores ({h['cpu_cores_usable']} usable), {h['ram_gib']} GiB RAM; GPU: {gpu}",
        ],
        ["run on", f"{h['device']}, dtype {a['dtype']} ({h['dtype']}), {h['torch_threads']} torch threads"],
        [
            "versions",
            f"python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, ray {v['ray']}, "
            f"pyarrow {v['pyarrow']}, numpy {v['numpy']}, tqdm {v['tqdm']}",
        ],
        ["genrec-batch", f"{v['genrec-batch']}, commit {v['git_commit']}"],
        ["seeds", f"{result['seeds']['seed']}: {result['seeds']['where']}"],
        [
            "timing",
            f"{result['repeats']} interleaved repeats per method after a warm-up run of each (the order rotated "
            "every repeat); medians with (min-max); ratios of medians with the range from the extremes; 'within "
            "noise' where two methods' ranges overlap; every repeat's seconds in all.json",
        ],
        ["models", f"target {a['target']}; drafts {', '.join(a['drafts'])}"],
    ]
