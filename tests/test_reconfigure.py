"""Oobleck's re-configuration table (``lightning_mm.plan.reconfigure``), pure: against a brute force over every
assignment of the live nodes to the groups, and the named cases (re-form, borrow, merge, spares, the group kept
untouched)."""

from __future__ import annotations

import random
from itertools import product

import pytest

import lightning_mm as lmm
from lightning_mm.plan.reconfigure import Move, reconfigure, reconfiguration_table
from lightning_mm.plan.templates import PipelineTemplate, Templates


def _score(assignment, final, n0, n_max, snapshot=False):
    """The order the table optimises, computed from node identities: nodes training, groups, -needs a snapshot,
    -nodes moved, -untouched groups disturbed; None for an invalid assignment (a group outside n0..n_max, or every
    group that lost no node restarted without a snapshot route)."""
    if any(not n0 <= len(v) <= n_max for g, v in final.items() if g != "_live" and v):
        return None
    intact = [g for g, v in assignment.items() if final.get(g) is not None and len(v) == len(final["_live"][g])
              and n0 <= len(v) <= n_max]
    needs = bool(intact) and not any(tuple(final[g]) == tuple(assignment[g]) for g in intact)
    if needs and not snapshot:
        return None
    where = {n: g for g, v in assignment.items() for n in v}
    groups = {g: v for g, v in final.items() if g != "_live" and v}
    moved = sum(1 for g, v in groups.items() for n in v if where.get(n) != g)
    disturbed = sum(1 for g in intact if tuple(final[g]) != tuple(assignment[g]))
    return sum(map(len, groups.values())), len(groups), -int(needs), -moved, -disturbed


def _brute_force(assignment, live, n0, n_max, snapshot=False):
    order = sorted(assignment)
    kept = {g: [n for n in assignment[g] if n in live] for g in order}
    best = None
    for choice in product([*order, None], repeat=len(live)):
        final = {g: [] for g in order}
        for node, g in zip(live, choice):
            if g is not None:
                final[g].append(node)
        for g in order:  # a group's own nodes first, in their order: the identity comparison of an untouched group
            final[g] = [n for n in assignment[g] if n in final[g]] + [n for n in final[g] if n not in assignment[g]]
        final["_live"] = kept
        s = _score(assignment, final, n0, n_max, snapshot)
        if s is not None and (best is None or s > best):
            best = s
    return best


def _random_case(rng):
    n0 = rng.randint(1, 2)
    n_max = n0 + rng.randint(0, 2)
    groups = rng.randint(1, 3)
    assignment, i = {}, 0
    for g in range(groups):
        size = rng.randint(n0, n_max)
        assignment[g] = [f"x{i + k}" for k in range(size)]
        i += size
    nodes = [n for v in assignment.values() for n in v]
    live = [n for n in nodes if rng.random() > 0.35] + ([f"x{i}"] if rng.random() < 0.3 else [])
    if len(live) > 5:
        live = live[:5]
    return assignment, live, n0, n_max


@pytest.mark.parametrize("snapshot", [False, True])
def test_the_table_is_as_good_as_a_brute_force_over_every_assignment(snapshot):
    rng = random.Random(3)
    checked, snapshots = 0, 0
    for _ in range(80):
        assignment, live, n0, n_max = _random_case(rng)
        counts = list(range(n0, n_max + 1))
        r = reconfigure(assignment, live, counts, snapshot=snapshot)
        placed = [n for v in r.groups.values() for n in v] + list(r.spare)
        assert sorted(placed) == sorted(live)  # every live node exactly once
        final = {g: list(r.groups.get(g, ())) for g in assignment}
        final["_live"] = {g: [n for n in assignment[g] if n in live] for g in assignment}
        got = _score(assignment, final, n0, n_max, snapshot)
        assert got is not None, (assignment, live, r)
        assert got == _brute_force(assignment, live, n0, n_max, snapshot), (assignment, live, n0, n_max, r)
        assert len(r.moves) == -got[3]
        assert (r.snapshot_from is not None) == bool(got[2])  # the snapshot is named exactly when it is needed
        if r.snapshot_from is not None:  # by a group that lost no node
            assert all(n in live for n in assignment[r.snapshot_from])
        snapshots += r.snapshot_from is not None
        checked += 1
    assert checked == 80 and (snapshots > 0) == snapshot  # the random cases reach the snapshot route


