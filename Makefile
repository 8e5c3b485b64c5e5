# make demo / make test: create or reuse .venv, install what is needed, run.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.commpress-installed
PYTEST_ARGS ?=

.PHONY: demo test venv bench-smoke clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) pyproject.toml
	@# torch first, pinned, so no range ever pulls a multi-GB CUDA build
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	@# the installed torch is pinned in the same command: no extra (lightning, accelerate) may replace it
	$(VPY) -m pip install -q -e ".[test,bench,mpi,integrations]" \
		"torch==$$($(VPY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) bench/demo.py

test: $(STAMP)
	$(VPY) -m pytest tests -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
