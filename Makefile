# Two entry points that set themselves up on a fresh machine (Python >= 3.11 and pip only):
#   make train   - the main job: python -m experiments.llava_train (defaults)
#   make test    - the test suite
# Both create .venv and install the project into it on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

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
	$(PY) -m pytest tests $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check hetjax models experiments tests
	$(PY) -m ruff format --check hetjax models experiments tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
