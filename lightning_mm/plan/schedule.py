"""The multimodal pipeline schedule: the stage DAG and 1F1B action lists over it.

This is the single source of the schedule. The runtime executes these action lists (non-blocking sends,
blocking receives), the planner's simulator times them, and `check_schedule` proves them deadlock-free.
Nothing here touches torch.distributed.

Graph shape: every encoder pipeline (or the fused colocated chain) ends in `language_model.0`, and the
language model is a chain ending in its last stage (the sink). Every stage therefore has at most one
successor, and the 1F1B warm-up of a stage is its depth (edges on the path to the sink), exactly as stage
i of a P-stage chain warms up with P-1-i forwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lightning_mm.plan.placement import COLOCATED_ENCODERS, LANGUAGE_MODEL, PLACEMENTS, placement_table, stage_name

ACTION_KINDS = ("recv_fwd", "forward", "send_fwd", "recv_bwd", "backward", "send_bwd")


@dataclass(frozen=True)
class StageNode:
    """One pipeline stage: `name` is "<module>.<index>"; `needs_backward` is False for a stage that has
    no trainable parameter in it or upstream of it (it runs forward only, under no_grad)."""

    name: str
    module: str
    index: int
    needs_backward: bool


@dataclass(frozen=True)
class Action:
    """One step of a stage's action list. `peer` names the stage a message goes to or comes from."""

    kind: str
    microbatch: int
    peer: str | None = None

    def __post_init__(self):
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; use one of {ACTION_KINDS}")


@dataclass(frozen=True)
class StageGraph:
    """A validated stage DAG in which every stage has at most one successor and exactly one stage (the
    sink) has none. Nodes are kept in the order given; predecessors are listed in that order too."""

    nodes: tuple[StageNode, ...]
    edges: tuple[tuple[str, str], ...]
    _by_name: dict = field(init=False, repr=False, compare=False)
    _preds: dict = field(init=False, repr=False, compare=False)
    _succ: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        nodes, edges = tuple(self.nodes), tuple(tuple(e) for e in self.edges)
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "edges", edges)
        by_name = {}
        for node in nodes:
            if node.name in by_name:
                raise ValueError(f"duplicate stage name {node.name!r}; every stage needs a unique name")
            by_name[node.name] = node
        order = {name: i for i, name in enumerate(by_name)}
        preds = {name: [] for name in by_name}
        succ = {name: None for name in by_name}
        for src, dst in edges:
            for end in (src, dst):
                if end not in by_name:
                    raise ValueError(f"edge ({src!r}, {dst!r}) names unknown stage {end!r}; add the node first")
            if succ[src] is not None:
                raise ValueError(
                    f"stage {src!r} has two successors ({succ[src]!r}, {dst!r}); a stage feeds exactly one stage"
                )
            succ[src] = dst
            preds[dst].append(src)
        for name in preds:
            preds[name].sort(key=order.__getitem__)
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_preds", {k: tuple(v) for k, v in preds.items()})
        object.__setattr__(self, "_succ", succ)
        sinks = [name for name, s in succ.items() if s is None]
        if len(sinks) != 1:
            raise ValueError(f"a stage graph needs exactly one sink (stage without successor), found {sinks}")
        self.topological_order()  # raises on cycles
        for node in nodes:
            nxt = succ[node.name]
            if node.needs_backward and nxt is not None and not by_name[nxt].needs_backward:
                raise ValueError(
                    f"stage {node.name!r} needs backward but its successor {nxt!r} does not; "
                    "needs_backward must propagate downstream (a trainable stage makes every later stage need it)"
                )

    def node(self, name: str) -> StageNode:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown stage {name!r}; stages are {list(self._by_name)}") from None

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def predecessors(self, name: str) -> tuple[str, ...]:
        self.node(name)
        return self._preds[name]

    def successor(self, name: str) -> str | None:
        self.node(name)
        return self._succ[name]

    def successors(self, name: str) -> tuple[str, ...]:
        nxt = self.successor(name)
        return () if nxt is None else (nxt,)

    @property
    def sink(self) -> str:
        return next(name for name, s in self._succ.items() if s is None)

    def topological_order(self) -> list[str]:
        """Kahn's algorithm, ties broken by node order; raises on a cycle."""
        indegree = {name: len(p) for name, p in self._preds.items()}
        ready = deque(name for name in self._by_name if indegree[name] == 0)
        order = []
        while ready:
            name = ready.popleft()
            order.append(name)
            nxt = self._succ[name]
            if nxt is not None:
                indegree[nxt] -= 1
                if indegree[nxt] == 0:
                    ready.append(nxt)
        if len(order) != len(self._by_name):
            stuck = [n for n in self._by_name if n not in order]
            raise ValueError(f"stage graph has a cycle through {stuck}; pipelines must flow one way")
        return order

    def depth(self, name: str) -> int:
        """Number of edges on the (unique, hence longest) path from `name` to the sink."""
        steps, cur = 0, self.successor(name)
        while cur is not None:
            steps, cur = steps + 1, self._succ[cur]
        return steps


