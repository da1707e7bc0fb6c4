# Two commands do all setup on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
TORCH   ?= torch==2.13.0
DATA    ?= data/beauty

.PHONY: install browser demo models nightly bench bench-gpu report docs lint test test-kernels clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,report]"
	touch $@

install: $(BIN)/.installed

# Headless Chromium (Debian's package), for the test that looks at a rendered report and `jobs.report --screenshot`.
SUDO    ?= $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

$(DATA)/items.parquet: $(BIN)/.installed
	$(BIN)/python -m jobs.prepare_data --out $(DATA)

# The main job on the embedded default, end to end: prepare Amazon Beauty, train the small target and draft
# (minutes on a CPU, once), run the nightly job on a local Ray, print where the tables are. Where torch sees CUDA,
# training runs on the GPU (bf16 autocast) and the nightly actor decodes on it (compute.dtype auto: bf16).
demo: models/demo-draft/config.json nightly

CUDA = $(shell $(BIN)/python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
nightly: $(DATA)/items.parquet
	$(BIN)/python -m jobs.nightly --config infra/configs/demo.yaml $(if $(filter 1,$(CUDA)),--set compute.gpus_per_actor=1)

# Every claim (decode, index, speculative Table 1, DISC cost and bias) -> bench-out/all.{md,json}, ~3 min on 2 CPUs.
bench: models
	$(BIN)/python -m jobs.bench all --data $(DATA)

# On a CUDA machine, in one process and one report (bench-out/gpu.{md,json}), kept as a dated page to commit
# (docs/benchmarks/gpu-<device>-<date>.md), about 10 minutes on an H100: the matmul rate, float32 / half-precision
# parity, the shapes grid and NVIDIA SID-GR's shape with the eager and compiled engines side by side, each cell's
# useful-FLOP fraction and compile seconds, the nightly's actor with compute.engine auto and its choice; refused
# (exit 2) without CUDA. DISC and speculative (demo models): add
# `--sections ... disc speculative`.
bench-gpu: $(DATA)/items.parquet
	$(BIN)/python -m jobs.bench gpu --data $(DATA) --engines eager compiled --sections parity shapes anchor auto \
		--page docs/benchmarks

# Offline evaluation and the cost/throughput report of the newest demo run (out/nightly), with a screenshot.
report: browser
	$(BIN)/python -m jobs.evaluate --run out/nightly
	$(BIN)/python -m jobs.report --run out/nightly --screenshot out/report.png

# The demo target and AtSpeed-S draft, trained on Amazon Beauty (about 15 minutes on 2 CPU cores).
models: models/demo-draft/config.json

models/demo-draft/config.json: $(DATA)/items.parquet
	$(BIN)/python -m jobs.train_target --data $(DATA) --out models/demo-target --preset demo
	$(BIN)/python -m jobs.train_draft --data $(DATA) --target models/demo-target --out models/demo-draft \
		--objective atspeed-s --preset demo

# The configuration reference, generated from the config's dataclasses (tests/test_docs.py fails when it is stale).
docs: $(BIN)/.installed
	$(BIN)/python -m pipeline.config_docs > docs/configuration.md

# ruff (pyproject.toml [tool.ruff]) lints and checks the format first: a failure there stops the suite in seconds.
test: $(BIN)/.installed browser lint
	$(BIN)/python -m pytest -q

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The numerics-sensitive tests (tests/conftest.py) under every other CPU kernel setting this machine offers
# (ATEN_CPU_CAPABILITY: default, avx2, avx512; ONEDNN_MAX_CPU_ISA=AVX2 where the CPU has AVX-512 or AMX): each
# rounds differently, so a bound tuned on one fails here. CI runs it.
test-kernels: $(BIN)/.installed
	@for setting in $$($(BIN)/python -m tests.kernels); do \
		echo "== numerics-sensitive tests under $$setting"; \
		env $$setting $(BIN)/python -m pytest -q -m numerics || exit 1; \
	done

clean:
	rm -rf $(VENV) data models bench-out .pytest_cache
