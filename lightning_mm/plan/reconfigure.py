"""Oobleck's re-configuration (seed 003 §2.5): which replica group each live node trains in after node failures.

Pure: no process group. ``reconfigure`` takes the current assignment (group -> nodes) and the live nodes and
returns the next one, the table the per-node agents follow (``lightning_mm.fault_tolerance.agent``). A group with
n0 .. n_max live nodes re-forms at the template of its size; a group below n0 borrows nodes from groups that can
spare them (their template one size smaller is still valid); groups still below n0 merge. Of all assignments, the
one chosen is the best by, in order:

1. the most nodes training (in groups of n0 .. n_max nodes);
2. the most groups (more copies of every stage: more failures survived);
3. the fewest nodes moved;
4. the fewest groups that lost no node but restart anyway (donors, merge partners);
5. the donor with the most nodes above n0, then the lower group id keeping its nodes (a merged group takes the
   lower id).

Groups re-form by restarting (torchrun starts their workers again at the new size) and a restarted group heals from
a group that kept training, so while some group lost no node, one such group is left untouched: a plan that
restarted every group would have no state to start from. With ``snapshot=True`` (the agents have a snapshot
folder) that rule gives way when breaking it trains more nodes or more groups: a group that lost no node (the
lowest id, ``snapshot_from``) writes a snapshot of its state at a step boundary before it stops, and every group
re-forms from it. Among plans as good on 1. and 2., one that needs no snapshot is preferred. A group that can
neither re-form, borrow nor merge is dissolved and its nodes wait as spares; spare nodes (also newly added ones)
fill groups below n0 before any group donates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations_with_replacement


@dataclass(frozen=True)
class Move:
    """``node`` leaves group ``source`` (None: a spare node) for group ``target``."""

    node: str
    source: int | None
    target: int


@dataclass(frozen=True)
class Reconfiguration:
    """The next assignment: ``groups`` (group id -> its nodes, in order; its template is the one of that many
    nodes), the ``moves`` that lead there, ``spare`` nodes (live, in no group), the groups that restart (lost or
    changed nodes: they re-form at their template and heal by name) and those ``dissolved``. ``enough``: at least
    (f + 1) n0 nodes are live (below that the job should checkpoint and stop, §2.3.4). ``snapshot_from``: when
    every group restarts although one lost no node, that group (it writes the snapshot all groups start from);
    None when a group stays untouched to heal from."""

    groups: dict[int, tuple[str, ...]]
    moves: tuple[Move, ...]
    spare: tuple[str, ...]
    restarted: tuple[int, ...]
    dissolved: tuple[int, ...]
    enough: bool = True
    snapshot_from: int | None = None

    def templates(self) -> dict[int, int]:
        """The template (node count) of every training group."""
        return {g: len(nodes) for g, nodes in self.groups.items()}

    def describe(self) -> list[str]:
        """One line per decision, for logs and the planner's table."""
        lines = [f"group {self.snapshot_from} writes a snapshot at its next step boundary, then every group "
                 "re-forms from it"] if self.snapshot_from is not None else []
        lines += [f"node {m.node} moves from {'the spares' if m.source is None else f'group {m.source}'} to group "
                 f"{m.target}" for m in self.moves]
        lines += [f"group {g} dissolves" for g in self.dissolved]
        lines += [f"group {g} re-forms at the {len(self.groups[g])}-node template" for g in self.restarted
                  if g in self.groups]
        if not self.enough:
            lines.append("fewer than (f + 1) n0 nodes are live: checkpoint and stop")
        return lines


def reconfigure(assignment: Mapping[int, Sequence[str]], live: Sequence[str], node_counts: Sequence[int],
                failures: int = 1, snapshot: bool = False) -> Reconfiguration:
    """The next assignment of ``live`` nodes to the groups of ``assignment`` (group id -> nodes), for templates of
    ``node_counts`` (consecutive n0 .. n_max nodes). Live nodes in no group are spares. Exact: a dynamic programme
    over the groups' next sizes (the order in the module docstring), then the nodes are picked (a donor gives its
    last nodes, receivers take givers' nodes in group order, then spares). ``snapshot``: a snapshot route exists,
    so every group may restart (module docstring)."""
    n0, n_max = _check_counts(node_counts)
    alive, order = set(live), sorted(assignment)
    assigned = {n for g in order for n in assignment[g]}
    if len(assigned) != sum(len(assignment[g]) for g in order):
        raise ValueError(f"a node is in two groups of the assignment {dict(assignment)}")
    kept = {g: [n for n in assignment[g] if n in alive] for g in order}
    intact = {g: len(kept[g]) == len(assignment[g]) and n0 <= len(kept[g]) <= n_max for g in order}
    spares = sorted(n for n in alive if n not in assigned)
    sizes = _best_sizes([len(kept[g]) for g in order], [intact[g] for g in order], len(spares), n0, n_max,
                        snapshot)
    pool, keep = [], {}
    for g, f in zip(order, sizes):
        keep[g] = kept[g][:f] if f else []
        pool += [(n, g) for n in kept[g][len(keep[g]):]]
    pool += [(n, None) for n in spares]
    moves = []
    for g, f in zip(order, sizes):
        for node, source in pool[:max(0, f - len(kept[g]))]:
            moves.append(Move(node, source, g))
            keep[g].append(node)
        pool = pool[max(0, f - len(kept[g])):]
    groups = {g: tuple(keep[g]) for g in order if keep[g]}
    restarted = tuple(g for g in groups if tuple(assignment[g]) != groups[g])
    dissolved = tuple(g for g in order if g not in groups)
    untouched = any(intact[g] and groups.get(g) == tuple(assignment[g]) for g in order)
    source = next((g for g in order if intact[g]), None) if not untouched else None
    return Reconfiguration(groups, tuple(moves), tuple(sorted(n for n, _ in pool)), restarted, dissolved,
                           len(alive) >= (failures + 1) * n0, source)


