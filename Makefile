# Two commands do all the set-up on a fresh clone:  `make train`  and  `make test`.
# They create .venv once (idempotent: a stamp file records the installed pyproject) and reuse it.
# On a machine without an NVIDIA driver the CPU build of torch is installed first, so pip never pulls a
# multi-GB CUDA build; set TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) where the default
# index would serve a CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.fp8-lightning-installed
TORCH_VERSION ?= 2.13.0
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: venv train test docs test-fast test-lightning-oldest gpu-check gpu-wheels gpu-dry-run aot-compile clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(HAS_CUDA),1)
	$(PIP) install -q "torch>=2.11,<2.15"
else
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
endif
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m fp8_lightning.train $(ARGS)

# Two pytest workers (one per core); a file's tests stay on one worker so module fixtures are built once.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

gpu-check: $(STAMP)
	$(PY) -m benchmarks gpu-check

# What the lent GPU machines (Python 3.12, torch 2.11, Triton 3.6, Lightning 2.6.6, no network) lack, as wheels for
# benchmarks/gpu_session.sh to install offline: torchao for the peer rows. None of the session's steps imports
# hydra or omegaconf. wheels/ is git-ignored; the whole working tree travels to the GPU machine (64 MiB at most).
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS ?= torchao==0.18.0
GPU_PLATFORMS := $(foreach n,2_28 2_27 2_24 2_17,--platform manylinux_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--implementation cp $(GPU_PLATFORMS) -d wheels $(GPU_WHEELS)
	@size=$$(du -sm wheels | cut -f1); echo "wheels/: $$size MiB"; test $$size -lt 48 || \
		{ echo "wheels/ is $$size MiB: the working tree sent to the GPU machine must stay under 64 MiB"; exit 1; }

# The session script's CPU dry run: the steps of each call, and the wheels installed offline into a fresh target.
gpu-dry-run: $(STAMP)
	PYTHON=$(PY) bash benchmarks/gpu_session.sh dry-run

# Every kernel configuration compiled for sm_90a and sm_100a, registers and spills tabulated (about 20 minutes).
aot-compile: $(STAMP)
	$(PY) -m benchmarks aot --jobs 2 --out benchmarks/results/aot-compile-$$(date +%Y%m%d).md

clean:
	rm -rf $(VENV) build dist *.egg-info outputs multirun site

# The Lightning integration against the oldest Lightning pyproject.toml allows (shadowing the installed one).
LIGHTNING_OLDEST ?= 2.6.0
test-lightning-oldest: $(STAMP)
	$(PIP) install -q --no-deps --target .lightning-$(LIGHTNING_OLDEST) lightning==$(LIGHTNING_OLDEST) pytorch-lightning==$(LIGHTNING_OLDEST)
	PYTHONPATH=.lightning-$(LIGHTNING_OLDEST) $(PY) -c "import lightning; assert lightning.__version__ == '$(LIGHTNING_OLDEST)', lightning.__version__"
	PYTHONPATH=.lightning-$(LIGHTNING_OLDEST) $(PY) -m pytest -q tests/lightning/test_registration.py tests/lightning/test_cli_and_environment.py tests/lightning/test_fit.py tests/distributed/test_strategy_options.py

# The documentation site, strict (a broken link or reference fails), into site/.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --quiet
