"""The multimodal 1F1B schedule: graph building, hand-written action orders, and the deadlock checker."""

import random

import pytest

from lightning_mm.plan.schedule import (
    Action,
    ScheduleError,
    StageGraph,
    StageNode,
    build_stage_graph,
    check_rendezvous,
    check_schedule,
    communication_groups,
    one_f_one_b,
)

LM0, LM1, LM2 = "language_model.0", "language_model.1", "language_model.2"


def compact(actions):
    """Readable form: F3 / B3 for compute, rf3<peer, sf3>peer, rb3<peer, sb3>peer for messages."""
    out = []
    for a in actions:
        if a.kind == "forward":
            out.append(f"F{a.microbatch}")
        elif a.kind == "backward":
            out.append(f"B{a.microbatch}")
        else:
            arrow = "<" if a.kind.startswith("recv") else ">"
            out.append(f"{a.kind[0]}{a.kind[-3]}{a.microbatch}{arrow}{a.peer}")
    return " ".join(out)


def all_trainable(value, *names):
    return {n: value for n in names}


# ---------------------------------------------------------------- graph building


def test_parallel_graph_shape_and_depths():
    g = build_stage_graph({"vision": 2, "audio": 1}, 2, "parallel", all_trainable(False, "vision.0", "vision.1", "audio.0", LM0, LM1))
    assert g.names == ["vision.0", "vision.1", "audio.0", LM0, LM1]
    assert set(g.edges) == {("vision.0", "vision.1"), ("vision.1", LM0), ("audio.0", LM0), (LM0, LM1)}
    assert g.predecessors(LM0) == ("vision.1", "audio.0")
    assert g.successors("audio.0") == (LM0,) and g.successors(LM1) == ()
    assert g.sink == LM1
    assert [g.depth(n) for n in g.names] == [3, 2, 2, 1, 0]
    assert g.topological_order().index("vision.0") < g.topological_order().index("vision.1") < g.topological_order().index(LM0)
    assert not any(n.needs_backward for n in g.nodes)


def test_needs_backward_is_frozen_aware():
    # frozen encoders, trainable projector in vision.1 only, frozen LLM: LLM stages still need (input) backward
    t = {"vision.0": False, "vision.1": True, "audio.0": False, LM0: False, LM1: False}
    g = build_stage_graph({"vision": 2, "audio": 1}, 2, "parallel", t)
    assert {n.name: n.needs_backward for n in g.nodes} == {
        "vision.0": False, "vision.1": True, "audio.0": False, LM0: True, LM1: True}
    # only the last LLM stage trainable (LoRA on the top layers): everything before runs forward only
    t = {"vision.0": False, "vision.1": False, "audio.0": False, LM0: False, LM1: True}
    g = build_stage_graph({"vision": 2, "audio": 1}, 2, "parallel", t)
    assert [n.needs_backward for n in g.nodes] == [False, False, False, False, True]


def test_colocated_fuses_and_ors_per_encoder_flags():
    t = {"vision.0": True, "vision.1": False, "audio.0": False, "audio.1": False, LM0: False}
    g = build_stage_graph({"vision": 2, "audio": 2}, 1, "colocated", t)
    assert g.names == ["encoders.0", "encoders.1", LM0]
    assert g.edges == (("encoders.0", "encoders.1"), ("encoders.1", LM0))
    assert [n.needs_backward for n in g.nodes] == [True, True, True]
    assert g.node("encoders.1").module == "encoders" and g.node("encoders.1").index == 1
    g = build_stage_graph({"vision": 2, "audio": 2}, 1, "colocated", {"encoders.0": False, "encoders.1": False, LM0: True})
    assert [n.needs_backward for n in g.nodes] == [False, False, True]


def test_replicated_has_no_encoder_stages():
    t = {"vision.0": True, LM0: False, LM1: False}
    g = build_stage_graph({"vision": 1}, 2, "replicated", t)
    assert g.names == [LM0, LM1] and g.edges == ((LM0, LM1),)
    assert [n.needs_backward for n in g.nodes] == [True, True]


@pytest.mark.parametrize(
    "args, message",
    [
        (({"vision": 2, "audio": 1}, 1, "colocated", {}), "same stage count"),
        (({"vision": 1}, 1, "ring", {}), "unknown encoder placement"),
        (({"vision": 1}, 1, "parallel", {"vision.0": True}), "no entry for stage 'language_model.0'"),
        (({"vision": 1}, 1, "parallel", {"vision.0": True, LM0: True, "visoin.0": True}), "unknown stages"),
        (({"vision": 0}, 1, "parallel", {}), "stage count >= 1"),
        (({}, 0, "parallel", {}), "llm_stages"),
        (({"language_model": 1}, 1, "parallel", {}), "reserved"),
    ],
)
def test_bad_build_arguments_raise(args, message):
    with pytest.raises(ValueError, match=message):
        build_stage_graph(*args)


