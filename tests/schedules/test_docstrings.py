"""The examples in the package's docstrings run and print what they claim."""

import doctest
import importlib
import pkgutil

import pytest

import hetjax.schedules as package

MODULES = ["hetjax.schedules"] + [
    f"hetjax.schedules.{info.name}" for info in pkgutil.iter_modules(package.__path__)
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
