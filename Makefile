# Every target sets itself up: a virtualenv in .venv with headrace installed editable.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; on a GPU machine set TORCH to the build for your CUDA.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
# headrace and torch only (what the demo needs); then the extras the tests and benchmarks use;
# the docs extra for the documentation site.
CORE := $(VENV)/.headrace-core
FULL := $(VENV)/.headrace-full
DOCS := $(VENV)/.headrace-docs

.PHONY: demo test docs bench-cpu clean

$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip "setuptools>=77" wheel
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e .
	touch $@

$(FULL): $(CORE)
	$(BIN)/python -m pip install -q -e ".[test,bench,nvimgcodec,lmdb]"
	touch $@

$(DOCS): $(CORE)
	$(BIN)/python -m pip install -q -e ".[docs]"
	touch $@

demo: $(CORE)  ## make a small JPEG data set (in .data/demo), then run training-style epochs with a progress bar
	$(BIN)/headrace demo

test: $(FULL)  ## the whole CPU test suite (GPU tests skip themselves without CUDA)
	$(BIN)/pytest -q

# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2 is not about this site; it would bury the build's own output.
docs: $(DOCS)  ## the documentation site (MkDocs Material + mkdocstrings), built --strict into site/
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench-cpu: $(FULL)  ## headrace vs torch DataLoader + Pillow on this machine's cores
	$(BIN)/python examples/benchmark_cpu.py

clean:
	rm -rf $(VENV) .data build site *.egg-info
