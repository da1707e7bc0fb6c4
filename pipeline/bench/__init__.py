"""The benchmarks behind `python -m jobs.bench`: one section per module, plain-dataclass parameters (params.py).

sections.py     every section: its parameters, its measurement (params -> its own figures) and its Markdown;
                run_section adds what every result carries (the parameters, the environment)
common.py       the interleaved timing harness (median, min, max per method; ratios and verdicts from medians),
                peak memory, hardware / versions / environment, a section's report, fresh worker processes, result
                writing
inputs.py       Amazon Beauty prompts, the benchmarked models, batching
decode.py       transformers beam search vs beam_search, and the catalog index (CSR, PPV, CPU trie)
speculative.py  AtSpeed speculative beam search vs beam_search (the paper's Table 1 layout)
disc.py         DISC timing against constrained sampling and beam search; DISC's bias against the exact P_S
nightly.py      the nightly Ray job vs direct calls of the recommender
all.py          every claim in one process, one report
gpu.py          the engine's checks and benchmarks on one CUDA device, cells under a time budget (budget.py); the
                shapes it runs in gpu_shapes.py, their expected seconds before a GPU is lent in gpu_plan.py
"""
