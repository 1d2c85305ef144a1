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
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

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


def exit_process(message: str) -> None:
    sys.stderr.write(f"lightning-mm fault: {message}\n")
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)


class FaultWatchdog:
    """Heartbeat monitor for ``world`` ranks; ``on_fault(message)`` runs once when a peer is lost."""

    def __init__(self, rank: int, world: int, timeout: float = 60.0, interval: float | None = None,
                 store=None, on_fault=exit_process, run_id: str = "0"):
        if timeout <= 0:
            raise ValueError(f"fault_timeout must be > 0 seconds (or None to disable), got {timeout}")
        self.rank, self.world, self.timeout = rank, world, float(timeout)
        self.interval = interval if interval is not None else min(1.0, self.timeout / 5)
        self.store = store if store is not None else default_store(self.timeout)
        self.on_fault, self.prefix = on_fault, f"{PREFIX}/{run_id}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired = False

    def key(self, what: str) -> str:
        return f"{self.prefix}/{what}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FaultWatchdog":
        self.store.add(self.key(f"beat/{self.rank}"), 1)
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
            pass

    def blame(self, seconds: float) -> bool:
        """After a communication error: give the heartbeat thread up to ``seconds`` to name the lost rank (its
        ``on_fault`` ends the process). True if it did."""
        deadline = time.monotonic() + seconds
        while not self._fired and not self._stop.is_set() and time.monotonic() < deadline:
            time.sleep(self.interval / 4)
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
    def _fault(self, message: str) -> None:
        if not self._fired and not self._stop.is_set():
            self._fired = True
            self._stop.set()
            self.on_fault(f"{message}; stopping rank {self.rank} instead of waiting for the process-group timeout")

    def _run(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        last_value = {r: -1 for r in peers}
        last_change = {r: time.monotonic() for r in peers}
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self.key(f"beat/{self.rank}"), 1)
                if self.store.check([self.key("failed")]):
                    failed = self.store.get(self.key("failed")).decode()
                    self._fault(f"{failed}")
                    return
                values = [int(self.store.add(self.key(f"beat/{r}"), 0)) for r in peers]
                if int(self.store.add(self.key("done"), 0)) >= self.world:
                    continue
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
