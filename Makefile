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
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m experiments.llava_train $(ARGS)

# Byte-code for the project's own modules, which every test process and subprocess
# imports: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) no
# process writes it, and each would compile ~350 files from source again (~0.1 s per
# process). A stale file is ignored (Python checks the source's mtime and size).
test: $(STAMP)
	$(PY) -m compileall -q hetjax models experiments tests > /dev/null
	$(PY) -m ruff check hetjax models experiments tests
	$(PY) -m ruff format --check hetjax models experiments tests
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check hetjax models experiments tests
	$(PY) -m ruff format --check hetjax models experiments tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
