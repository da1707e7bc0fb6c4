"""Train a draft model aligned with a target: `python -m jobs.train_draft --data DIR --target DIR --out DIR
--objective {sft,wordkd,seqkd,tvdkd,atspeed-s,atspeed-r} [--preset demo]`.

The draft shares the target's tokenizer. Objectives (formulas in `decoding/alignment.py`):
  sft        recommendation loss on the ground-truth item only
  wordkd     + token-level KL(target || draft) along the ground-truth item           (mixed by alpha)
  tvdkd      + token-level TVD along the ground-truth item                             (mixed by alpha)
  seqkd      + recommendation loss on the target's top-K sequences                     (mixed by alpha)
  atspeed-s  + reverse KL over the constrained top-K tokens + density regularisation,
               along the target's top-K sequences                                      (mixed by alpha)
  atspeed-r  + TVD over the constrained top-K tokens, along the target's top-K sequences (mixed by alpha)
Teacher data (the target's top-K sequences and its logits along them) is cached next to the target.
Each epoch the draft is scored by what strict verification needs: the fraction of validation users whose target
top-K beams at step t are all among the draft's top-N beams (t = 1..L); the best checkpoint is kept.
"""

from __future__ import annotations

import argparse
import sys

from decoding.alignment import OBJECTIVES
from jobs.cli import prog, train_main, training_config
from pipeline.training.draft import PRESETS, DraftConfig, train_draft


def parse_args(argv=None) -> DraftConfig:
    p = argparse.ArgumentParser(
        prog=prog("jobs.train_draft"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", required=True, help="a prepare_data folder")
    p.add_argument("--target", required=True, help="the trained target model directory")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--objective", required=True, choices=OBJECTIVES)
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--init", help="start from this local draft model instead of a fresh one")
    p.add_argument("--teacher-cache", help="teacher data folder (default: <target>/teacher)")
    return training_config(
        p, argv, DraftConfig, PRESETS, skip=("data", "target", "out", "objective", "init", "teacher_cache")
    )


def main(argv=None) -> int:
    return train_main(parse_args(argv), train_draft, summary)


def summary(cfg: DraftConfig, report: dict) -> str:
    best, coverage = report.get("best_epoch"), report["test_coverage"]
    return f"draft {cfg.objective}: best epoch {best}, test coverage {coverage} -> {cfg.out}"


if __name__ == "__main__":
    sys.exit(main())
