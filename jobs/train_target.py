"""Train the target generative recommender: `python -m jobs.train_target --data DIR --out DIR [--preset demo]`.

Input = the last `history_len` items of a history as semantic-ID tokens, output = the next item's L code tokens;
the loss is on the item tokens only; every prefix of every training history is a sample. Either a Llama from
scratch (--layers/--hidden/--heads/--kv-heads) or a local HF causal LM whose vocabulary gets the code tokens
added (--base-model DIR, the LC-Rec recipe). Each epoch: Recall/NDCG@{5,10,20} on the validation split with
`beam_search`; the best checkpoint is kept (safetensors + config + tokenizer + training.json); early stopping.
"""

from __future__ import annotations

import argparse
import sys

from jobs.cli import prog, train_main, training_config
from pipeline.training.target import PRESETS, TargetConfig, train_target


def parse_args(argv=None) -> TargetConfig:
    p = argparse.ArgumentParser(
        prog=prog("jobs.train_target"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", required=True, help="a prepare_data folder (items, train, valid, tokenizer/)")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--preset", choices=sorted(PRESETS), help="size and schedule defaults; flags override")
    p.add_argument("--base-model", help="local HF causal LM to extend with the code tokens (LC-Rec recipe)")
    return training_config(p, argv, TargetConfig, PRESETS, skip=("data", "out", "base_model"))


def main(argv=None) -> int:
    return train_main(parse_args(argv), train_target, summary)


def summary(cfg: TargetConfig, report: dict) -> str:
    best = next((e for e in report["epochs"] if e["epoch"] == report.get("best_epoch")), None)
    return f"best epoch {report.get('best_epoch')}: {best['valid'] if best else {}} -> {cfg.out}"


if __name__ == "__main__":
    sys.exit(main())