def _check_build_args(encoder_stages: dict[str, int], llm_stages: int, placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown encoder placement {placement!r}; use one of {PLACEMENTS}")
    if not isinstance(llm_stages, int) or llm_stages < 1:
        raise ValueError(f"llm_stages must be an int >= 1, got {llm_stages!r}")
    for enc, count in encoder_stages.items():
        if enc in (LANGUAGE_MODEL, COLOCATED_ENCODERS) or "." in enc or not enc:
            raise ValueError(
                f"encoder name {enc!r} is reserved or contains '.'; rename it (not 'language_model'/'encoders')"
            )
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"encoder {enc!r} needs an int stage count >= 1, got {count!r}")
    if placement == "colocated" and len(set(encoder_stages.values())) > 1:
        raise ValueError(
            f"colocated placement fuses encoders stage by stage, so every encoder needs the same stage count; "
            f"got {encoder_stages}. Give them equal pp or use placement='parallel'"
        )


def _stage_sources(encoder_stages: dict[str, int], llm_stages: int, placement: str) -> dict[str, list[str]]:
    """For each graph stage (in graph order), the names in `trainable` whose parameters it holds: its own name
    and those of the module stages the placement table puts in it."""
    table = placement_table(encoder_stages, llm_stages, placement)
    return {stage: [stage] + [stage_name(m, i) for m, i in parts if stage_name(m, i) != stage]
            for stage, parts in table.items()}


def _resolve_trainable(sources: dict[str, list[str]], trainable: dict[str, bool]) -> dict[str, bool]:
    known = {name for names in sources.values() for name in names}
    unknown = sorted(set(trainable) - known)
    if unknown:
        raise ValueError(f"trainable names unknown stages {unknown}; known stage names are {sorted(known)}")
    resolved = {}
    for stage, names in sources.items():
        given = [bool(trainable[n]) for n in names if n in trainable]
        if not given:
            raise ValueError(f"trainable has no entry for stage {stage!r}; add trainable[{stage!r}] = True/False")
        resolved[stage] = any(given)
    return resolved


def build_stage_graph(
    encoder_stages: dict[str, int], llm_stages: int, placement: str, trainable: dict[str, bool]
) -> StageGraph:
    """Build the stage DAG for a placement.

    parallel: every encoder is its own chain into language_model.0; colocated: encoders fused stage by stage
    into one chain "encoders.i"; replicated: encoders run inside language_model.0 (no encoder stages).
    `trainable[name]` says whether a stage holds a trainable parameter; for colocated/replicated the
    per-encoder names ("vision.0") may be given instead and are OR-ed into the stage that holds them.
    needs_backward = trainable here or anywhere upstream (003 Eq. 3.3 at stage granularity).
    """
    _check_build_args(encoder_stages, llm_stages, placement)
    sources = _stage_sources(encoder_stages, llm_stages, placement)
    own = _resolve_trainable(sources, trainable)
    names = list(sources)
    edges = []
    chain_ends = []
    for prev, cur in zip(names, names[1:]):
        if prev.split(".")[0] == cur.split(".")[0]:
            edges.append((prev, cur))
        elif not prev.startswith(LANGUAGE_MODEL + "."):
            chain_ends.append(prev)
    first_llm = stage_name(LANGUAGE_MODEL, 0)
    edges += [(end, first_llm) for end in chain_ends]
    upstream = {name: False for name in names}
    needs = {}
    for name in names:  # names are topologically ordered by construction
        needs[name] = own[name] or upstream[name]
        for src, dst in edges:
            if src == name:
                upstream[dst] = upstream[dst] or needs[name]
    nodes = [StageNode(n, n.rsplit(".", 1)[0], int(n.rsplit(".", 1)[1]), needs[n]) for n in names]
    return StageGraph(nodes, edges)


