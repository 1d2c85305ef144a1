"""Fault handling: a rank that dies (killed, out of memory, exception) ends every other rank in bounded time.

Without this, the survivors of a dead rank wait inside a gloo/NCCL collective until the process-group timeout
(10 minutes by default). :class:`FaultWatchdog` runs a daemon thread on every rank, beside the training, over its
own connection to the rendezvous TCPStore (``MASTER_ADDR:MASTER_PORT``, served by rank 0):

- every ``interval`` seconds it bumps this rank's heartbeat counter and reads everyone else's;
- a counter that has not moved for ``timeout`` seconds means that rank is dead or wedged;
- a rank that raises publishes ``failed`` (see :meth:`report_failure`), so its peers stop at the next beat;
- a store that cannot be reached means rank 0 (its host) died.

A collective that fails because a peer vanished (gloo sees the closed socket of a killed process at once) first
waits up to ``timeout`` for the watchdog to name the lost rank (:meth:`blame`), so the error says who died.

On any of these it prints ``lightning-mm fault: ...`` naming the rank and ends the process with
``FAULT_EXIT_CODE`` (the main thread may be blocked inside a collective, so it cannot be interrupted politely).
Checkpoints are written atomically (``lightning_mm.checkpoint``), so the last completed one stays loadable.
A normal end goes through :meth:`finish`: every rank waits (bounded) for all others to finish, so rank 0 never
takes the store down while a peer still watches it.

A rank can also be alive (heartbeats keep coming) but stuck: in a long sleep, a user hook that waits forever, a
collective that only some ranks entered. The runtime marks every blocking collective and P2P wait with
:func:`waiting` (a context manager: the operation, the peer it waits on or the group it waits with); the
watchdog publishes that record at each beat. When this rank has been inside one wait longer than ``timeout``,
it follows "who waits on whom" through the published records to the rank that is alive but not waiting on
anything, and ends every process with a message naming that rank, its pipeline stage and the wait that timed out;
the stuck rank also prints where its main thread is. If every rank on the path waits (a collective entered by
only some ranks, mismatched operations), the message lists each rank's wait instead. No rank ends before every
stuck rank has printed its stack (bounded): a launcher kills the other ranks as soon as one ends (Lightning's
child-process observer within 5 s, torchrun's agent), which would lose that stack.

Not every wait can be marked: FSDP's all-gathers and reduce-scatters are asynchronous and waited for inside torch,
on the main or the autograd thread. For those, torch's flight recorder (on gloo and NCCL: every collective a
process group issues, with its sequence number, operation and sizes) tells where a run stands. The strategy calls
:meth:`FaultWatchdog.progress` at every step; a rank that has made no progress for ``timeout`` (or has waited
that long in a marked wait) asks every rank to publish the last collective of each of its process groups
(``probe``, answered at the next beat: nothing is read while steps complete). Members of a group issue its
collectives in the same order, so when two rounds of answers agree and a group's members stand at different
sequence numbers, the collective the ones ahead wait in is one the others never entered: every rank ends with a
message naming that collective, its group, and the ranks (with their stage) that did not arrive.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

FAULT_EXIT_CODE = 75  # EX_TEMPFAIL: resume from the last checkpoint
PREFIX = "lightning_mm/faults"


def default_store(timeout: float):
    """A fresh client of the rendezvous TCPStore named by ``MASTER_ADDR`` / ``MASTER_PORT``."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError("fault detection needs MASTER_ADDR and MASTER_PORT (set by Lightning, torchrun or "
                           "SLURM launches); pass fault_timeout=None to disable it")
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


LAUNCHER_ENV = "LMM_LAUNCHER_PID"  # set by lightning_mm.trainer.launch.CheckedLauncher for the ranks it spawns


