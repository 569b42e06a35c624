"""The checker rejects broken schedules with the right reason and a useful message."""

import dataclasses

import pytest

from hetjax.schedules import (
    Action,
    Edge,
    ModuleGraph,
    ScheduleError,
    StageInfo,
    build_schedule,
    check_schedule,
    dispatch_order,
    gpipe,
    graph_one_f_one_b,
    one_f_one_b,
    three_phase,
)
from hetjax.schedules.actions import backward, forward, transfer

E01 = Edge("m", 0, "m", 1)


def two_stage(list0, list1, num_mb, *, max_live=None, phases=("pipeline",)):
    """A hand-written 2-stage linear schedule on edge E01."""
    stages = [StageInfo(0, "m", 0, 2), StageInfo(1, "m", 1, 2)]
    return build_schedule(
        "hand",
        num_mb,
        stages,
        [E01],
        [list0, list1],
        max_live or [num_mb, num_mb],
        phases=phases,
    )


def replace_list(sched, stage, new_list):
    acts = list(sched.actions)
    acts[stage] = tuple(new_list)
    return dataclasses.replace(sched, actions=tuple(acts))


def without(sched, stage, pred):
    return replace_list(sched, stage, [a for a in sched.actions[stage] if not pred(a)])


def expect(sched, reason, *fragments, sends="buffered"):
    with pytest.raises(ScheduleError) as info:
        check_schedule(sched, sends=sends)
    assert info.value.reason == reason, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value)
    return str(info.value)


def test_missing_backward():
    sched = without(one_f_one_b(3, 4), 1, lambda a: a.kind == "B" and a.microbatch == 2)
    expect(sched, "missing", "stage 1", "no B for microbatch 2")


def test_duplicate_forward():
    sched = one_f_one_b(2, 2)
    sched = replace_list(sched, 0, [forward(0, 0, "model"), *sched.actions[0]])
    expect(sched, "duplicate", "F of microbatch 0 2 times")


def test_backward_before_forward():
    sched = gpipe(1, 2)  # [F0, F1, B0, B1]
    f0, f1, b0, b1 = sched.actions[0]
    expect(replace_list(sched, 0, [b0, f0, f1, b1]), "order", "B of microbatch 0 before its F")


def test_recv_without_send():
    sched = without(one_f_one_b(3, 4), 0, lambda a: a.kind == "SEND_F" and a.microbatch == 1)
    expect(sched, "unpaired", "RECV_F of microbatch 1", "no matching SEND_F on stage 0")


def test_send_without_recv():
    sched = without(one_f_one_b(3, 4), 0, lambda a: a.kind == "RECV_B" and a.microbatch == 3)
    expect(sched, "unpaired", "SEND_B of microbatch 3", "has no RECV_B on stage 0")


def test_forward_without_its_input():
    sched = without(gpipe(2, 2), 0, lambda a: a.kind == "SEND_F" and a.microbatch == 0)
    sched = without(sched, 1, lambda a: a.kind == "RECV_F" and a.microbatch == 0)
    expect(sched, "dependency", "stage 1 runs F of microbatch 0 without its input from stage 0")


def test_recv_after_its_forward():
    sched = gpipe(2, 1)  # stage 1: [RECV_F0, F0, B0, SEND_B0]
    recv, f, b, send = sched.actions[1]
    expect(replace_list(sched, 1, [f, recv, b, send]), "order", "must come before F")


def test_send_before_its_backward():
    sched = gpipe(2, 1)
    recv, f, b, send = sched.actions[1]
    expect(replace_list(sched, 1, [recv, f, send, b]), "order", "must come after B")


def test_two_stages_that_each_receive_first_deadlock():
    # Stage 0 waits for a gradient before sending the activation stage 1 waits for.
    list0 = [forward(0, 0), transfer("RECV_B", E01, 0), transfer("SEND_F", E01, 0), backward(0, 0)]
    list1 = [transfer("RECV_F", E01, 0), forward(1, 0), backward(1, 0), transfer("SEND_B", E01, 0)]
    sched = two_stage(list0, list1, 1)
    msg = expect(sched, "deadlock", "stage 0 (m[0/2]) waits at RECV_B", "stage 1 (m[1/2]) waits")
    assert "matching SEND_B on stage 1" in msg and "\n" not in msg


