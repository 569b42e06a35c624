"""`without_modules`: every schedule the executor runs, with the encoders absent for a step,
is still valid, and the remaining stages keep their own order."""

import pytest

from hetjax import schedules as hs

# Two encoders into a pipelined LLM; non-colocated, the vision encoder pipelined too.
EDGES = [("vision", "llm"), ("audio", "llm")]
GRAPH = hs.ModuleGraph({"vision": 1, "audio": 1, "llm": 2}, EDGES)
PIPELINED = hs.ModuleGraph({"vision": 2, "audio": 1, "llm": 2}, EDGES)
NAMES = ["three_phase", "graph_1f1b", "gpipe", "fused_1f1b", "fused_gpipe"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("absent", [("vision",), ("vision", "audio")])
def test_schedule_without_encoders_is_valid_and_keeps_each_stage_order(name, absent):
    graph = PIPELINED if name in ("graph_1f1b", "gpipe") else GRAPH
    full = hs.schedule_for(name, 4, graph=graph)
    sched = hs.without_modules(full, absent)
    hs.check_schedule(sched)
    assert sched.modules == tuple(m for m in full.modules if m not in absent)
    assert not any(e.src_module in absent for e in sched.edges)
    for info in sched.stages:
        (old,) = (i for i in full.stages if (i.module, i.index) == (info.module, info.index))
        assert sched.compute_order(info.stage) == full.compute_order(old.stage)
        assert sched.max_live[info.stage] == full.max_live[old.stage]
        assert info.devices == old.devices

        def touches(e):
            return e is not None and (e.src_module in absent or e.dst_module in absent)

        def words(actions):
            return [(a.kind, a.microbatch, a.phase) for a in actions if not touches(a.edge)]

        assert words(sched.actions[info.stage]) == words(full.actions[old.stage])


def test_nothing_absent_is_the_schedule_itself():
    full = hs.schedule_for("three_phase", 2, graph=GRAPH)
    assert hs.without_modules(full, ()) is full


def test_bad_names_are_one_line():
    full = hs.schedule_for("graph_1f1b", 2, graph=GRAPH)
    with pytest.raises(ValueError, match=r"names \['text'\], which are not modules.*use some"):
        hs.without_modules(full, ["text"])
    with pytest.raises(ValueError, match="removes every module"):
        hs.without_modules(full, ["vision", "audio", "llm"])