def _check_counts(node_counts: Sequence[int]) -> tuple[int, int]:
    counts = list(node_counts)
    if not counts or counts[0] < 1 or counts != list(range(counts[0], counts[0] + len(counts))):
        raise ValueError(f"templates must cover consecutive node counts n0 .. n_max from 1 up, got {counts}")
    return counts[0], counts[-1]


def _best_sizes(have: list[int], intact: list[bool], spares: int, n0: int, n_max: int,
                snapshot: bool = False) -> list[int]:
    """Each group's next size (0: dissolved), best by the module docstring's order: a DP over the groups with
    state (nodes taken - nodes given, whether an intact group is kept); scores are tuples, added and compared in
    lexicographic order. With ``snapshot`` a plan that keeps no intact group is valid, ranked after nodes and
    groups by whether it needs the snapshot."""
    count, need_keeper = len(have), any(intact)
    best = {(-spares, False): ((0, 0, 0, 0, 0, 0), [])}
    for i, (c, whole) in enumerate(zip(have, intact)):
        nxt: dict = {}
        for (net, kept), (score, sizes) in best.items():
            for f in (0, *range(n0, n_max + 1)):
                gain, give = max(0, f - c), max(0, c - f)
                term = (f, int(f > 0), -gain, -int(whole and f != c), give * (c - n0) if f else 0,
                        f * (count - i))
                key = (net + gain - give, kept or (whole and f == c))
                cand = (tuple(a + b for a, b in zip(score, term)), sizes + [f])
                if key not in nxt or cand[0] > nxt[key][0]:
                    nxt[key] = cand
        best = nxt
    valid = [((*v[0][:2], -int(need_keeper and not kept), *v[0][2:]), v[1]) for (net, kept), v in best.items()
             if net <= 0 and (kept or not need_keeper or snapshot)]
    return max(valid, key=lambda v: v[0])[1]


def reconfiguration_table(templates, nodes: int, microbatches: int, snapshot: bool = False) -> list[dict]:
    """The planner's table for ``nodes`` live nodes: the groups ``instantiate`` makes (Eq. 2.5), then for every way
    up to ``templates.failures`` nodes fail (which groups lose how many; a group loses its last nodes), the
    reconfiguration and the global batch's split over the resulting groups (Eq. 2.6, ``split_batch``). Nodes are
    named ``n0``, ``n1``, ... in group order. ``snapshot``: as for :func:`reconfigure`."""
    from lightning_mm.plan.templates import instantiate, split_batch

    sizes = instantiate(templates, nodes, microbatches)
    names, assignment, at = [f"n{i}" for i in range(nodes)], {}, 0
    for g, n in enumerate(sizes):
        assignment[g], at = tuple(names[at:at + n]), at + n
    rows = []
    for lost_count in range(1, templates.failures + 1):
        for hit in combinations_with_replacement(range(len(sizes)), lost_count):
            if any(hit.count(g) > sizes[g] for g in set(hit)):
                continue
            lost = {n for g in set(hit) for n in assignment[g][len(assignment[g]) - hit.count(g):]}
            r = reconfigure(assignment, [n for n in names if n not in lost], templates.node_counts,
                            templates.failures, snapshot)
            groups = [templates.template_for(len(v) * templates.devices_per_node) for v in r.groups.values()]
            split = split_batch(groups, microbatches) if groups and microbatches >= len(groups) else []
            rows.append({"groups": dict(assignment), "lost": sorted(lost), "next": r.groups,
                         "moves": [(m.node, m.source, m.target) for m in r.moves], "spare": list(r.spare),
                         "microbatches": dict(zip(r.groups, split)), "enough": r.enough,
                         "snapshot_from": r.snapshot_from})
    return rows
