"""Every generator yields checked schedules with the promised shape and memory bound."""

import itertools

import pytest

from hetjax.schedules import (
    SCHEDULE_NAMES,
    THREE_PHASES,
    ModuleGraph,
    check_schedule,
    dispatch_order,
    gpipe,
    graph_gpipe,
    graph_one_f_one_b,
    one_f_one_b,
    schedule_for,
    three_phase,
    three_phase_for_graph,
    warmup_counts,
)

PM = list(itertools.product(range(1, 7), range(1, 13)))  # P in 1..6, M in 1..12
GRAPHS = {
    "chain": ModuleGraph.chain(("vision", 1), ("llm", 2)),
    "join": ModuleGraph({"vision": 2, "audio": 1, "llm": 2}, [("vision", "llm"), ("audio", "llm")]),
    "branch": ModuleGraph(
        {"vision": 1, "llm": 2, "aux": 1}, [("vision", "llm"), ("vision", "aux")]
    ),
    "diamond": ModuleGraph(
        {"vision": 1, "proj_a": 1, "proj_b": 2, "llm": 2},
        [("vision", "proj_a"), ("vision", "proj_b"), ("proj_a", "llm"), ("proj_b", "llm")],
    ),
}


@pytest.mark.parametrize(("num_stages", "num_mb"), PM)
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_linear_schedules_are_valid(make, num_stages, num_mb):
    sched = make(num_stages, num_mb)
    check_schedule(sched)
    check_schedule(sched, sends="rendezvous")
    assert sched.num_stages == num_stages
    for s in range(num_stages):
        bound = num_mb if make is gpipe else min(num_stages - s, num_mb)
        assert sched.max_live[s] == sched.peak_live(s) == bound


@pytest.mark.parametrize(("num_stages", "num_mb"), PM)
def test_one_f_one_b_warmup_matches_megatron(num_stages, num_mb):
    sched = one_f_one_b(num_stages, num_mb)
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_mb)
        assert sched.leading_forwards(s) == min(warmup + 1, num_mb)
        order = sched.compute_order(s)
        steady = order[warmup : 2 * num_mb - warmup]
        assert steady == tuple(
            pair for i in range(num_mb - warmup) for pair in (("F", warmup + i), ("B", i))
        )
        assert order[2 * num_mb - warmup :] == tuple(
            ("B", m) for m in range(num_mb - warmup, num_mb)
        )


def test_one_f_one_b_comm_order_is_megatrons():
    sched = one_f_one_b(4, 6)
    kinds = [a.kind for a in sched.actions[1]]
    # warm-up block, then the first steady step: recv_forward, F, send_forward_recv_backward,
    # B, send_backward_recv_forward.
    assert kinds[:9] == ["RECV_F", "F", "SEND_F"] * 2 + ["RECV_F", "F", "SEND_F"]
    assert kinds[9:15] == ["RECV_B", "B", "SEND_B", "RECV_F", "F", "SEND_F"]
    assert kinds[-3:] == ["RECV_B", "B", "SEND_B"]
    assert not any(a.kind in ("RECV_F", "SEND_B") for a in sched.actions[0])
    assert not any(a.kind in ("SEND_F", "RECV_B") for a in sched.actions[3])
    for s, acts in enumerate(sched.actions):
        for a in acts:
            if not a.is_compute:
                assert a.peer == (s + 1 if a.kind in ("SEND_F", "RECV_B") else s - 1)


def test_gpipe_order():
    assert gpipe(3, 2).compute_order(1) == (("F", 0), ("F", 1), ("B", 0), ("B", 1))


@pytest.mark.parametrize("align", ["source", "sink"])
@pytest.mark.parametrize("num_mb", range(1, 9))
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_schedules_are_valid(name, num_mb, align):
    graph = GRAPHS[name]
    sched = graph_one_f_one_b(graph, num_mb, align=align)
    check_schedule(sched)
    check_schedule(sched, sends="rendezvous")
    warmups = warmup_counts(graph, num_mb, align=align)
    for s in range(sched.num_stages):
        assert sched.leading_forwards(s) == min(warmups[s] + 1, num_mb)
        assert sched.peak_live(s) == sched.max_live[s] == min(warmups[s] + 1, num_mb)
    check_schedule(graph_gpipe(graph, num_mb))


def test_graph_chain_warmups():
    assert warmup_counts(GRAPHS["chain"], 8) == (2, 1, 0)
    assert warmup_counts(GRAPHS["chain"], 1) == (1, 1, 0)


def test_join_receives_from_every_incoming_edge_keyed_by_source():
    sched = graph_one_f_one_b(GRAPHS["join"], 4)
    assert sched.num_stages == 5 and GRAPHS["join"].total_stages() == 4
    assert warmup_counts(GRAPHS["join"], 8) == (3, 2, 3, 1, 0)
    assert warmup_counts(GRAPHS["join"], 8, align="sink") == (3, 2, 2, 1, 0)
    llm0 = sched.stages_of("llm")[0]
    acts = sched.actions[llm0]
    for m in range(4):
        f = acts.index(next(a for a in acts if a.kind == "F" and a.microbatch == m))
        b = acts.index(next(a for a in acts if a.kind == "B" and a.microbatch == m))
        assert [a.edge.src_module for a in acts[f - 2 : f]] == ["vision", "audio"]
        assert all(a.kind == "RECV_F" and a.microbatch == m for a in acts[f - 2 : f])
        assert [(a.kind, a.edge.src_module) for a in acts[b + 1 : b + 3]] == [
            ("SEND_B", "vision"),
            ("SEND_B", "audio"),
        ]


