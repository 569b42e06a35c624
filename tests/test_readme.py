"""The README's code example for wrapping Flax modules runs as written."""

import re

import numpy as np

from tests.launch import ROOT

README = ROOT / "README.md"


def test_wrapping_example_runs():
    text = README.read_text(encoding="utf-8")
    section = text.split("## Wrapping your own Flax modules", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own README
    metrics = scope["metrics"]
    assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) > 0
    assert "grad_norm/llm" in metrics
