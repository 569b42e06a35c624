# Two entry points that set themselves up on a fresh machine (Python >= 3.11 and pip only):
#   make train   - the main job: python -m experiments.llava_train (defaults)
#   make test    - the test suite
# Both create .venv and install the project into it on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Most of the suite is XLA compiling on one thread: two pytest workers (whole files each,
# so a module's shared fixture runs once) use both cores. Tests that start several JAX
# processes run afterwards on their own: their CPU collectives (gloo) give up when a
# process arrives ~30 s late, which a starved core can cause.
TEST_WORKERS ?= 2

.PHONY: train test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m experiments.llava_train $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check hetjax models experiments tests
	$(PY) -m ruff format --check hetjax models experiments tests
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not multiprocess" tests $(ARGS)
	$(PY) -m pytest -m multiprocess tests $(ARGS) || [ $$? -eq 5 ]  # 5: ARGS selected none

lint: $(STAMP)
	$(PY) -m ruff check hetjax models experiments tests
	$(PY) -m ruff format --check hetjax models experiments tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
