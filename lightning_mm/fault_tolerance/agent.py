"""``lightning-mm agent``: the per-node agent that decides which replica group's rendezvous this node's torchrun
joins, so that nodes move between groups (Oobleck's borrowing and merging, seed 003 §2.5).

One agent runs on every node, beside (around) torchrun, like torchelastic's own agent, never inside the trainer.
Everything it shares lives on a TCPStore that outlives the nodes (``--store``; the groups' rendezvous store can be
the same one). Keys, all under ``lmm/agent/``:

- ``count`` and ``name/<i>``: registration (an agent adds 1 to ``count`` and writes its name at that index);
  ``declared/<name>``: the group it was started in.
- ``beat/<name>``: a counter the agent adds 1 to every ``interval`` seconds. Liveness is judged by whether it moves,
  on the judge's own clock (no clocks compared).
- ``leader``: JSON ``{"name", "term"}``, changed only by ``compare_set`` (one winner); ``leader_beat``: the
  leader's counter (its lease).
- ``assignment``: JSON ``{"epoch", "groups": {group: [nodes]}, "spare": [nodes], "lost": {node: beat count},
  "snapshot", "by", "term"}``, written only by the leader; ``snapshot`` (``{"epoch", "group", "path"}``, kept in
  later assignments until another replaces it) when the move restarts every group, and ``snapshot/...`` for it
  (``snapshot.py``).

The leader (any agent; the first to set ``leader``) adds new nodes to their declared group (a spare if it is full;
a group still forming waits in its rendezvous for its nodes), and whenever a node's beat stops for
``node_timeout`` seconds it runs the planner's table
(``lightning_mm.plan.reconfigure``) and writes the next assignment, epoch + 1. Every agent (the leader too) follows
the assignment: when its group changes it stops its torchrun (SIGTERM: the group's other workers fail and re-form
at their template) and starts one in the new group's rendezvous (``--rdzv-id <prefix>-group<g>``,
``LMM_REPLICA_GROUP=<g>``), which re-forms at its template and heals by name; a spare runs nothing. The global
batch is re-split by the templates at the next quorum (the training processes do that).

The agent is the node: its torchrun dies with it (parent-death signal), so a dead agent is a lost node. When the
leader dies, its beat stops; after ``lease`` seconds another agent takes ``leader`` (term + 1), waits
``node_timeout`` seconds so that every node had a chance to beat on its clock, and plans from the assignment on
the store: nothing the leader knew is lost, and no training process talks to the leader, so the other groups train
on meanwhile (the leader's own group re-forms like any group that lost a node).

With ``snapshot_dir`` the table may restart every group (a borrow between two groups): the leader asks the donor
group for a snapshot in that folder (shared storage on a cluster) before it writes the assignment; the donor's
agents stop its torchrun only once the snapshot is recorded, and no agent starts a torchrun of that assignment
before; the new groups load it at their first step (``snapshot.py``). An agent that waited ``snapshot_timeout``
seconds records it as failed (the groups that would load it then stop with an error naming it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from lightning_mm.fault_tolerance.config import parse_address
from lightning_mm.plan.reconfigure import reconfigure

log = logging.getLogger(__name__)
PREFIX = "lmm/agent/"
AGENT_STORE_ENV = "LMM_AGENT_STORE"  # the store's address, for the training processes (snapshot.py)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the agent dies (torchrun then stops its workers)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class AgentStore:
    """The agents' keys on a TCPStore (see the module docstring)."""

    def __init__(self, store):
        self.store = store

    def get(self, key: str, default=None):
        return json.loads(self.store.get(PREFIX + key)) if self.store.check([PREFIX + key]) else default

    def set(self, key: str, value) -> None:
        self.store.set(PREFIX + key, json.dumps(value))

    def counter(self, key: str, add: int = 0) -> int:
        return self.store.add(PREFIX + key, add)

    def register(self, name: str, group: int) -> None:
        self.set(f"declared/{name}", group)
        index = self.counter("count", 1) - 1
        self.set(f"name/{index}", name)

    def nodes(self) -> list[str]:
        """Registered nodes in order (one counted but not yet named is left out until it is)."""
        names = [self.get(f"name/{i}") for i in range(self.counter("count"))]
        return [n for n in names if n is not None]

    def claim_leader(self, expected: str, name: str, term: int) -> bool:
        """Atomically take ``leader`` if it still holds ``expected`` (the raw value, "" when unset)."""
        mine = json.dumps({"name": name, "term": term})
        got = self.store.compare_set(PREFIX + "leader", expected, mine)
        return (got.decode() if isinstance(got, bytes) else got) == mine

    def leader_raw(self) -> str:
        key = PREFIX + "leader"
        return self.store.get(key).decode() if self.store.check([key]) else ""


