# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# Each creates .venv when missing and reuses it afterwards.
#
# TORCH_SPEC pins torch for these CPU machines, where `torch==2.13.0` resolves to a
# local CPU wheel. On a GPU machine override it, e.g. `make test TORCH_SPEC='torch>=2.4'`.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.remat-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	echo '$(TORCH_SPEC)' > $(VENV)/constraints.txt
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m remat demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) benchmarks/solver_speed.py
	$(PY) benchmarks/peers.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
