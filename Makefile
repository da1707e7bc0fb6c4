# Two commands do all setup on a fresh machine: `make demo` and `make test`. No target needs the venv activated.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
DATA    ?= data/beauty
# Where torch comes from: empty is the default index (PyPI's Linux x86-64 wheel is the CUDA build, several GB); a
# PyTorch index picks the build, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu (CPU, ~200 MB) or
# https://download.pytorch.org/whl/cu130 (CUDA 13.0): torch alone comes from there (--no-deps), its dependencies
# from the default index with the project's. The version is constraints.txt's either way.
TORCH_INDEX ?=
PIP      = $(BIN)/pip install -q -c constraints.txt

.PHONY: install browser redis postgres demo models nightly bench bench-gpu report docs lint test test-faults test-kernels test-oldest clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP) torch $(if $(TORCH_INDEX),--no-deps --index-url "$(TORCH_INDEX)")
	$(PIP) -e ".[dev,report]"
	touch $@

install: $(BIN)/.installed

# Headless Chromium (Debian's package), for the test that looks at a rendered report and `jobs.report --screenshot`.
# Optional: without one that test is skipped (CI installs it and requires it: GENREC_REQUIRE_BROWSER=1).
SUDO    ?= $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# Debian's redis-server and redis-cli, for the tests that serve runs from a real Redis (skipped where it is missing,
# but in CI: GENREC_REQUIRE_REDIS=1)
redis:
	@command -v redis-server >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

# Debian's PostgreSQL (its server binaries, /usr/lib/postgresql/VERSION/bin), for the tests whose Iceberg SQL catalog
# runs on a real PostgreSQL that they start themselves (skipped where it is missing, but in CI:
# GENREC_REQUIRE_POSTGRES=1)
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends postgresql >/dev/null; }

$(DATA)/items.parquet: $(BIN)/.installed
	$(BIN)/python -m jobs.prepare_data --out $(DATA)

# The main job on the embedded default, end to end: prepare Amazon Beauty, train the small target and draft
# (minutes on a CPU, once), run the nightly job on a local Ray, print where the tables are. Where torch sees CUDA,
# training runs on the GPU (bf16 autocast) and the nightly actor decodes on it (compute.dtype auto: bf16).
demo: models/demo-draft/config.json nightly

CUDA = $(shell $(BIN)/python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
nightly: $(DATA)/items.parquet
	$(BIN)/python -m jobs.nightly $(if $(filter 1,$(CUDA)),--set compute.gpus_per_actor=1)

# Every claim (decode, index, speculative Table 1, DISC cost and bias) -> bench-out/all.{md,json}, ~3 min on 2 CPUs.
bench: models
	$(BIN)/python -m jobs.bench all --data $(DATA)

# On a CUDA machine: infra/gpu/bench.sh (the GPU machine's one command; docs/benchmarks.md, "The GPU call") with the
# checkout's python (.venv's where there is one, else python3): the matmul rate, SID-GR's shape and Qwen2.5-0.5B's with
# both engines, engine auto, parity and the shapes grid, cell by cell within 480 s -> bench-out/gpu.{md,json}, kept as
# docs/benchmarks/gpu-<device>-<date>.md to commit; refused without CUDA (`bash infra/gpu/bench.sh --smoke` runs on a
# CPU). DISC and speculative (demo models): `... --sections anchor qwen auto parity shapes disc speculative`.
bench-gpu:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) bash infra/gpu/bench.sh --out bench-out \
		--page docs/benchmarks

# Offline evaluation and the cost/throughput report of the newest demo run (out/nightly), with a screenshot.
report: browser
	$(BIN)/python -m jobs.evaluate --run out/nightly
	$(BIN)/python -m jobs.report --run out/nightly --screenshot out/report.png

# The demo target and AtSpeed-S draft, trained on Amazon Beauty (about 12 minutes on 2 CPU cores, once).
models: models/demo-draft/config.json

models/demo-draft/config.json: $(DATA)/items.parquet
	$(BIN)/python -m jobs.train_target --data $(DATA) --out models/demo-target --preset demo
	$(BIN)/python -m jobs.train_draft --data $(DATA) --target models/demo-target --out models/demo-draft \
		--objective atspeed-s --preset demo

