# make demo / make test: create or reuse .venv, install what is needed, run.
# On a machine with an NVIDIA GPU (nvidia-smi lists one) `make test` also installs the CuPy
# extra matching torch's CUDA major version (cuda12 / cuda13) and requires it: the GPU tests
# fail instead of skipping when CuPy is missing there. CPU machines get no CuPy.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.commpress-installed
PYTEST_ARGS ?=
EXTRAS := test,bench,mpi,integrations
# "1" when an NVIDIA GPU is visible; CUDA_EXTRA=cuda12|cuda13 overrides the detected extra
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
CUDA_EXTRA ?=

.PHONY: demo test venv bench-smoke clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) pyproject.toml
	@# torch first, pinned, so no range ever pulls a multi-GB CUDA build
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	@# the installed torch is pinned in the same command: no extra (lightning, accelerate) may replace it;
	@# on a GPU machine the CuPy extra for torch's CUDA major version joins the extras
	extras="$(EXTRAS)"; cuda="$(CUDA_EXTRA)"; \
	if [ -z "$$cuda" ] && [ "$(HAS_GPU)" = 1 ]; then \
		major=$$($(VPY) -c 'import torch; print((torch.version.cuda or "").split(".")[0])'); \
		case "$$major" in 12) cuda=cuda12;; 13) cuda=cuda13;; \
			*) echo "make: a GPU is visible but torch has no CUDA 12/13 build ($$major): no CuPy extra" >&2;; esac; \
	fi; \
	if [ -n "$$cuda" ]; then extras="$$extras,$$cuda"; fi; \
	echo "make: installing extras [$$extras]"; \
	$(VPY) -m pip install -q -e ".[$$extras]" \
		"torch==$$($(VPY) -c 'import torch; print(torch.__version__.split("+")[0])')"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) bench/demo.py

test: $(STAMP)
	$(if $(HAS_GPU),COMMPRESS_REQUIRE_CUPY=1 )$(VPY) -m pytest tests -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
