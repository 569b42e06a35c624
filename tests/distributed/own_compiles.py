"""What a 2-process non-colocated run of :func:`experiments.compile_counts.measure` must
show (``tests/distributed/test_own_compiles.py`` runs the measurement for its layouts;
``tests/runtime/test_bench_engine.py`` checks the one ``experiments.bench_engine`` ran
for its 2-process row): each process compiles and runs only the stages with a device of
its own, and the losses are the single-process run's."""

from __future__ import annotations

import re

import numpy as np


def stage_of(name: str) -> str | None:
    """``jit(llm_s1_bwd)`` -> ``llm/1``; None for other programs."""
    m = re.fullmatch(r"jit\((\w+)_s(\d+)_\w+\)", name)
    return m and f"{m.group(1)}/{m.group(2)}"


def check_each_process_compiles_only_its_own_stages(runs: dict) -> None:
    """``runs``: ``{"single": record, "multi": [record per process]}``, the vision encoder
    on process 0's island and the LLM on process 1's."""
    single, multi = runs["single"], runs["multi"]
    assert [p["process"] for p in multi] == [0, 1]
    # Vision's island is process 0's, the LLM's process 1's: the stages split between them.
    assert multi[0]["local_stages"] == ["vision/0"]
    assert {s.split("/")[0] for s in multi[1]["local_stages"]} == {"llm"}
    assert sorted(multi[0]["local_stages"] + multi[1]["local_stages"]) == single["local_stages"]
    for p in multi:
        mine = {stage_of(n) for n in p["names"]} - {None}
        assert mine == set(p["local_stages"]), (p["process"], p["names"])
        assert p["stage_programs"] < single["stage_programs"], (p, single["stage_programs"])
        np.testing.assert_allclose(p["losses"], single["losses"], rtol=1e-5)
    # The first calls of the programs spanning both processes (the transfers between the
    # islands, the finish's all-gathers) met both at a barrier, each as often.
    assert single["meetings"] == 0
    assert multi[0]["meetings"] == multi[1]["meetings"] > 0, multi
    # Every stage program is compiled exactly once, by the process that owns the stage.
    assert sum(p["stage_programs"] for p in multi) == single["stage_programs"]
    assert len(set(single["losses"])) == len(single["losses"])  # it does train