def test_graph_validation():
    a, b, c = (StageNode(n, n, 0, False) for n in "abc")
    with pytest.raises(ValueError, match="two successors"):
        StageGraph([a, b, c], [("a", "b"), ("a", "c")])
    with pytest.raises(ValueError, match="exactly one sink"):
        StageGraph([a, b], [])
    with pytest.raises(ValueError, match="successor"):
        StageGraph([StageNode("a", "a", 0, True), b], [("a", "b")])


# ---------------------------------------------------------------- hand-written action orders


def test_linear_chain_p3_m4_exact_order():
    g = build_stage_graph({}, 3, "parallel", all_trainable(True, LM0, LM1, LM2))
    s = one_f_one_b(g, 4)
    assert compact(s[LM0]) == (
        f"F0 sf0>{LM1} F1 sf1>{LM1} F2 sf2>{LM1} rb0<{LM1} B0 "
        f"F3 sf3>{LM1} rb1<{LM1} B1 rb2<{LM1} B2 rb3<{LM1} B3"
    )
    assert compact(s[LM1]) == (
        f"rf0<{LM0} F0 sf0>{LM2} rf1<{LM0} F1 sf1>{LM2} rb0<{LM2} B0 sb0>{LM0} "
        f"rf2<{LM0} F2 sf2>{LM2} rb1<{LM2} B1 sb1>{LM0} rf3<{LM0} F3 sf3>{LM2} rb2<{LM2} B2 sb2>{LM0} "
        f"rb3<{LM2} B3 sb3>{LM0}"
    )
    assert compact(s[LM2]) == " ".join(f"rf{m}<{LM1} F{m} B{m} sb{m}>{LM1}" for m in range(4))
    check_schedule(g, s, 4)


def test_dag_vision2_audio1_llm2_m4_exact_order():
    names = ["vision.0", "vision.1", "audio.0", LM0, LM1]
    g = build_stage_graph({"vision": 2, "audio": 1}, 2, "parallel", all_trainable(True, *names))
    s = one_f_one_b(g, 4)
    # vision.0: depth 3 -> 3 warm-up forwards, then F3 B0, then three cooldown backwards
    assert compact(s["vision.0"]) == (
        "F0 sf0>vision.1 F1 sf1>vision.1 F2 sf2>vision.1 F3 sf3>vision.1 "
        "rb0<vision.1 B0 rb1<vision.1 B1 rb2<vision.1 B2 rb3<vision.1 B3"
    )
    # audio.0: depth 2, a source stage
    assert compact(s["audio.0"]) == (
        f"F0 sf0>{LM0} F1 sf1>{LM0} F2 sf2>{LM0} rb0<{LM0} B0 "
        f"F3 sf3>{LM0} rb1<{LM0} B1 rb2<{LM0} B2 rb3<{LM0} B3"
    )
    # language_model.0: receives from both encoders (graph order) and sends gradients to both
    fwd = lambda m: f"rf{m}<vision.1 rf{m}<audio.0 F{m} sf{m}>{LM1}"  # noqa: E731
    bwd = lambda m: f"rb{m}<{LM1} B{m} sb{m}>vision.1 sb{m}>audio.0"  # noqa: E731
    assert compact(s[LM0]) == " ".join([fwd(0), fwd(1), bwd(0), fwd(2), bwd(1), fwd(3), bwd(2), bwd(3)])
    assert compact(s[LM1]) == " ".join(f"rf{m}<{LM0} F{m} B{m} sb{m}>{LM0}" for m in range(4))
    check_schedule(g, s, 4)


def test_frozen_encoders_run_forward_only_and_get_no_gradients():
    t = {"vision.0": False, "vision.1": False, "audio.0": False, LM0: True, LM1: True}
    g = build_stage_graph({"vision": 2, "audio": 1}, 2, "parallel", t)
    s = one_f_one_b(g, 4)
    assert compact(s["vision.0"]) == " ".join(f"F{m} sf{m}>vision.1" for m in range(4))
    assert compact(s["audio.0"]) == " ".join(f"F{m} sf{m}>{LM0}" for m in range(4))
    fwd = lambda m: f"rf{m}<vision.1 rf{m}<audio.0 F{m} sf{m}>{LM1}"  # noqa: E731
    bwd = lambda m: f"rb{m}<{LM1} B{m}"  # noqa: E731
    assert compact(s[LM0]) == " ".join([fwd(0), fwd(1), bwd(0), fwd(2), bwd(1), fwd(3), bwd(2), bwd(3)])
    check_schedule(g, s, 4)


def test_fewer_microbatches_than_depth():
    g = build_stage_graph({}, 3, "parallel", all_trainable(True, LM0, LM1, LM2))
    s = one_f_one_b(g, 1)
    assert compact(s[LM0]) == f"F0 sf0>{LM1} rb0<{LM1} B0"
    check_schedule(g, s, 1)


# ---------------------------------------------------------------- the checker