def test_borrowing_merging_and_the_group_left_untouched():
    counts = [2, 3]
    # A (2 nodes) loses one; B (3) can spare one, C (2) lost none and stays untouched: B's last node moves to A
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1", "b2"], 2: ["c0", "c1"]},
                    ["a0", "b0", "b1", "b2", "c0", "c1"], counts)
    assert r.moves == (Move("b2", 1, 0),)
    assert r.groups == {0: ("a0", "b2"), 1: ("b0", "b1"), 2: ("c0", "c1")} and r.restarted == (0, 1)
    # A and B (2 each) lose one each: the survivors merge into A; C never restarts
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1"], 2: ["c0", "c1"]}, ["a0", "b0", "c0", "c1"], counts)
    assert r.moves == (Move("b0", 1, 0),) and r.dissolved == (1,) and r.restarted == (0,)
    assert r.groups == {0: ("a0", "b0"), 2: ("c0", "c1")}
    # two groups only: B is the one group that lost no node, so it does not donate (its restart would leave no
    # group to heal from); A's survivor waits as a spare
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1", "b2"]}, ["a0", "b0", "b1", "b2"], counts)
    assert r.moves == () and r.groups == {1: ("b0", "b1", "b2")} and r.spare == ("a0",)
    # with a snapshot route the same loss is a borrow between the two groups: B writes the snapshot, both re-form
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1", "b2"]}, ["a0", "b0", "b1", "b2"], counts, snapshot=True)
    assert r.moves == (Move("b2", 1, 0),) and r.groups == {0: ("a0", "b2"), 1: ("b0", "b1")}
    assert r.restarted == (0, 1) and r.snapshot_from == 1 and "writes a snapshot" in r.describe()[0]
    # ... but it is used only when it trains more: with a third group to heal from, no snapshot
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1", "b2"], 2: ["c0", "c1"]},
                    ["a0", "b0", "b1", "b2", "c0", "c1"], counts, snapshot=True)
    assert r.moves == (Move("b2", 1, 0),) and r.snapshot_from is None and r.groups[2] == ("c0", "c1")
    # a spare (here a new node) fills a group below n0 before any group donates
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1", "b2"], 2: ["c0", "c1"]},
                    ["a0", "b0", "b1", "b2", "c0", "c1", "new"], counts)
    assert r.moves == (Move("new", None, 0),) and r.restarted == (0,)


def test_the_donor_is_the_group_with_most_nodes_above_n0_and_a_merge_keeps_the_lower_id():
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1", "b2"], 2: ["c0", "c1", "c2", "c3"], 3: ["d0", "d1"]},
                    ["a0", "b0", "b1", "b2", "c0", "c1", "c2", "c3", "d0", "d1"], [2, 3, 4])
    assert r.moves == (Move("c3", 2, 0),)
    r = reconfigure({4: ["a0", "a1"], 1: ["b0", "b1"], 2: ["c0", "c1"]}, ["a0", "b0", "c0", "c1"], [2, 3])
    assert r.groups == {1: ("b0", "a0"), 2: ("c0", "c1")} and r.dissolved == (4,)


def test_below_f_plus_one_groups_of_n0_the_table_says_stop_and_bad_templates_are_named():
    r = reconfigure({0: ["a0", "a1"], 1: ["b0", "b1"]}, ["a0", "a1"], [2, 3], failures=1)
    assert not r.enough and "checkpoint and stop" in r.describe()[-1]
    with pytest.raises(ValueError, match="consecutive node counts"):
        reconfigure({0: ["a"]}, ["a"], [2, 4])
    with pytest.raises(ValueError, match="in two groups"):
        reconfigure({0: ["a"], 1: ["a"]}, ["a"], [1])


def _templates(counts, failures=1):
    def template(n):
        return PipelineTemplate(nodes=n, devices_per_node=1, specs={"language_model": lmm.ParallelSpec(pp=n)},
                                partition={"language_model": (1,) * n}, microbatch_time=1.0 / n, fill_time=0.1)
    return Templates(tuple(template(n) for n in counts), failures=failures)


def test_the_planners_table_covers_every_failure_up_to_f_and_splits_the_batch():
    templates = _templates([2, 3, 4, 5], failures=2)
    rows = reconfiguration_table(templates, 9, 16)
    sizes = sorted(len(v) for v in rows[0]["groups"].values())
    assert sum(sizes) == 9 and len(sizes) >= 3
    assert {len(r["lost"]) for r in rows} == {1, 2}
    for row in rows:
        nodes = [n for v in row["next"].values() for n in v] + row["spare"]
        assert sorted(nodes) == sorted(n for v in row["groups"].values() for n in v if n not in row["lost"])
        assert all(2 <= len(v) <= 5 for v in row["next"].values())
        assert sum(row["microbatches"].values()) == 16 and min(row["microbatches"].values()) >= 1
        assert row["enough"] and row["snapshot_from"] is None  # a group to heal from is always left


def test_the_planners_table_with_a_snapshot_route_borrows_between_two_groups():
    plain = {tuple(r["lost"]): r for r in reconfiguration_table(_templates([2, 3]), 5, 6)}
    rows = {tuple(r["lost"]): r for r in reconfiguration_table(_templates([2, 3]), 5, 6, snapshot=True)}
    assert rows[("n4",)]["groups"] == {0: ("n0", "n1", "n2"), 1: ("n3", "n4")}
    # the 2-node group loses a node: without a snapshot it waits as a spare and one group trains on; with one it
    # borrows the 3-node group's last node, which writes the snapshot, and two groups train
    assert plain[("n4",)]["next"] == {0: ("n0", "n1", "n2")} and plain[("n4",)]["spare"] == ["n3"]
    row = rows[("n4",)]
    assert row["next"] == {0: ("n0", "n1"), 1: ("n3", "n2")} and row["moves"] == [("n2", 0, 1)]
    assert row["snapshot_from"] == 0 and row["microbatches"] == {0: 3, 1: 3}
    # the 3-node group loses one: it re-forms at 2 nodes and heals from the other, which stays untouched
    assert rows[("n2",)] == plain[("n2",)] and rows[("n2",)]["snapshot_from"] is None