def _forward_actions(graph: StageGraph, stage: str, mb: int) -> list[Action]:
    recvs = [Action("recv_fwd", mb, p) for p in graph.predecessors(stage)]
    nxt = graph.successor(stage)
    send = [] if nxt is None else [Action("send_fwd", mb, nxt)]
    return recvs + [Action("forward", mb)] + send


def _backward_actions(graph: StageGraph, stage: str, mb: int) -> list[Action]:
    nxt = graph.successor(stage)
    recv = [] if nxt is None else [Action("recv_bwd", mb, nxt)]
    sends = [Action("send_bwd", mb, p) for p in graph.predecessors(stage) if graph.node(p).needs_backward]
    return recv + [Action("backward", mb)] + sends


def stage_order(depth: int, num_microbatches: int, needs_backward: bool) -> list[tuple[str, int]]:
    """The 1F1B order of ("F"|"B", microbatch) for one stage: min(depth, M) warm-up forwards, then one
    forward / one backward, then the cooldown backwards. Forward-only stages do all M forwards."""
    m = num_microbatches
    if not needs_backward:
        return [("F", i) for i in range(m)]
    warmup = min(depth, m)
    order = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(m - warmup, m)]
    return order


def one_f_one_b(graph: StageGraph, num_microbatches: int, deferred: tuple[int, ...] = ()) -> dict[str, list[Action]]:
    """1F1B action lists over the stage DAG, one list per stage (graph node order).

    ``deferred``: microbatches ``m`` whose LLM work is partly run with microbatch ``m + 1`` (Entrain's deferral).
    The stage that receives the encoders' features keeps them, and sends their gradients back to the encoders
    only after the backward of ``m + 1``. Encoder stages then warm up with one forward more (Entrain's eager
    forward), so that the later gradient does not stall them; every other action stays where 1F1B puts it."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    bad = [m for m in deferred if not 0 <= m < num_microbatches - 1]
    if bad:
        raise ValueError(f"deferred microbatches {bad} have no next microbatch among 0..{num_microbatches - 1}")
    schedule = {}
    for node in graph.nodes:
        actions, held = [], []
        feeds = node.name == stage_name(LANGUAGE_MODEL, 0)  # where the encoders' features arrive
        eager = 1 if deferred and node.module != LANGUAGE_MODEL else 0
        for step, mb in stage_order(graph.depth(node.name) + eager, num_microbatches, node.needs_backward):
            build = _forward_actions if step == "F" else _backward_actions
            acts = build(graph, node.name, mb)
            if step == "B" and feeds:
                later = [a for a in acts if a.kind == "send_bwd" and mb in deferred]
                acts = [a for a in acts if a not in later]
                if mb - 1 in deferred:
                    acts, held = acts[:acts.index(Action("backward", mb)) + 1] + held + acts[
                        acts.index(Action("backward", mb)) + 1:], []
                held += later
            actions += acts
        schedule[node.name] = actions
    return schedule


class ScheduleError(RuntimeError):
    """An action list that would deadlock, lose a message or miss/duplicate a computation."""


def _check_peer(graph: StageGraph, stage: str, action: Action, where: str) -> None:
    preds, nxt = graph.predecessors(stage), graph.successor(stage)
    kind, peer = action.kind, action.peer
    if kind in ("forward", "backward"):
        ok = peer is None
    elif kind == "recv_fwd":
        ok = peer in preds
    elif kind == "send_bwd":
        ok = peer in preds and graph.node(peer).needs_backward
    else:  # send_fwd, recv_bwd
        ok = peer is not None and peer == nxt
    if not ok:
        raise ScheduleError(f"{where}: peer {peer!r} is not valid for {kind} (predecessors {preds}, successor {nxt!r})")
    if kind in ("recv_bwd", "backward", "send_bwd") and not graph.node(stage).needs_backward:
        raise ScheduleError(f"{where}: stage {stage!r} needs no backward but its list has {kind}")


class _StageState:
    """What one simulated stage has received and computed so far."""

    def __init__(self):
        self.got_fwd: dict[int, set[str]] = {}
        self.got_bwd: set[int] = set()
        self.forwarded: set[int] = set()
        self.backwarded: set[int] = set()


def _apply(graph, stage, action, state, where) -> None:
    """Check one compute/send action's data dependencies and record it."""
    mb, kind = action.microbatch, action.kind
    if kind == "forward":
        missing = set(graph.predecessors(stage)) - state.got_fwd.get(mb, set())
        if missing:
            raise ScheduleError(f"{where}: forward before receiving microbatch {mb} from {sorted(missing)}")
        if mb in state.forwarded:
            raise ScheduleError(f"{where}: duplicate forward of microbatch {mb}")
        state.forwarded.add(mb)
    elif kind == "backward":
        if mb not in state.forwarded:
            raise ScheduleError(f"{where}: backward of microbatch {mb} before its forward")
        if graph.successor(stage) is not None and mb not in state.got_bwd:
            raise ScheduleError(f"{where}: backward before receiving the gradient of microbatch {mb}")
        if mb in state.backwarded:
            raise ScheduleError(f"{where}: duplicate backward of microbatch {mb}")
        state.backwarded.add(mb)
    elif kind == "send_fwd" and mb not in state.forwarded:
        raise ScheduleError(f"{where}: sends microbatch {mb} forward before computing it")
    elif kind == "send_bwd" and mb not in state.backwarded:
        raise ScheduleError(f"{where}: sends the gradient of microbatch {mb} before its backward")