# The configuration reference, generated from the config's dataclasses, and the GPU sizing table, from
# decoding/memory.py's estimates (tests/test_docs.py fails when either is stale).
docs: $(BIN)/.installed
	$(BIN)/python -m pipeline.config_docs > docs/configuration.md
	$(BIN)/python -m pipeline.sizing > docs/sizing.md

# The suite runs in TEST_WORKERS processes (pytest-xdist; 0: in this one). A module's tests stay together in one
# worker, with its fixtures, servers and models, the slowest modules first; each worker's torch takes its share of
# the cores (tests/conftest.py). Three on CI's 2 cores: a third of a worker's time is spent waiting on processes it
# started (Ray's, a job's, a store's), which a third worker fills (make test: 14.2 -> 12.3 min, measured). The other
# suites run in SUITE_WORKERS: the fault-injection modules' waits are the timeouts they test, kept apart from more load,
# and the numerics-sensitive tests are CPU-bound.
# PYTEST_ARGS adds pytest flags (CI: --junitxml, which `python -m tests.budget` reads).
TEST_WORKERS  ?= 3
SUITE_WORKERS ?= 2
PYTEST_ARGS   ?=
xdist = $(if $(filter-out 0,$(1)),-n $(1) --dist loadfile --no-loadscope-reorder)
PYTEST = $(BIN)/python -m pytest -q

# ruff (pyproject.toml [tool.ruff]) lints and checks the format first: a failure there stops the suite in seconds.
# `make test` leaves out the fault-injection modules (the `faults` marker, tests/conftest.py): `make test-faults` runs
# them. CI runs both, each against its budget (python -m tests.budget).
test: $(BIN)/.installed lint
	$(PYTEST) $(call xdist,$(TEST_WORKERS)) -m "not faults" $(PYTEST_ARGS)

test-faults: $(BIN)/.installed
	$(PYTEST) $(call xdist,$(SUITE_WORKERS)) -m faults $(PYTEST_ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The numerics-sensitive tests (tests/conftest.py) under every other CPU kernel setting this machine offers, each a
# CPU that exists (tests/kernels.py: an ATEN_CPU_CAPABILITY family with its CPUs' ONEDNN_MAX_CPU_ISA; an AMX CPU
# without AMX): each rounds differently, so a bound tuned on one fails here. CI runs it.
test-kernels: $(BIN)/.installed
	@for setting in $$($(BIN)/python -m tests.kernels); do \
		echo "== numerics-sensitive tests under $$setting"; \
		env $$(echo "$$setting" | tr + ' ') $(PYTEST) $(call xdist,$(SUITE_WORKERS)) -m numerics || exit 1; \
	done

# The numerics-sensitive tests under the oldest versions pyproject.toml admits (python -m tests.oldest: transformers'
# lower end), in their own venv beside .venv, the rest as constraints.txt pins it, then the tests of what differs
# between transformers versions (tests/test_transformers_compat.py: the cache argument's name). transformers'
# FutureWarnings are errors there as in .venv (pyproject.toml). CI runs it.
OLDEST  ?= .venv-oldest
test-oldest:
	$(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q --upgrade pip
	$(PY) -m tests.oldest constraints > $(OLDEST)/constraints.txt
	$(OLDEST)/bin/pip install -q -c $(OLDEST)/constraints.txt torch $(if $(TORCH_INDEX),--no-deps --index-url "$(TORCH_INDEX)")
	$(OLDEST)/bin/pip install -q -c $(OLDEST)/constraints.txt -e ".[dev]" $$($(PY) -m tests.oldest requirements)
	$(OLDEST)/bin/python -c "import transformers; print('== numerics-sensitive tests under transformers', transformers.__version__)"
	$(subst $(BIN)/,$(OLDEST)/bin/,$(PYTEST)) $(call xdist,$(SUITE_WORKERS)) -m numerics
	$(OLDEST)/bin/python -m pytest -q tests/test_transformers_compat.py

clean:
	rm -rf $(VENV) $(OLDEST) data models bench-out .pytest_cache