def parent_death_signal(sig: int) -> None:
    """Linux: ask the kernel to send ``sig`` to this process when its parent dies (0: withdraw the request)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


def write_fault(message: str) -> None:
    sys.stderr.write(f"lightning-mm fault: {message}\n")
    sys.stderr.flush()


def exit_process(message: str) -> None:
    write_fault(message)
    os._exit(FAULT_EXIT_CODE)


@contextmanager
def launched_ranks_watched(procs: list, first_rank: int = 1, interval: float = 0.5, on_fault=exit_process):
    """While the process group forms: end this process if a rank it launched (Lightning's subprocess launcher:
    ``procs[i]`` is local rank ``first_rank + i``) has already exited. Rank 0 otherwise waits in the rendezvous
    until the process-group timeout, where no signal reaches it."""
    done = threading.Event()

    def watch():
        while not done.wait(interval):
            for i, proc in enumerate(procs):
                code = proc.poll()
                if code is not None:
                    on_fault(f"local rank {first_rank + i} (pid {proc.pid}) exited with code {code} before every rank "
                             "joined the process group (its own output above says why)")
                    return

    thread = threading.Thread(target=watch, name="lightning-mm-launch-watch", daemon=True)
    if procs:
        thread.start()
    try:
        yield
    finally:
        done.set()


# ------------------------------------------------------------------------------------------------ waits
@dataclass(frozen=True)
class Wait:
    """One blocking wait of the training thread: ``operation`` (e.g. "recv", "all_reduce"), the ``peer`` rank a
    P2P wait depends on, or the ``group`` a collective waits with (a process group, a list of global ranks, or
    None for every rank), entered at ``since`` (``time.monotonic()``)."""

    operation: str
    peer: int | None
    group: object
    since: float

    def ranks(self, world: int) -> list[int]:
        """The global ranks this wait depends on."""
        if self.peer is not None:
            return [int(self.peer)]
        if self.group is None:
            return list(range(world))
        if isinstance(self.group, (list, tuple, range)):
            return [int(r) for r in self.group]
        return list(dist.get_process_group_ranks(self.group))


class WaitRecord:
    """What the training thread is blocked in right now (``current``; None outside any wait)."""

    def __init__(self):
        self.current: Wait | None = None

    @contextmanager
    def waiting(self, operation: str, peer: int | None = None, group=None):
        outer, self.current = self.current, Wait(operation, peer, group, time.monotonic())
        try:
            yield
        finally:
            self.current = outer


WAITS = WaitRecord()  # the process's training thread (what the strategy's watchdog reads)


def waiting(operation: str, peer: int | None = None, group=None):
    """Mark a blocking collective or P2P wait for the stuck-rank watchdog::

        with waiting("recv", peer=src):                       # P2P: waits on one global rank
            dist.recv(t, src)
        with waiting("all_reduce", group=pg):                 # collective: a process group, a rank list, None = all
            dist.all_reduce(t, group=pg)

    Costs one object per call; without a watchdog nothing reads it."""
    return WAITS.waiting(operation, peer, group)


C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")


def c10d_wait(frame) -> tuple[str, object, object] | None:
    """If ``frame`` (a thread's innermost) is inside a ``torch.distributed`` call: (the call's name, the rank it
    waits on or None, its group). This sees the synchronous collectives and P2P calls nobody marked with
    :func:`waiting` (Lightning's barrier and broadcast, torchmetrics' syncs); asynchronous ``work.wait()`` needs
    the mark."""
    found = None
    while frame is not None and frame.f_code.co_filename.endswith(C10D_FILES):
        if frame.f_code.co_filename.endswith(C10D_FILES[0]):
            found = frame
        frame = frame.f_back
    if found is None:
        return None
    local = found.f_locals
    peer = local.get("src") if found.f_code.co_name in ("recv", "irecv") else None
    name = found.f_code.co_name
    if frame is not None:  # the caller outside torch.distributed
        where = "/".join(frame.f_code.co_filename.split(os.sep)[-2:])
        name += f" (called from {frame.f_code.co_name} at {where}:{frame.f_lineno})"
    return name, peer if isinstance(peer, int) else None, local.get("group")


def main_thread_stack(limit: int = 8) -> str:
    """The innermost ``limit`` frames of the main thread (what a stuck rank is doing)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "(no main thread)"
    return "".join(traceback.format_stack(frame)[-limit:]).rstrip()


