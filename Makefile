# The two commands a newcomer runs (see README.md):
#   make demo   set up .venv and run the main job
#   make test   set up .venv and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0

.PHONY: demo example test test-all imports docs setup lint typecheck bench-store bench-deepspeed gpu-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned: the 2.13.0 file on these machines is the CPU build; a
# looser pin would pull gigabytes of CUDA packages. DeepSpeed builds no ops
# (DS_BUILD_OPS=0) and runs on the CPU accelerator in the tests.
$(VENV)/.setup-done: pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH)
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[test,demo,bench,deepspeed,docs,accelerate,hf,lightning,peft,loaders,torchft,ray]"
	$(PIP) install -q libkvikio-cu12 && $(PIP) install -q --no-deps kvikio-cu12
	# torchtitan 0.3 pins datasets<4.8 (the loaders extra has 5.2, which its text loader runs with): no-deps plus what it imports
	$(PIP) install -q --no-deps "torchtitan>=0.3,<0.4" && $(PIP) install -q tyro spmd_types==0.2.3 tokenizers safetensors
	touch $@

setup: $(VENV)/.setup-done

demo: setup
	$(PY) examples/demo/run.py $(ARGS)

example: setup
	$(PY) examples/store_roundtrip.py

test: setup
	$(PY) -m pytest -q -m "not exhaustive" --durations=60
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(MAKE) --no-print-directory imports docs

# every parametrization, the exhaustive ones too (slower than CI's budget allows)
test-all: setup
	$(PY) -m pytest -q

# the layers contract (pyproject.toml [tool.importlinter]) and no import cycle, hidden ones included
imports: setup
	$(VENV)/bin/lint-imports
	$(PY) tools/import_cycles.py

# the docs site, strictly (every page, link and reference resolves), and every snippet runs
docs: setup
	$(VENV)/bin/mkdocs build --strict --quiet
	$(PY) examples/check_snippets.py
	$(PY) tools/check_refs.py
	$(PY) tools/support_matrix.py --check

lint: setup
	$(PY) -m ruff check .

typecheck: setup
	$(PY) -m mypy

gpu-test: setup
	$(PY) -m pytest -q -m gpu

bench-store: setup
	$(PY) benches/store_throughput.py

bench-deepspeed: setup
	$(PY) benches/deepspeed_overhead.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
