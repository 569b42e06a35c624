"""ModuleGraph validation and flattening; Action/Edge invariants."""

import pytest

from hetjax.schedules import Action, Edge, ModuleGraph
from hetjax.schedules.actions import transfer

JOIN = ModuleGraph({"vision": 2, "audio": 1, "llm": 2}, [("vision", "llm"), ("audio", "llm")])


@pytest.mark.parametrize(
    ("modules", "edges", "match"),
    [
        ({}, [], "empty"),
        ({"llm": 0}, [], "pp=0"),
        ({"llm": True}, [], "pp=True"),
        ({"vision": 1, "llm": 2}, [("vision", "lm")], "unknown module 'lm'"),
        ({"vision": 1, "llm": 2}, [("vision", "llm"), ("vision", "llm")], "listed twice"),
        ({"vision": 1, "audio": 1, "llm": 2}, [("vision", "llm")], "'audio' has no edges"),
        ({"a": 1, "b": 1}, [("a", "b"), ("b", "a")], "no sink"),
        ({"a": 1, "b": 1, "llm": 1}, [("a", "b"), ("b", "a"), ("b", "llm")], "cycle"),
    ],
)
def test_invalid_graphs_raise_one_clear_line(modules, edges, match):
    with pytest.raises(ValueError, match=match) as info:
        ModuleGraph(modules, edges)
    assert "\n" not in str(info.value)


def test_join_depths_and_total():
    assert JOIN.total_stages() == 4  # max(2, 1) + 2
    assert JOIN.topological_order() == ("vision", "audio", "llm")
    assert [JOIN.depth(m) for m in ("vision", "audio", "llm")] == [0, 0, 2]
    assert [JOIN.height(m) for m in ("vision", "audio", "llm")] == [4, 3, 2]
    assert JOIN.stage_depths(align="source") == (0, 1, 0, 2, 3)
    assert JOIN.stage_depths(align="sink") == (0, 1, 1, 2, 3)
    with pytest.raises(ValueError, match="align"):
        JOIN.stage_depths(align="middle")


def test_flatten_join():
    stages, edges = JOIN.flatten()
    assert [(s.stage, s.module, s.index, s.pp) for s in stages] == [
        (0, "vision", 0, 2),
        (1, "vision", 1, 2),
        (2, "audio", 0, 1),
        (3, "llm", 0, 2),
        (4, "llm", 1, 2),
    ]
    assert edges == (
        Edge("vision", 0, "vision", 1),
        Edge("vision", 1, "llm", 3),
        Edge("audio", 2, "llm", 3),
        Edge("llm", 3, "llm", 4),
    )
    assert [e.is_boundary for e in edges] == [False, True, True, False]


def test_chain_and_branch():
    chain = ModuleGraph.chain(("vision", 1), ("llm", 2))
    assert chain.edges == (("vision", "llm"),)
    assert chain.total_stages() == 3
    branch = ModuleGraph({"vision": 1, "llm": 2, "aux": 1}, [("vision", "llm"), ("vision", "aux")])
    assert branch.sinks == ("llm", "aux")
    assert branch.successors("vision") == ("llm", "aux")
    assert branch.total_stages() == 3
    assert ModuleGraph({"llm": 3}).total_stages() == 3


def test_graph_equality_and_hash():
    again = ModuleGraph({"vision": 2, "audio": 1, "llm": 2}, [("vision", "llm"), ("audio", "llm")])
    assert again == JOIN and hash(again) == hash(JOIN)
    with pytest.raises(TypeError):
        JOIN.modules["llm"] = 4  # read-only view


def test_action_peer_and_placement():
    e = Edge("llm", 0, "llm", 1)
    assert transfer("SEND_F", e, 2) == Action("SEND_F", 0, 2, "llm", e)
    assert transfer("RECV_F", e, 2).peer == 0
    assert transfer("SEND_B", e, 2).stage == 1
    assert transfer("RECV_B", e, 2).peer == 1
    assert Action("F", 0, 0).peer is None
    assert transfer("RECV_B", e, 2).transfer_key() == transfer("SEND_B", e, 2).transfer_key()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "W", "stage": 0, "microbatch": 0}, "unknown action kind"),
        ({"kind": "SEND_F", "stage": 0, "microbatch": 0}, "needs the edge"),
        ({"kind": "F", "stage": 0, "microbatch": 0, "edge": Edge("a", 0, "a", 1)}, "must not"),
        ({"kind": "SEND_F", "stage": 1, "microbatch": 0, "edge": Edge("a", 0, "a", 1)}, "runs on"),
        ({"kind": "F", "stage": 0, "microbatch": -1}, ">= 0"),
    ],
)
def test_bad_actions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Action(**kwargs)


def test_edge_to_itself_rejected():
    with pytest.raises(ValueError, match="itself"):
        Edge("llm", 1, "llm", 1)
