# Two entry points that set themselves up on a fresh machine (Python >= 3.11 and pip only):
#   make train   - the main job: python -m experiments.llava_train (defaults)
#   make test    - the test suite
# Both create .venv and install the project into it on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Most of the suite is XLA compiling on one thread: two pytest workers (whole files each,
# so a module's shared fixture runs once) use both cores. The tests that start several JAX
# processes run among the others, filling the cores while their processes wait for each
# other (at barriers, in sleeps and timeouts): a process that reaches a first collective
# late (gloo's set-up waits 30 s) no longer fails, since its peers wait at a barrier
# until it has compiled (hetjax.distributed.rendezvous).
TEST_WORKERS ?= 2

.PHONY: train test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# --no-compile: no .pyc for every module of every dependency at install (5 s of
	# 23 here); Python writes them for the modules a process imports, on first import.
	$(PY) -m pip install --quiet --no-compile -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m experiments.llava_train $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check hetjax models experiments tests
	$(PY) -m ruff format --check hetjax models experiments tests
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check hetjax models experiments tests
	$(PY) -m ruff format --check hetjax models experiments tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
