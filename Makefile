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

.PHONY: venv train test test-fast test-lightning-oldest gpu-check clean

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
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build dist *.egg-info outputs multirun

# The Lightning integration against the oldest Lightning pyproject.toml allows (shadowing the installed one).
LIGHTNING_OLDEST ?= 2.6.0
test-lightning-oldest: $(STAMP)
	$(PIP) install -q --no-deps --target .lightning-$(LIGHTNING_OLDEST) lightning==$(LIGHTNING_OLDEST) pytorch-lightning==$(LIGHTNING_OLDEST)
	PYTHONPATH=.lightning-$(LIGHTNING_OLDEST) $(PY) -c "import lightning; assert lightning.__version__ == '$(LIGHTNING_OLDEST)', lightning.__version__"
	PYTHONPATH=.lightning-$(LIGHTNING_OLDEST) $(PY) -m pytest -q tests/lightning/test_registration.py tests/lightning/test_cli_and_environment.py tests/lightning/test_fit.py
