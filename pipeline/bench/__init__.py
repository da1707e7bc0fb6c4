"""The benchmarks behind `python -m jobs.bench`: one section per module, plain-dataclass parameters (params.py).

common.py       the interleaved timing harness (median, min, max per method; ratios and verdicts from medians),
                peak memory, hardware / versions / environment, result writing
inputs.py       Amazon Beauty prompts, the benchmarked models, batching
decode.py       transformers beam search vs beam_search, and the catalog index (CSR, PPV, CPU trie)
speculative.py  AtSpeed speculative beam search vs beam_search (the paper's Table 1 layout)
disc.py         DISC timing against constrained sampling and beam search; DISC's bias against the exact P_S
nightly.py      the nightly Ray job vs direct calls of the recommender
all.py          every claim in one process, one report
"""
