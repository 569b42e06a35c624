"""Own-stage compiles: in a 2-process non-colocated run each process compiles and runs only
the stages with a device of its own (the others' outputs are stand-ins), and the losses
are the single-process run's.

Each case runs :func:`experiments.compile_counts.measure`: the same layout of the
``tiny`` preset in one process of 8 devices and as 2 processes x 4, at the same time.
"""

from __future__ import annotations

import pytest

from experiments import compile_counts
from tests.distributed.own_compiles import check_each_process_compiles_only_its_own_stages

TIMEOUT_S = 600  # per run: a loaded 2-core machine
# The layout experiments.bench_engine measures for its 2-process row (vision dp=4 on
# process 0, the LLM's two pipeline stages on process 1) is checked on that row
# (tests/runtime/test_bench_engine.py): the same measurement, run once in the suite.
CASES = {
    # The LLM context parallel: image tokens cross split over cp, then the LLM's island
    # exchanges them (a routing program of the LLM's devices, not compiled on process 0).
    "cp-routed": ["--layout=vision:dp=4", "--layout=llm:cp=2,tp=2", "--microbatches=2"],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_each_process_compiles_only_its_own_stages(case):
    runs = compile_counts.measure(CASES[case], devices=8, timeout_s=TIMEOUT_S)
    check_each_process_compiles_only_its_own_stages(runs)