def _receive(channels, stage, action, state, where) -> bool:
    """Take a message off its FIFO channel; False if none has been sent yet (the stage blocks)."""
    direction = "fwd" if action.kind == "recv_fwd" else "bwd"
    queue = channels.get((action.peer, stage, direction))
    if not queue:
        return False
    got = queue.popleft()
    if got != action.microbatch:
        raise ScheduleError(f"{where}: expected microbatch {action.microbatch} but the next message is {got}")
    if direction == "fwd":
        state.got_fwd.setdefault(got, set()).add(action.peer)
    else:
        state.got_bwd.add(got)
    return True


def check_schedule(graph: StageGraph, actions: dict[str, list[Action]], num_microbatches: int) -> int:
    """Run the action lists with blocking receives and non-blocking sends; raise ScheduleError on deadlock,
    unmatched messages, wrong peers, broken data dependencies, or a missing/duplicated forward/backward.
    Returns the number of actions executed."""
    if set(actions) != set(graph.names):
        raise ScheduleError(f"action lists are for {sorted(actions)} but the graph has stages {sorted(graph.names)}")
    for stage, acts in actions.items():
        for pos, action in enumerate(acts):
            _check_peer(graph, stage, action, f"stage {stage!r} action {pos} {action}")
    channels: dict[tuple[str, str, str], deque] = {}
    states = {stage: _StageState() for stage in actions}
    cursor = {stage: 0 for stage in actions}
    progressed, executed = True, 0
    while progressed:
        progressed = False
        for stage, acts in actions.items():
            while cursor[stage] < len(acts):
                action = acts[cursor[stage]]
                where = f"stage {stage!r} action {cursor[stage]} {action}"
                if action.kind.startswith("recv"):
                    if not _receive(channels, stage, action, states[stage], where):
                        break
                else:
                    _apply(graph, stage, action, states[stage], where)
                    if action.kind.startswith("send"):
                        key = (stage, action.peer, action.kind[-3:])
                        channels.setdefault(key, deque()).append(action.microbatch)
                cursor[stage] += 1
                executed += 1
                progressed = True
    blocked = [f"{s!r} at action {cursor[s]} {actions[s][cursor[s]]}" for s in actions if cursor[s] < len(actions[s])]
    if blocked:
        raise ScheduleError("deadlock: blocked receives with no matching send: " + "; ".join(blocked))
    leftover = [f"{src!r}->{dst!r} {d} microbatches {list(q)}" for (src, dst, d), q in channels.items() if q]
    if leftover:
        raise ScheduleError("sends without a matching receive: " + "; ".join(leftover))
    everything = set(range(num_microbatches))
    for stage, state in states.items():
        if state.forwarded != everything:
            raise ScheduleError(f"stage {stage!r} forwards microbatches {sorted(state.forwarded)}, expected 0..{num_microbatches - 1}")
        expected = everything if graph.node(stage).needs_backward else set()
        if state.backwarded != expected:
            raise ScheduleError(f"stage {stage!r} runs backward for {sorted(state.backwarded)}, expected {sorted(expected)}")
    return executed


