"""Give a model directory its prompt template: `python -m jobs.template --model DIR --preset lcrec --catalog
items.parquet [--max-items N]` (or `--file my_template.json`; `--chat-template FILE` copies a jinja chat template
beside the model for a template of messages).

A model directory must say how its prompts are written (`genrec_template.json` beside `config.json`); the trainers
write it, a model you bring gets it here. The template is checked against the model's tokenizer and the catalog
first (every code token present, the code tokens kept apart from the text), then written.
"""

from __future__ import annotations

import argparse
import json
import sys

from decoding.templates import PRESETS
from jobs.cli import positive, prog


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("jobs.template"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="local model directory (config.json, weights, tokenizer)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS) + [f"openonerec:{s}:{u}" for s in range(5) for u in range(5)],
        metavar="PRESET",
        help=f"a preset template: {', '.join(sorted(PRESETS))}; openonerec:S:U picks their S-th system and U-th user "
        "prompt (from 0)",
    )
    source.add_argument("--file", help="a template JSON file of your own")
    p.add_argument("--catalog", required=True, help="items.parquet the model recommends from (checked)")
    p.add_argument("--max-items", type=positive, help="history items per prompt (default: the template's)")
    p.add_argument(
        "--chat-template",
        help="a jinja chat template copied into the model directory for the template's messages (openonerec: their "
        "benchmarks/benchmark/tasks/v1_0/qwen3_soft_switch.jinja2)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    from pipeline.models import attach_template

    args = parse_args(argv)
    try:
        summary = attach_template(
            args.model, args.preset or args.file, args.catalog, args.max_items, args.chat_template
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
