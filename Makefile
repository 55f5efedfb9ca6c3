# The two commands: `make test` and `make train`. Both set up .venv first.
VENV          ?= .venv
PYTHON        ?= python3
TORCH_VERSION ?= 2.13.0
PY            := $(VENV)/bin/python
PIP           := $(PY) -m pip --disable-pip-version-check

.PHONY: setup test train clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned, so that `torch>=2.4` in our dependencies never pulls another build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test,hf]'
	@$(MAKE) --no-print-directory libaio
	touch $@

# The system library behind the `libaio` package. Without it the storage engine
# uses its thread-pool backend (same API, same results).
.PHONY: libaio
libaio:
	@if ldconfig -p 2>/dev/null | grep -q 'libaio\.so\.1'; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing libaio1 (system library for async direct I/O)"; \
	  (apt-get install -y -qq libaio1 || (apt-get update -qq && (apt-get install -y -qq libaio1 || apt-get install -y -qq libaio1t64))) >/dev/null \
	  || echo "could not install libaio1: the storage engine will use its threads backend"; \
	else \
	  echo "libaio1 is missing: 'sudo apt-get install libaio1' for the libaio backend; using the threads backend"; \
	fi

# The suite twice: as it is here, then with device memory kept apart from host memory, so the GPU
# path's placement, copies and gradient routes run on a machine without a GPU (tests/gpu/ needs one).
test: setup
	$(PY) -m pytest -q tests
	INFINITY_DISTINCT_DEVICE=1 $(PY) -m pytest -q tests

train: setup
	$(VENV)/bin/infinity train

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