def communication_groups(actions: list[Action]) -> list[list[Action]]:
    """The stage's action list cut into steps: each compute action alone, each run of consecutive send/receive
    actions as one group (the runtime posts a group together, as one ``batch_isend_irecv``)."""
    steps: list[list[Action]] = []
    for action in actions:
        comm = action.kind not in ("forward", "backward")
        if comm and steps and steps[-1][0].kind not in ("forward", "backward"):
            steps[-1].append(action)
        else:
            steps.append([action])
    return steps


def check_rendezvous(actions: dict[str, list[Action]], grouped: bool = True) -> None:
    """Raise ScheduleError unless the grouped action lists complete when a send completes only once its receive
    is posted and vice versa (NCCL's rendezvous; stricter than ``check_schedule``'s buffered sends).

    The k-th send on a channel (src, dst, direction) matches the k-th receive on it. A group completes once every
    one of its operations is matched by an operation the peer has posted: in the peer's current group or done.
    ``grouped=False`` posts every action alone (what plain blocking ``send``/``recv`` would do)."""
    steps = {stage: communication_groups(acts) if grouped else [[a] for a in acts] for stage, acts in actions.items()}
    ops: dict[str, list[list[tuple]]] = {}
    for stage, groups in steps.items():
        counters: dict[tuple, int] = {}
        ops[stage] = []
        for group in groups:
            keyed = []
            for a in group:
                if a.kind in ("forward", "backward"):
                    continue
                direction = "fwd" if a.kind.endswith("fwd") else "bwd"
                sending = a.kind.startswith("send")
                channel = (stage, a.peer, direction) if sending else (a.peer, stage, direction)
                n = counters.get((channel, sending), 0)
                counters[(channel, sending)] = n + 1
                keyed.append((channel, n, sending))
            ops[stage].append(keyed)
    cursor = {stage: 0 for stage in steps}
    done: set[tuple] = set()

    def posted(channel, n, sending):
        peer = channel[1] if sending else channel[0]
        mine = (channel, n, not sending)
        return mine in done or (cursor[peer] < len(ops[peer]) and mine in ops[peer][cursor[peer]])

    progressed = True
    while progressed:
        progressed = False
        for stage in steps:
            while cursor[stage] < len(ops[stage]):
                group = ops[stage][cursor[stage]]
                if not all(posted(*op) for op in group):
                    break
                done.update(group)
                cursor[stage] += 1
                progressed = True
    blocked = [f"{s!r} at {steps[s][cursor[s]]}" for s in steps if cursor[s] < len(steps[s])]
    if blocked:
        raise ScheduleError("deadlock under rendezvous sends: " + "; ".join(blocked))
