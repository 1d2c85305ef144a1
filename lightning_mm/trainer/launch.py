"""Launching ranks: the layout is checked before any rank is spawned, and no rank outlives its launcher.

Lightning's subprocess launcher starts local ranks 1..N-1 as copies of the command line, then every rank checks
the layout: an impossible layout printed N tracebacks, and a launcher that died before the rendezvous left its
children waiting in it. :class:`CheckedLauncher` runs the strategy's checks in the launching process first, marks
its children with ``LMM_LAUNCHER_PID``, and ends them when it raises; each child asks the kernel to kill it when
its launcher dies (Linux ``PR_SET_PDEATHSIG``) and exits at once if the launcher is already gone, until the fault
watchdog takes over (it names a lost launcher like any lost rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_mm.fault_tolerance.watchdog import LAUNCHER_ENV, parent_death_signal



_exit_state = {"registered": False, "failed": False}


def release_process_groups_at_exit() -> None:
    """At the interpreter's exit (registered once per process): destroy the process groups after a normal end, then
    let gloo's worker threads drop their finished work.

    A gloo worker thread releases each collective's tensors just after the collective completes; when the caller
    already dropped them, that release takes the GIL. If the interpreter has started finalising by then, Python
    ends the thread with a forced unwind that C++ turns into ``std::terminate`` ("terminate called without an
    active exception", SIGABRT) on a rank that finished its job. ``atexit`` runs before finalisation, so waiting
    here (GIL released) until those threads sleep closes the window; ``destroy_process_group`` alone does not stop
    them while anything still references a group. Groups are left alone after a failure (:func:`mark_failed`): a
    peer may still be waiting on this rank, and tearing down a group with work in flight can block."""
    if _exit_state["registered"]:
        return
    import atexit

    def release():
        import torch.distributed as dist

        if not _exit_state["failed"] and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        wait_for_collective_threads()

    atexit.register(release)
    _exit_state["registered"] = True


COLLECTIVE_THREAD_NAMES = ("pt_gloo_runloop",)  # the threads that run (and release) gloo's queued collectives


def collective_threads_running(task_dir: str = "/proc/self/task") -> list[str]:
    """Thread ids of this process's collective threads that are not asleep (Linux; empty elsewhere)."""
    running = []
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return running
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                if f.read().strip() not in COLLECTIVE_THREAD_NAMES:
                    continue
            with open(os.path.join(task_dir, tid, "stat")) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        if state not in ("S", "I"):
            running.append(tid)
    return running


def wait_for_collective_threads(timeout: float = 2.0, poll: float = 0.005) -> bool:
    """Sleep (GIL released) until every collective thread has been seen asleep three times in a row, at most
    ``timeout`` seconds. True when they were."""
    deadline, asleep = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        time.sleep(poll)
        asleep = asleep + 1 if not collective_threads_running() else 0
        if asleep >= 3:
            return True
    return False


def mark_failed() -> None:
    """This rank's job raised: leave its process groups to the process's end (see above)."""
    _exit_state["failed"] = True


def end_with_launcher(environ=os.environ) -> None:
    """In a rank started by :class:`CheckedLauncher`: die with the launcher. Nothing elsewhere."""
    launcher = environ.get(LAUNCHER_ENV)
    if not launcher or int(launcher) == os.getpid():
        return
    parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(launcher):  # it died before the request above could take effect
        sys.stderr.write(f"lightning-mm: the launching process (pid {launcher}) has exited; this rank "
                         f"(LOCAL_RANK={environ.get('LOCAL_RANK')}) stops instead of waiting for it\n")
        sys.stderr.flush()
        os._exit(1)


class CheckedLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with ``check()`` (the strategy's layout and device checks) run before the
    children are spawned, and the children killed when the launching process raises."""

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, check: Callable[[], object]):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.check = check
        self.grace = 10.0  # seconds the children get to end by themselves after this process raised

    def launch(self, function: Callable, *args, trainer=None, **kwargs):
        if self.cluster_environment.creates_processes_externally:
            end_with_launcher()
            return super().launch(function, *args, trainer=trainer, **kwargs)
        self.check()  # raises here, once, before any other process exists
        os.environ[LAUNCHER_ENV] = str(os.getpid())
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:
            self.end_children()
            raise

    def end_children(self) -> None:
        """Give the ranks this process spawned ``self.grace`` seconds to end (the fault watchdog stops them with
        a message naming this failure), then kill those still running."""
        deadline = time.monotonic() + self.grace
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
