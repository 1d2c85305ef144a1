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

from lightning_mm.faults import LAUNCHER_ENV, parent_death_signal



_exit_state = {"registered": False, "failed": False}


def release_process_groups_at_exit() -> None:
    """Destroy the process groups when the interpreter exits normally (registered once per process). Left alive,
    gloo's worker threads still hold their work objects at interpreter finalisation, which can abort a rank that
    finished its job ("terminate called without an active exception"), and NCCL warns on every rank. Not after a
    failure (:func:`mark_failed`): a peer may still be waiting on this rank, and tearing down a group with work in
    flight can block."""
    if _exit_state["registered"]:
        return
    import atexit

    def release():
        import torch.distributed as dist

        if not _exit_state["failed"] and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(release)
    _exit_state["registered"] = True


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
