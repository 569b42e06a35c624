"""Observers see the same program calls in a multi-process run as in one process.

:mod:`tests.distributed._observe` trains one step (vision over all four devices, the
LLM's two pipeline stages on devices 0-1 and 2-3) in one process and, at the same time,
as 2 processes x 2 devices. Each process is told of the calls of the stages with a
device of its own, every kind of them (forward, backward, accumulator zeros, and the
step's finish: reduce and update), exactly as often as the single process is.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import launch
from tests.distributed._observe import PREFIX

TIMEOUT_S = 600  # a loaded 2-core machine
MODULE = "tests.distributed._observe"


def _results(result) -> list[dict]:
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(l.split(PREFIX, 1)[1]) for l in result.stdout.splitlines() if PREFIX in l]
    return sorted(rows, key=lambda r: r["process"])


@pytest.mark.multiprocess
def test_each_process_observes_its_stages_calls_as_one_process_does():
    launcher = ["hetjax.launch", "--processes", "2", "--devices-per-process", "2"]
    done = launch.finish(
        {
            "single": launch.start(MODULE, "--devices", "4", own_devices=True),
            "multi": launch.start(
                *launcher, "--timeout", str(TIMEOUT_S), "--", MODULE, own_devices=True
            ),
        },
        TIMEOUT_S,
    )
    (single,), multi = _results(done["single"]), _results(done["multi"])
    assert [p["process"] for p in multi] == [0, 1]
    assert single["local"] == ["llm/0", "llm/1", "vision/0"]
    assert [p["local"] for p in multi] == [["llm/0", "vision/0"], ["llm/1", "vision/0"]]
    kinds = {name.rsplit("/", 1)[1] for name in single["calls"]}
    assert kinds == {"fwd", "bwd", "zeros", "reduce", "update"}
    for p in multi:
        want = {n: c for n, c in single["calls"].items() if n.rsplit("/", 1)[0] in p["local"]}
        assert p["calls"] == want, p["process"]
        np.testing.assert_allclose(p["loss"], single["loss"], rtol=1e-5)