class Liveness:
    """Which counters moved within ``timeout`` seconds, on this process's clock; a counter first seen now counts
    as moved now (a new leader gives every node ``timeout`` seconds)."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.timeout, self.clock, self.seen = timeout, clock, {}

    def alive(self, key, value: int) -> bool:
        now = self.clock()
        if key not in self.seen or self.seen[key][0] != value:
            self.seen[key] = (value, now)
        return now - self.seen[key][1] < self.timeout


class Agent:
    """One node's agent: beats, takes the lead when the leader's lease lapses, plans while it leads, and runs
    ``command(group)`` (torchrun) for the group the assignment gives it. ``tick`` is one round of all of it."""

    def __init__(self, store, name: str, group: int, node_counts: Sequence[int], command: Callable[[int], list],
                 *, failures: int = 1, node_timeout: float = 10.0, lease: float = 5.0, env: dict | None = None,
                 max_relaunches: int = 3, snapshot_dir: str | None = None, snapshot_timeout: float = 300.0):
        self.s, self.name, self.group, self.counts = AgentStore(store), name, group, list(node_counts)
        self.command, self.failures, self.env, self.max_relaunches = command, failures, env, max_relaunches
        self.nodes_alive, self.leader_alive = Liveness(node_timeout), Liveness(lease)
        self.term, self.proc, self.running, self.stopping = 0, None, None, None
        self.relaunches, self.finished, self.log = 0, False, []
        self.snapshot_dir, self.snapshot_timeout, self.snapshot_since = snapshot_dir, snapshot_timeout, None
        self.s.register(name, group)

    # ------------------------------------------------------------------ leading
    def lead_or_follow(self) -> None:
        raw = self.s.leader_raw()
        current = json.loads(raw) if raw else None
        if current and current["name"] == self.name:
            self.s.counter("leader_beat", 1)
            return self.plan()
        if current is None or not self.leader_alive.alive("leader", self.s.counter("leader_beat")):
            term = (current or {"term": 0})["term"] + 1
            if self.s.claim_leader(raw, self.name, term):
                self.term, self.nodes_alive.seen = term, {}  # judge every node afresh on this clock
                self._event("leader", term=term, after=current and current["name"])
                self.s.counter("leader_beat", 1)

    def plan(self) -> None:
        """The leader's round: new nodes into their declared group, then the table if a node was lost. A lost node
        is remembered with its beat count, so that only a node that beats again is taken as new. Once a node's
        training ended (the job reached its last step) nothing moves any more: nodes that stop then are done."""
        if self.s.counter("done"):
            return
        old = self.s.get("assignment") or {"epoch": 0, "groups": {}, "spare": [], "lost": {}}
        groups, spare = {int(g): list(v) for g, v in old["groups"].items()}, list(old["spare"])
        nodes = self.s.nodes()
        beats = {n: self.s.counter(f"beat/{n}") for n in nodes}
        live = {n for n in nodes if self.nodes_alive.alive(n, beats[n])}
        lost = {n: b for n, b in old["lost"].items() if beats.get(n) == b}
        known = {n for v in groups.values() for n in v} | set(spare) | set(lost)
        for node in nodes:
            if node not in known:
                g = self.s.get(f"declared/{node}")
                (groups.setdefault(g, []) if len(groups.get(g, [])) < self.counts[-1] else spare).append(node)
        decisions, gone = [], [n for n in [*spare, *(n for v in groups.values() for n in v)] if n not in live]
        snapshot = old.get("snapshot")
        if gone:
            new = reconfigure(groups, sorted(live - set(lost), key=nodes.index), self.counts, self.failures,
                              snapshot=self.snapshot_dir is not None)
            groups, spare, decisions = dict(new.groups), list(new.spare), new.describe()
            lost.update({n: beats[n] for n in gone})
            if new.snapshot_from is not None:  # asked before the assignment names it
                epoch = old["epoch"] + 1
                snapshot = {"epoch": epoch, "group": new.snapshot_from,
                            "path": os.path.join(self.snapshot_dir, f"epoch{epoch}")}
                self.s.set(f"snapshot/request/{new.snapshot_from}", snapshot)
        nxt = {"groups": {str(g): list(v) for g, v in groups.items()}, "spare": spare, "lost": lost,
               "snapshot": snapshot}
        if nxt != {k: old.get(k) for k in nxt}:
            self.s.set("assignment", {**nxt, "epoch": old["epoch"] + 1, "by": self.name, "term": self.term})
            self._event("assignment", epoch=old["epoch"] + 1, groups=nxt["groups"], spare=spare,
                        decisions=decisions)

    # ------------------------------------------------------------------ following
    def my_group(self) -> int | None:
        a = self.s.get("assignment")
        if a is None:
            return None
        return next((int(g) for g, v in a["groups"].items() if self.name in v), None)

    def follow(self) -> None:
        """Run the assigned group's torchrun. A torchrun being stopped is waited for across rounds (the agent keeps
        beating and leading meanwhile) before another starts. While the assignment's snapshot is not recorded, the
        donor group's torchrun keeps running and none starts."""
        if self.stopping is not None and not self._stopped():
            return
        target = self.my_group()
        if self.proc is not None and self.proc.poll() is not None:
            self._exited(self.proc.returncode)
        pending = self.pending_snapshot()
        waiting = pending is not None and not self._given_up(pending)
        if self.proc is not None and target != self.running:
            if not (waiting and pending["group"] == self.running):  # the donor runs until its snapshot is recorded
                self.stop()
        elif self.proc is None and target is not None and not self.finished \
                and self.relaunches <= self.max_relaunches and not waiting:
            self.start(target)

    def pending_snapshot(self) -> dict | None:
        """The assignment's snapshot while it is not recorded yet."""
        snap = (self.s.get("assignment") or {}).get("snapshot")
        if snap is None or self.s.get(f"snapshot/done/{snap['epoch']}") is not None:
            self.snapshot_since = None
            return None
        return snap

    def _given_up(self, snap: dict) -> bool:
        """Whether this agent waited ``snapshot_timeout`` seconds for the snapshot; then it is recorded as failed
        (the donor is stopped, the others start, and the groups that would load it stop with an error naming
        it)."""
        now = time.monotonic()
        self.snapshot_since = self.snapshot_since or now
        if now - self.snapshot_since < self.snapshot_timeout:
            return False
        self.s.set(f"snapshot/done/{snap['epoch']}", {"failed": f"group {snap['group']} did not write it within "
                                                                f"{self.snapshot_timeout:g} s"})
        self._event("snapshot_failed", epoch=snap["epoch"], group=snap["group"])
        return True

    def _exited(self, code: int) -> None:
        self._event("exited", group=self.running, code=code)
        self.proc = None
        if code == 0:
            self.finished = True
            self.s.counter("done", 1)
        else:
            self.relaunches += 1

    def start(self, group: int) -> None:
        env = {**(self.env if self.env is not None else os.environ), "LMM_REPLICA_GROUP": str(group),
               "LMM_AGENT_NODE": self.name, "LMM_AGENT_PID": str(os.getpid())}
        self.proc = subprocess.Popen(self.command(group), env=env, preexec_fn=_die_with_parent)
        self.running = group
        self._event("started", group=group)

    def stop(self, grace: float = 30.0, wait: bool = False) -> None:
        """SIGTERM the torchrun (it stops its workers and leaves its rendezvous open); SIGKILL once ``grace``
        seconds passed. Without ``wait`` the next rounds wait for it to exit."""
        self.stopping, self.proc = (self.proc, time.monotonic() + grace), None
        self.stopping[0].terminate()
        while wait and not self._stopped():
            time.sleep(0.1)

    def _stopped(self) -> bool:
        proc, deadline = self.stopping
        if proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
            return False
        self.stopping = None
        self._event("stopped", group=self.running)
        return True

    def tick(self) -> None:
        self.s.counter(f"beat/{self.name}", 1)
        self.lead_or_follow()
        self.follow()

    def run(self, interval: float = 0.5) -> int:
        """Until this node's torchrun finished (0) or failed more than ``max_relaunches`` times (1)."""
        while not self.finished and self.relaunches <= self.max_relaunches:
            self.tick()
            time.sleep(interval)
        return 0 if self.finished else 1

    def _event(self, kind: str, **info) -> None:
        info = {"event": kind, "node": self.name, **info}
        self.log.append(info)
        log.warning("agent: %s", json.dumps(info))