def test_branch_sends_on_every_outgoing_edge():
    sched = graph_one_f_one_b(GRAPHS["branch"], 3)
    vision = sched.actions[0]
    for m in range(3):
        f = vision.index(next(a for a in vision if a.kind == "F" and a.microbatch == m))
        sent = [(a.kind, a.edge.dst_module) for a in vision[f + 1 : f + 3]]
        assert sent == [("SEND_F", "llm"), ("SEND_F", "aux")]
        b = vision.index(next(a for a in vision if a.kind == "B" and a.microbatch == m))
        assert {a.edge.dst_module for a in vision[b - 2 : b] if a.kind == "RECV_B"} == {
            "llm",
            "aux",
        }


def test_parallel_encoders_have_their_own_stage_lists():
    sched = graph_one_f_one_b(GRAPHS["join"], 4)
    order = dispatch_order(sched)
    first_round = [a for a in order[:5] if a.kind == "F" and a.microbatch == 0]
    assert {a.module for a in first_round} == {"vision", "audio"}


@pytest.mark.parametrize(("llm_pp", "num_mb"), list(itertools.product(range(1, 5), range(1, 9))))
@pytest.mark.parametrize("encoders", [["vision"], ["vision", "audio"]])
def test_three_phase_valid_and_ordered(encoders, llm_pp, num_mb):
    sched = three_phase(encoders, llm_pp, num_mb)
    check_schedule(sched)
    check_schedule(sched, sends="rendezvous")
    assert sched.phases == THREE_PHASES and sched.finalize == "together"
    enc_stages = set(range(len(encoders)))
    for s, acts in enumerate(sched.actions):
        phases = {a.phase for a in acts}
        assert phases == ({0, 2} if s in enc_stages else {1})
    order = dispatch_order(sched)
    last_enc_f = max(i for i, a in enumerate(order) if a.kind == "F" and a.stage in enc_stages)
    first_llm_f = min(i for i, a in enumerate(order) if a.kind == "F" and a.stage not in enc_stages)
    last_llm_b = max(i for i, a in enumerate(order) if a.kind == "B" and a.stage not in enc_stages)
    first_enc_b = min(i for i, a in enumerate(order) if a.kind == "B" and a.stage in enc_stages)
    assert last_enc_f < first_llm_f and last_llm_b < first_enc_b
    for i, s in enumerate(sched.stages_of("llm")):
        assert sched.leading_forwards(s) == min(llm_pp - i, num_mb)
        assert sched.max_live[s] == sched.peak_live(s) == min(llm_pp - i, num_mb)
    for s in enc_stages:
        assert sched.max_live[s] == num_mb
        assert sched.stages[s].devices == tuple(range(llm_pp))


def test_three_phase_encoder_list_shape():
    sched = three_phase(["vision"], 2, 3)
    kinds = [(a.kind, a.microbatch) for a in sched.actions[0]]
    assert kinds == [(k, m) for k in ("F", "SEND_F", "RECV_B", "B") for m in range(3)]


@pytest.mark.parametrize(
    ("encoders", "match"),
    [
        ([], "at least one encoder"),
        ({"vision": 2}, "pp=2"),
        (["vision", "vision"], "distinct"),
        (["llm"], "distinct"),
        ("vision", "list of names"),
    ],
)
def test_three_phase_rejects_bad_encoders(encoders, match):
    with pytest.raises(ValueError, match=match):
        three_phase(encoders, 2, 4)


def test_three_phase_for_graph():
    star = ModuleGraph({"vision": 1, "audio": 1, "llm": 2}, [("vision", "llm"), ("audio", "llm")])
    assert three_phase_for_graph(star, 4) == three_phase(["vision", "audio"], 2, 4)
    with pytest.raises(ValueError, match="feed 'llm' directly"):
        three_phase_for_graph(GRAPHS["diamond"], 4)
    with pytest.raises(ValueError, match="one sink"):
        three_phase_for_graph(GRAPHS["branch"], 4)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_registry_builds_every_name(name):
    graph = ModuleGraph({"vision": 1, "llm": 2}, [("vision", "llm")])
    sched = schedule_for(name, 4, graph=graph)
    check_schedule(sched)
    if name in ("gpipe", "1f1b"):
        assert schedule_for(name, 4, num_stages=3).num_stages == 3


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("zb",), {"num_stages": 2}, "unknown schedule 'zb'"),
        (("1f1b",), {}, "needs num_stages"),
        (("graph_1f1b",), {"num_stages": 2}, "needs graph"),
        (("1f1b",), {"num_stages": 2, "graph": GRAPHS["chain"]}, "not both"),
    ],
)
def test_registry_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        schedule_for(*args, 4, **kwargs)


@pytest.mark.parametrize(("p", "m"), [(0, 4), (2, 0), (2, 1.5)])
def test_generators_reject_bad_sizes(p, m):
    with pytest.raises(ValueError, match=">= 1"):
        one_f_one_b(p, m)
    with pytest.raises(ValueError, match=">= 1"):
        gpipe(p, m)