def test_out_of_order_sends_deadlock_only_under_rendezvous():
    # Stage 0 sends microbatch 1 before 0, with a forward in between; stage 1 wants 0 first.
    list0 = [forward(0, 0), forward(0, 1), transfer("SEND_F", E01, 1), forward(0, 2)]
    list0 += [transfer("SEND_F", E01, 0), transfer("SEND_F", E01, 2)]
    for m in range(3):
        list0 += [transfer("RECV_B", E01, m), backward(0, m)]
    list1 = [a for m in range(3) for a in (transfer("RECV_F", E01, m), forward(1, m))]
    list1 += [a for m in range(3) for a in (backward(1, m), transfer("SEND_B", E01, m))]
    sched = two_stage(list0, list1, 3)
    check_schedule(sched)  # buffered sends: fine
    expect(sched, "deadlock", "for stage 1 to post the matching RECV_F", sends="rendezvous")


def test_batched_send_recv_pairs_pass_rendezvous():
    # Megatron's send_forward_recv_backward / send_backward_recv_forward are posted together.
    sched = one_f_one_b(2, 4)
    pairs = list(zip(sched.actions[0], sched.actions[0][1:], strict=False))
    assert ("SEND_F", "RECV_B") in [(a.kind, b.kind) for a, b in pairs]
    pairs = list(zip(sched.actions[1], sched.actions[1][1:], strict=False))
    assert ("SEND_B", "RECV_F") in [(a.kind, b.kind) for a, b in pairs]
    check_schedule(sched, sends="rendezvous")


def test_recv_waiting_on_a_later_phase_deadlocks():
    phase1 = {"phase": 1}
    list0 = [Action("F", 0, 0, phase=1), transfer("SEND_F", E01, 0, **phase1)]
    list0 += [transfer("RECV_B", E01, 0, **phase1), Action("B", 0, 0, phase=1)]
    list1 = [transfer("RECV_F", E01, 0), forward(1, 0), backward(1, 0), transfer("SEND_B", E01, 0)]
    sched = two_stage(list0, list1, 1, phases=("a", "b"))
    expect(sched, "deadlock", "for phase 'a' to finish", "waits at RECV_F")


@pytest.mark.parametrize(("make", "stage"), [(gpipe, 0), (one_f_one_b, 0), (one_f_one_b, 2)])
def test_exceeding_max_live(make, stage):
    sched = make(4, 6)
    bound = list(sched.max_live)
    bound[stage] -= 1
    msg = expect(dataclasses.replace(sched, max_live=tuple(bound)), "max_live", f"stage {stage}")
    assert f"above its max_live of {bound[stage]}" in msg


def test_structure_errors():
    sched = one_f_one_b(2, 2)
    moved = replace_list(sched, 0, [*sched.actions[0], forward(1, 0)])
    expect(moved, "structure", "names stage 1")
    expect(dataclasses.replace(sched, num_microbatches=1), "structure", "out of range")
    expect(dataclasses.replace(sched, max_live=(2,)), "structure", "max_live entries")
    stray = Edge("model", 1, "model", 0)
    bad_edge = replace_list(sched, 1, [*sched.actions[1], transfer("SEND_F", stray, 0)])
    expect(bad_edge, "structure", "not in schedule.edges")
    tp = three_phase(["vision"], 1, 1)
    swapped = replace_list(tp, 0, list(reversed(tp.actions[0])))
    expect(swapped, "structure", "phases must not decrease")


def test_dispatch_order_is_a_valid_interleaving():
    sched = three_phase(["vision", "audio"], 3, 5)
    order = dispatch_order(sched)
    assert sorted(map(repr, order)) == sorted(repr(a) for acts in sched.actions for a in acts)
    done = set()
    for a in order:
        if a.is_recv:
            assert a.transfer_key() in done
        if a.is_send:
            done.add(a.transfer_key())
    with pytest.raises(ValueError, match="buffered"):
        dispatch_order(sched, sends="eager")


def test_rendezvous_order_pairs_each_send_with_its_recv():
    order = dispatch_order(one_f_one_b(4, 6), sends="rendezvous")
    for a, b in zip(order, order[1:], strict=False):
        if a.is_send:
            assert b.is_recv and b.transfer_key() == a.transfer_key()


def test_skip_edge_graph_needs_buffered_sends():
    # vision feeds llm directly and through a projector: the direct edge skips a module,
    # so vision runs ahead of llm on that edge and the transfer must be buffered.
    graph = ModuleGraph(
        {"vision": 1, "proj": 2, "llm": 2}, [("vision", "proj"), ("vision", "llm"), ("proj", "llm")]
    )
    sched = graph_one_f_one_b(graph, 5)
    check_schedule(sched)
    expect(sched, "deadlock", "rendezvous sends", sends="rendezvous")