def torchrun_command(group: int, *, counts: Sequence[int], rdzv: str, prefix: str, rest: Sequence[str],
                     last_call: float = 2.0) -> list[str]:
    """The torchrun of ``group``: an elastic rendezvous over the templates' node counts on the shared store."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{counts[0]}:{counts[-1]}",
            "--rdzv-backend", "c10d", "--rdzv-id", f"{prefix}-group{group}", "--rdzv-endpoint", rdzv,
            "--rdzv-conf", f"is_host=false,last_call_timeout={last_call:g}", *rest]


def _check_snapshot_dir(parser, folder: str) -> None:
    """``--snapshot-dir`` must be a folder this node can write (before any training starts)."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        parser.error(f"--snapshot-dir {folder} cannot be created ({e}): give a folder every node can write "
                     "(shared storage on a cluster)")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"--snapshot-dir {folder} is not writable by this node: give a folder every node can write "
                     "(shared storage on a cluster)")


def agent_main(args: list[str] | None = None) -> int:
    """``lightning-mm agent --store HOST:PORT --node NAME --group G --templates T -- <torchrun args>``."""
    args = list(sys.argv[1:] if args is None else args)
    rest = args[args.index("--") + 1:] if "--" in args else []
    p = argparse.ArgumentParser(prog="lightning-mm agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="HOST:PORT of a TCPStore that outlives the nodes")
    p.add_argument("--node", required=True, help="this node's name (unique in the job)")
    p.add_argument("--group", type=int, required=True, help="the replica group this node starts in")
    p.add_argument("--templates", required=True, help="the templates file (lightning-mm plan --templates)")
    p.add_argument("--rdzv-endpoint", default=None, help="the groups' rendezvous store (default: --store)")
    p.add_argument("--rdzv-prefix", default="lmm", help="rendezvous ids are <prefix>-group<g>")
    p.add_argument("--last-call", type=float, default=2.0,
                   help="seconds a group's rendezvous waits for more nodes once it has enough")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--node-timeout", type=float, default=10.0, help="a node whose beat stops this long is lost")
    p.add_argument("--lease", type=float, default=5.0, help="a leader whose beat stops this long is replaced")
    p.add_argument("--snapshot-dir", default=None,
                   help="a folder every node reaches (shared storage): lets a move restart every group (a borrow "
                        "between two groups) from a snapshot the donor writes there")
    p.add_argument("--snapshot-timeout", type=float, default=300.0,
                   help="seconds an agent waits for a requested snapshot before it records it as failed")
    a = p.parse_args(args[:args.index("--")] if "--" in args else args)
    if not rest:
        p.error("give torchrun's options and the training command after --, e.g. -- --nproc-per-node 8 "
                "-m lightning_mm.trainer.cli fit --config job.yaml")
    if a.snapshot_dir is not None:
        _check_snapshot_dir(p, a.snapshot_dir)
    import torch.distributed as dist

    from lightning_mm.plan.templates import Templates

    templates = Templates.load(a.templates)
    host, port = parse_address(a.store)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    counts = templates.node_counts
    command = lambda g: torchrun_command(g, counts=counts, rdzv=a.rdzv_endpoint or a.store, prefix=a.rdzv_prefix,
                                         rest=rest, last_call=a.last_call)  # noqa: E731
    agent = Agent(store, a.node, a.group, counts, command, failures=templates.failures,
                  node_timeout=a.node_timeout, lease=a.lease,
                  env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", AGENT_STORE_ENV: a.store},
                  snapshot_dir=os.path.abspath(a.snapshot_dir) if a.snapshot_dir else None,
                  snapshot_timeout=a.snapshot_timeout)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below stops torchrun
    try:
        return agent.run(a.interval)
    finally:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.stop(wait=True)
        while agent.stopping is not None and not agent._stopped():
            time.sleep(0.1)


__all__ = ["Agent", "AgentStore", "Liveness", "agent_main", "torchrun_command"]


if __name__ == "__main__":
    raise SystemExit(agent_main())