FR_ENV, FR_ENTRIES = "TORCH_FR_BUFFER_SIZE", 2000


def enable_flight_recorder() -> None:
    """Keep torch's flight recorder on (``TORCH_FR_BUFFER_SIZE``; a value the user set wins). Call before the
    process groups exist: each group reads it when it is created."""
    os.environ.setdefault(FR_ENV, str(FR_ENTRIES))


def flight_records() -> list[dict]:
    """This process's flight-recorder entries (gloo's and, on CUDA builds, NCCL's); [] where torch has none."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    entries = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            entries += json.loads(dump(True, False)).get("entries", [])
        except Exception:  # noqa: BLE001  (no recorder for this backend, or nothing recorded yet)
            continue
    return entries


def group_ranks() -> dict[str, list[int]]:
    """The global ranks of every process group this rank is a member of, by group name (names agree across
    ranks: they are how a group's members rendezvous)."""
    out = {}
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        try:
            out[str(name)] = [int(r) for r in dist.get_process_group_ranks(pg)]
        except Exception:  # noqa: BLE001  (a group being destroyed)
            continue
    return out


def collective_tails(entries: list[dict] | None = None, groups: dict[str, list[int]] | None = None,
                     capacity: int | None = None) -> dict[str, dict]:
    """``{group name: {"seq", "op", "sizes", "desc", "ranks"}}``: the last collective this rank issued on each of
    its process groups (``groups``, default :func:`group_ranks`) from the flight recorder's ``entries``. ``seq`` 0:
    none yet; None: unknown (the recorder's ring buffer of ``capacity`` entries is full and dropped older ones)."""
    entries = flight_records() if entries is None else entries
    groups = group_ranks() if groups is None else groups
    capacity = int(os.environ.get(FR_ENV, FR_ENTRIES)) if capacity is None else capacity
    tails: dict[str, dict] = {}
    for e in entries:
        if e.get("is_p2p"):
            continue
        name, desc = (list(e.get("process_group") or []) + ["", ""])[:2]
        seq = int(e.get("collective_seq_id", 0))
        if seq > (tails.get(name) or {}).get("seq", -1):
            tails[name] = {"seq": seq, "op": str(e.get("profiling_name", "")).split(":")[-1],
                           "sizes": e.get("input_sizes"), "desc": desc, "created": e.get("time_created_ns")}
    full = len(entries) >= capacity > 0
    for name, ranks in groups.items():
        tails.setdefault(name, {"seq": None if full else 0, "op": None, "sizes": None, "desc": "",
                                "created": None})["ranks"] = ranks
    return {n: t for n, t in tails.items() if t.get("ranks")}


def unentered_collectives(tails: dict[int, dict[str, dict]], clocks: dict[int, int] | None = None) -> list[dict]:
    """From every rank's :func:`collective_tails`: each group whose members stand at different sequence numbers,
    as ``{"group", "desc", "ranks", "seq", "op", "sizes", "entered", "behind": {rank: (seq, op)}, "age"}``
    (collective number ``seq`` of the group, which the ``entered`` ranks issued ``age`` seconds before their
    ``clocks`` (``time.time_ns()`` when they answered; None: unknown) and the ``behind`` ones did not), in the
    order they were issued."""
    found = []
    for name in sorted({n for t in tails.values() for n in t}):
        ranks = next(t[name]["ranks"] for t in tails.values() if name in t)
        if any(name not in tails.get(r, {}) or tails[r][name]["seq"] is None for r in ranks):
            continue  # a member without an answer, or one whose recorder lost this group's entries
        seqs = {r: tails[r][name]["seq"] for r in ranks}
        top = max(seqs.values())
        if min(seqs.values()) == top:
            continue
        entered = [r for r in ranks if seqs[r] == top]
        head = tails[entered[0]][name]
        found.append({"group": name, "desc": head["desc"], "ranks": ranks, "seq": top, "op": head["op"],
                      "sizes": head["sizes"], "entered": entered,
                      "behind": {r: (seqs[r], tails[r][name]["op"]) for r in ranks if seqs[r] < top},
                      "created": head.get("created") or 0})
        clock = (clocks or {}).get(entered[0])
        found[-1]["age"] = (clock - head["created"]) / 1e9 if clock and head.get("created") else None
    return sorted(found, key=lambda f: f["created"])


def unentered_message(found: list[dict], answers: dict[int, dict], label, world: int,
                      timeout: float) -> tuple[str, list[int]]:
    """The fault message for :func:`unentered_collectives` ``found`` and every rank's answer
    (its marked wait, how long since its last step), and the ranks that did not arrive. Ranks behind that wait on
    nothing lightning-mm marks are called stuck (the stuck-rank message); otherwise the collectives lead."""
    behind = sorted({r for f in found for r in f["behind"]})
    free = [r for r in behind if not answers[r]["wait"]]

    def collective(f: dict) -> str:
        who = "every rank" if len(f["ranks"]) == world else f"ranks {f['ranks']}"
        desc = f" '{f['desc']}'" if f["desc"] and f["desc"] != "undefined" else ""
        sizes = f" (input sizes {f['sizes']})" if f["sizes"] else ""
        return f"{f['op']} #{f['seq']} of the process group{desc} of {who}{sizes}"

    def last(r: int, f: dict) -> str:
        seq, op = f["behind"][r]
        return f"{label(r)} (its last there: {f'{op} #{seq}' if seq else 'none'})"

    def ago(f: dict) -> str:
        return "" if f["age"] is None else f" {f['age']:.1f} s ago"

    waits = [f"{label(r)} has waited {a['waited']:.1f} s in {a['wait']}" for r, a in sorted(answers.items())
             if a["wait"] and r not in free]
    idle = min(a["idle"] for a in answers.values())
    tail = (f", while {'; '.join(waits)}" if waits else "") + (f"; no rank has begun or ended a step for {idle:.1f} s "
                                                             f"(fault_timeout={timeout:g} s)")
    if free and len(free) == len(behind):
        names = ", ".join(label(r) for r in free)
        entered = "; ".join(f"{collective(f)} (entered by {', '.join(label(r) for r in f['entered'])})" for f in found)
        return (f"{names} {'is' if len(free) == 1 else 'are'} stuck: alive (heartbeats) but not in any collective or "
                f"P2P wait that lightning-mm tracks, and never entered {entered}{tail}"), behind
    parts = [f"{collective(f)} was entered{ago(f)} by {', '.join(label(r) for r in f['entered'])} but not by "
             f"{', '.join(last(r, f) for r in f['behind'])}" for f in found]
    return f"a collective that not every rank entered: {'; '.join(parts)}{tail}", behind


def rank_labels(layout) -> dict[int, str]:
    """``{rank: "stage S"}`` (with dp / cp / tp coordinates where those are > 1) from a RankLayout."""
    out = {}
    for r in range(layout.world_size):
        c = layout.coordinate(r)
        extra = ([f"dp {c.dp}"] if layout.dp > 1 else []) + ([f"cp {c.cp}"] if layout.cp[c.stage] > 1 else []) + (
            [f"tp {c.tp}"] if layout.tp[c.stage] > 1 else [])
        out[r] = f"stage {c.stage}" + (f", {', '.join(extra)}" if extra else "")
    return out


class FaultWatchdog:
    """Heartbeat and stuck-wait monitor for ``world`` ranks; ``on_fault(message)`` runs once when a peer is lost
    or stuck (None: write it to stderr and end the process with ``FAULT_EXIT_CODE``). ``labels`` names each rank's
    place (``rank_labels(layout)``) in messages; ``waits`` is the record of this rank's training thread (default:
    the process's, set by :func:`waiting`)."""

    def __init__(self, rank: int, world: int, timeout: float = 60.0, interval: float | None = None,
                 store=None, on_fault=None, run_id: str = "0", labels: dict[int, str] | None = None,
                 waits: WaitRecord = WAITS):
        if timeout <= 0:
            raise ValueError(f"fault_timeout must be > 0 seconds (or None to disable), got {timeout}")
        self.rank, self.world, self.timeout = rank, world, float(timeout)
        self.interval = interval if interval is not None else min(1.0, self.timeout / 5)
        self.store = store if store is not None else default_store(self.timeout)
        self.on_fault, self.prefix = on_fault, f"{PREFIX}/{run_id}"
        self.labels, self.waits = dict(labels or {}), waits
        self._c10d: tuple | None = None  # (frame id, name, since) of an unmarked torch.distributed call seen
        self._suspects: tuple | None = None  # (stuck ranks, their heartbeat counters) found by the last check
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired = False
        self._published: Wait | None | bool = False  # the wait last written to the store (False: nothing yet)
        self._progress_at = time.monotonic()  # the last step begun or ended on this rank (``progress``)
        self._answered = 0  # the last probe this rank answered
        self._probe: int | None = None  # the probe this rank asked, while it sees no progress
        self._round: dict | None = None  # the collective tails of the last complete round of answers
        self._clear = False  # two rounds agreed and found no collective that only some ranks entered

    def progress(self) -> None:
        """A step began or ended on this rank (the strategy calls this): restarts the no-progress clock."""
        self._progress_at = time.monotonic()

    def label(self, rank: int) -> str:
        return f"rank {rank}" + (f" ({self.labels[rank]})" if rank in self.labels else "")

    def key(self, what: str) -> str:
        return f"{self.prefix}/{what}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FaultWatchdog":
        self.store.add(self.key(f"beat/{self.rank}"), 1)
        if os.environ.get(LAUNCHER_ENV, str(os.getpid())) != str(os.getpid()):
            parent_death_signal(0)  # a lost launcher (rank 0) is now reported by name, not killed silently
        self._thread = threading.Thread(target=self._run, name="lightning-mm-fault-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval + 1)

    def report_failure(self, exc: BaseException) -> None:
        """Tell every peer this rank failed (they stop at their next beat); stops this rank's watchdog."""
        self.stop()
        try:
            self.store.set(self.key("failed"), f"rank {self.rank} raised {type(exc).__name__}: {exc}"[:2000])
        except Exception:  # noqa: BLE001  (the store host may be the one that died)
            return
        self._seen_failure()

    def blame(self, seconds: float) -> bool:
        """After a communication error: give the heartbeat thread up to ``seconds`` to name the lost rank (its
        ``on_fault`` ends the process). True if it did."""
        deadline = time.monotonic() + seconds
        while not self._fired and not self._stop.is_set() and time.monotonic() < deadline:
            time.sleep(self.interval / 4)
        if self._fired and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()  # it ends this process once the stuck ranks' stacks are out (its waits are bounded)
        return self._fired

    def finish(self) -> None:
        """Normal end: wait (bounded by the fault checks) until every rank has finished, then stop."""
        if self._thread is None or self._stop.is_set():
            return
        self.store.add(self.key("done"), 1)
        while not self._stop.is_set() and int(self.store.add(self.key("done"), 0)) < self.world:
            time.sleep(self.interval / 4)
        self.store.add(self.key("released"), 1)
        if self.rank == 0:  # the store's host leaves last, so no peer finds it gone while still reading it
            deadline = time.monotonic() + self.timeout
            while int(self.store.add(self.key("released"), 0)) < self.world and time.monotonic() < deadline:
                time.sleep(self.interval / 4)
        self.stop()

    # ------------------------------------------------------------------ the thread
    def _fault(self, message: str, stuck: Sequence[int] = ()) -> None:
        """Report ``message`` once and end this rank, after (bounded) every ``stuck`` rank has written its stack:
        the launcher kills the rest when one ends."""
        if self._fired or self._stop.is_set():
            return
        self._fired = True
        self._stop.set()
        (self.on_fault or write_fault)(f"{message}; stopping rank {self.rank} instead of waiting for the process-group "
                                       "timeout")
        self._stacks_written(stuck)
        if self.on_fault is None:
            os._exit(FAULT_EXIT_CODE)

    def _stacks_written(self, stuck: Sequence[int]) -> None:
        """Mark this rank's stack as written if it is in ``stuck``, then wait (bounded) until every ``stuck`` rank's
        is, or the store is gone (its host, rank 0, ended after writing its own)."""
        try:
            if self.rank in stuck:
                self.store.set(self.key(f"stack/{self.rank}"), "written")
            keys = [self.key(f"stack/{r}") for r in stuck]
            deadline = time.monotonic() + 5 * self.interval + 2
            while keys and not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(self.interval / 4)
        except Exception:  # noqa: BLE001
            pass

    def _seen_failure(self) -> None:
        """Count this rank as having read the job's failure; rank 0 (the store's host) then waits, bounded, until
        every rank has, so none of them finds the store gone instead of reading why."""
        try:
            self.store.add(self.key("seen"), 1)
            if self.rank == 0:
                deadline = time.monotonic() + 5 * self.interval + 2
                while int(self.store.add(self.key("seen"), 0)) < self.world and time.monotonic() < deadline:
                    time.sleep(self.interval / 4)
        except Exception:  # noqa: BLE001
            pass

    def _with_stack(self, message: str, stuck: list[int]) -> str:
        """``message``, with this rank's main thread stack when it is one of the ``stuck`` ranks."""
        if self.rank not in stuck:
            return message
        return f"{message}; {self.label(self.rank)}'s main thread is at:\n{main_thread_stack()}\n"

    def _end_all(self, message: str, stuck: list[int]) -> None:
        """Publish ``message`` as the job's failure (every peer ends at its next beat), then end this rank. The
        ``stuck`` ranks add their main thread's stack to it."""
        try:
            self.store.set(self.key("stuck"), json.dumps(stuck))
            self.store.set(self.key("failed"), message[:4000])
        except Exception:  # noqa: BLE001
            pass
        message = self._with_stack(message, stuck)
        self._seen_failure()
        self._fault(message, stuck)

    def current_wait(self) -> Wait | None:
        """The training thread's wait: the one marked with :func:`waiting`, else (for the process's own record)
        a ``torch.distributed`` call its main thread is inside, timed from the first beat that saw it."""
        wait = self.waits.current
        if wait is not None or self.waits is not WAITS:
            return wait
        frame = sys._current_frames().get(threading.main_thread().ident)
        found = c10d_wait(frame) if frame is not None else None
        if found is None:
            self._c10d = None
            return None
        name, peer, group = found
        key = (id(frame), name)
        if self._c10d is None or self._c10d[0] != key:
            self._c10d = (key, Wait(name, peer, group, time.monotonic()))
        return self._c10d[1]

    def _publish_wait(self) -> None:
        """Write this rank's current wait to the store when it changed since the last beat."""
        wait = self.current_wait()
        if wait is self._published:
            return
        record = "" if wait is None else json.dumps({"op": wait.operation, "peer": wait.peer,
                                                      "ranks": wait.ranks(self.world)})
        self.store.set(self.key(f"wait/{self.rank}"), record)
        self._published = wait

    def _read_waits(self) -> dict[int, dict | None]:
        out = {}
        for r in range(self.world):
            key = self.key(f"wait/{r}")
            raw = self.store.get(key).decode() if self.store.check([key]) else ""
            out[r] = json.loads(raw) if raw else None
        return out

    def describe_wait(self, record: dict) -> str:
        if record["peer"] is not None:
            return f"{record['op']} from {self.label(record['peer'])}"
        ranks = record["ranks"]
        who = "every rank" if len(ranks) == self.world else f"ranks {ranks}"
        return f"{record['op']} with {who}"

    def stuck_ranks(self, waits: dict[int, dict | None]) -> tuple[list[int], list[int]]:
        """Follow "who waits on whom" from this rank: (ranks reached that wait on nothing, ranks reached that
        wait), in the order found."""
        stuck, waiting_ranks, queue, seen = [], [], [self.rank], {self.rank}
        while queue:
            r = queue.pop(0)
            if waits.get(r) is None:
                stuck.append(r)
                continue
            waiting_ranks.append(r)
            for peer in waits[r]["ranks"]:
                if peer not in seen:
                    seen.add(peer)
                    queue.append(peer)
        return stuck, waiting_ranks

    def _answer_probe(self) -> None:
        """When a peer asked (``probe``), publish this rank's last collective on each of its process groups, its
        marked wait and how long it has gone without a step."""
        probe = int(self.store.add(self.key("probe"), 0))
        if probe <= self._answered:
            return
        wait, now = self.current_wait(), time.monotonic()
        record = {"probe": probe, "tails": collective_tails(), "idle": now - self._progress_at,
                  "wait": None if wait is None else self.describe_wait(
                      {"op": wait.operation, "peer": wait.peer, "ranks": wait.ranks(self.world)}),
                  "waited": 0.0 if wait is None else now - wait.since, "clock_ns": time.time_ns()}
        self.store.set(self.key(f"collectives/{self.rank}"), json.dumps(record))
        self._answered = probe

    def _check_collectives(self, now: float) -> bool:
        """No step on this rank for the timeout, or a marked wait that long: ask every rank for its last
        collectives (a round), and when two complete rounds in a row agree and show a collective that only some
        members of its group entered, longer than the timeout ago, end every process naming it. True if it fired."""
        wait = self.current_wait()
        if (wait is None or now - wait.since <= self.timeout) and now - self._progress_at <= self.timeout:
            self._probe, self._round, self._clear = None, None, False
            return False
        if self._probe is not None:
            keys = [self.key(f"collectives/{r}") for r in range(self.world)]
            if not self.store.check(keys):
                return False
            answers = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)}
            if any(a["probe"] < self._probe for a in answers.values()):
                return False
            previous, self._round = self._round, {r: a["tails"] for r, a in answers.items()}
            if previous == self._round:
                found = unentered_collectives(self._round, {r: a["clock_ns"] for r, a in answers.items()})
                if any(f["age"] is None or f["age"] > self.timeout for f in found):
                    message, behind = unentered_message(found, answers, self.label, self.world, self.timeout)
                    self._end_all(message, behind)  # the ranks that did not arrive print where they are
                    return True
                self._clear = not found  # else: a collective entered too recently to judge yet
        self._probe = int(self.store.add(self.key("probe"), 1))
        return False

    def _check_wait(self, now: float, last_value: dict[int, int]) -> bool:
        """If this rank has waited longer than the timeout: find the stuck rank, end every process. True if it
        fired. A rank is named stuck only when two checks in a row find it and its heartbeat moved in between
        (a killed or frozen rank stops beating: the heartbeat check names that one)."""
        wait = self.current_wait()
        if wait is None or now - wait.since <= self.timeout:
            self._suspects = None
            return False
        waits = self._read_waits()
        waits[self.rank] = {"op": wait.operation, "peer": wait.peer, "ranks": wait.ranks(self.world)}
        stuck, waiting_ranks = self.stuck_ranks(waits)
        beats = {r: last_value.get(r, -1) for r in stuck}
        previous, self._suspects = self._suspects, (tuple(stuck), beats)
        if previous is None or previous[0] != tuple(stuck) or any(beats[r] == previous[1][r] for r in stuck
                                                                  if r != self.rank):
            return False
        mine = f"{self.label(self.rank)} has waited {now - wait.since:.1f} s in {self.describe_wait(waits[self.rank])}"
        others = [f"{self.label(r)} in {self.describe_wait(waits[r])}" for r in waiting_ranks if r != self.rank]
        tail = (f"; also waiting: {'; '.join(others)}" if others else "") + f" (fault_timeout={self.timeout:g} s)"
        if stuck:
            names = ", ".join(self.label(r) for r in stuck)
            verb = "is" if len(stuck) == 1 else "are"
            message = (f"{names} {verb} stuck: alive (heartbeats) but not in any collective or P2P wait that "
                       f"lightning-mm tracks, while {mine}{tail}")
        else:
            message = (f"ranks wait on each other (a collective or P2P operation that not every rank entered): "
                       f"{mine}{tail}")
        self._end_all(message, stuck or waiting_ranks)  # these ranks print where their main thread is
        return True

    def _run(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        last_value = {r: -1 for r in peers}
        last_change = {r: time.monotonic() for r in peers}
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self.key(f"beat/{self.rank}"), 1)
                if self.store.check([self.key("failed")]):
                    failed = self.store.get(self.key("failed")).decode()
                    has_stuck = self.store.check([self.key("stuck")])
                    stuck = json.loads(self.store.get(self.key("stuck"))) if has_stuck else []
                    failed = self._with_stack(failed, stuck)
                    self._seen_failure()
                    self._fault(failed, stuck)
                    return
                values = [int(self.store.add(self.key(f"beat/{r}"), 0)) for r in peers]
                if int(self.store.add(self.key("done"), 0)) >= self.world:
                    continue
                self._publish_wait()
                self._answer_probe()
            except Exception as e:  # noqa: BLE001
                if self._stop.is_set():
                    return
                self._fault(f"cannot reach the rendezvous store hosted by rank 0 ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}): rank 0 died or is unreachable")
                return
            now = time.monotonic()
            for r, v in zip(peers, values):
                if v != last_value[r]:
                    last_value[r], last_change[r] = v, now
                elif now - last_change[r] > self.timeout:
                    self._fault(f"rank {r} stopped sending heartbeats {now - last_change[r]:.1f} s ago (killed, out "
                                f"of memory, or hung; fault_timeout={self.timeout:g} s)")
                    return
            try:
                # a rank named stuck might wait in a collective nobody marked: the flight recorder speaks first
                if self._check_collectives(now) or (self._clear and self._check_wait(now, last_value)):
                    return
            except Exception:  # noqa: BLE001  (the store went away mid-check: the next beat reports it)
                pass


PEER_LOSS_SIGNS = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "gloo", "NCCL",
                   "Socket Timeout", "DistNetworkError")


def is_peer_loss(exc: BaseException) -> bool:
    """Whether an exception looks like a collective that broke because another rank went away."""
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, getattr(dist, "DistError", ())) or any(s in text for s in PEER_LOSS_SIGNS)


def check_finite_loss(loss, step: int, mode: str | None) -> bool:
    """NaN/inf loss guard: True to train on, False to skip this step ("skip"), raise for "stop"."""
    if mode is None:
        return True
    if mode not in ("skip", "stop"):
        raise ValueError(f"nan_guard must be None, 'skip' or 'stop', got {mode!r}")
    if bool(loss.isfinite()):
        return True
    if mode == "stop":
        raise FloatingPointError(f"the loss is {float(loss)} at step {step}: stopping (nan_guard='stop'). Lower the "
                                 "learning rate, enable gradient clipping, or resume from the last checkpoint")
    return False