def random_case(rng):
    placement = rng.choice(["parallel", "colocated", "replicated"])
    n_enc = rng.randint(0, 3)
    same = rng.randint(1, 4)
    enc = {f"enc{k}": (same if placement == "colocated" else rng.randint(1, 4)) for k in range(n_enc)}
    llm = rng.randint(1, 4)
    names = [f"{e}.{i}" for e, c in enc.items() for i in range(c)] + [f"{LM0[:-2]}.{i}" for i in range(llm)]
    trainable = {n: rng.random() < 0.35 for n in names}
    return build_stage_graph(enc, llm, placement, trainable), rng.randint(1, 8)


def test_random_graphs_are_deadlock_free():
    rng = random.Random(1234)
    for _ in range(400):
        g, m = random_case(rng)
        s = one_f_one_b(g, m)
        executed = check_schedule(g, s, m)
        assert executed == sum(len(v) for v in s.values())
        check_rendezvous(s)  # also when every send waits for its receive (NCCL), sends/receives grouped
        for node in g.nodes:  # every stage forwards each microbatch once, backward iff needed
            assert [a.microbatch for a in s[node.name] if a.kind == "forward"] == list(range(m))
            assert [a.microbatch for a in s[node.name] if a.kind == "backward"] == (list(range(m)) if node.needs_backward else [])


def chain2():
    g = build_stage_graph({}, 2, "parallel", all_trainable(True, LM0, LM1))
    return g, one_f_one_b(g, 2)


def test_checker_detects_deadlock():
    g, s = chain2()
    # stage 0 waits for the gradient of mb 0 before sending mb 1, but stage 1 forwards both first
    s[LM0] = [Action("forward", 0), Action("send_fwd", 0, LM1), Action("recv_bwd", 0, LM1), Action("backward", 0),
              Action("forward", 1), Action("send_fwd", 1, LM1), Action("recv_bwd", 1, LM1), Action("backward", 1)]
    s[LM1] = [Action("recv_fwd", 0, LM0), Action("forward", 0), Action("recv_fwd", 1, LM0), Action("forward", 1),
              Action("backward", 0), Action("send_bwd", 0, LM0), Action("backward", 1), Action("send_bwd", 1, LM0)]
    with pytest.raises(ScheduleError, match="deadlock.*'language_model.1' at action 2"):
        check_schedule(g, s, 2)


def test_checker_detects_unmatched_send_missing_and_duplicate_compute():
    g, s = chain2()
    broken = dict(s, **{LM1: [a for a in s[LM1] if not (a.kind == "send_bwd" and a.microbatch == 1)]})
    with pytest.raises(ScheduleError, match="deadlock.*'language_model.0'.*recv_bwd"):
        check_schedule(g, broken, 2)
    broken = dict(s, **{LM0: s[LM0] + [Action("send_fwd", 1, LM1)]})
    with pytest.raises(ScheduleError, match="sends without a matching receive"):
        check_schedule(g, broken, 2)
    broken = dict(s, **{LM1: [a for a in s[LM1] if not (a.kind == "backward" and a.microbatch == 1)]})
    with pytest.raises(ScheduleError, match="before its backward"):
        check_schedule(g, broken, 2)
    with pytest.raises(ScheduleError, match="expected 0..2"):
        check_schedule(g, s, 3)
    dup = s[LM1][:2] + [Action("forward", 0)] + s[LM1][2:]
    with pytest.raises(ScheduleError, match="duplicate forward"):
        check_schedule(g, dict(s, **{LM1: dup}), 2)


def test_checker_detects_wrong_peer_and_order():
    g, s = chain2()
    with pytest.raises(ScheduleError, match="not valid for send_fwd"):
        check_schedule(g, dict(s, **{LM0: [Action("forward", 0), Action("send_fwd", 0, LM0)]}), 2)
    swapped = list(s[LM1])
    swapped[0], swapped[4] = swapped[4], swapped[0]  # receive mb 1 first
    with pytest.raises(ScheduleError, match="expected microbatch 1 but the next message is 0"):
        check_schedule(g, dict(s, **{LM1: swapped}), 2)


def test_communication_groups_pair_send_forward_with_receive_backward():
    g = build_stage_graph({}, 3, "parallel", all_trainable(True, LM0, LM1, LM2))
    middle = [" ".join(compact([a]) for a in group) for group in communication_groups(one_f_one_b(g, 4)[LM1])]
    assert middle[:6] == ["rf0<language_model.0", "F0", "sf0>language_model.2 rf1<language_model.0", "F1",
                          "sf1>language_model.2 rb0<language_model.2", "B0"]
    assert "sb0>language_model.0 rf2<language_model.0" in middle  # Megatron's send-backward-receive-forward


def test_rendezvous_needs_the_grouping():
    """With sends that wait for their receive (NCCL rendezvous), plain 1F1B deadlocks: stage 0 sends microbatch
    1 while stage 1 sends the gradient of microbatch 0. Posting each run of sends/receives together fixes it."""
    g, s = chain2()
    with pytest.raises(ScheduleError, match="deadlock under rendezvous.*send_fwd"):
        check_rendezvous(s, grouped=False)
    check_rendezvous(s)
