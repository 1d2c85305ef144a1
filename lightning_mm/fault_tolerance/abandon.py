"""Abandoning a step whose cross-group reduction waits on a replica group the lighthouse has declared dead.

A cross-group collective waits for every group of the quorum. When a group dies inside the step, the survivors
learn it from the process group (a killed process's sockets close: gloo fails at once) or, when no connection
closes (a host that vanished, a group wedged before its reduction), only from the collective's ``timeout``. The
lighthouse knows sooner: it marks a group that stopped heartbeating as old after its heartbeat timeout. While the
survivors wait, they read the lighthouse's status page (torchft 0.2.0's ``/status``, the page its dashboard
shows) and abandon the wait as soon as a group of their quorum is marked old or gone; the step is then reported
failed (``Manager.report_error``) and redone by the next quorum, without the lost group.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Sequence

_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*([^\s<]+): seen ([0-9.]+)(ns|µs|us|ms|s) ago')
_UNIT = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class PeerGroupLost(RuntimeError):
    """A replica group of the step's quorum stopped heartbeating while this group waited for it (``groups``: the
    lost replica ids)."""

    def __init__(self, message: str, groups: Sequence[str] = ()):
        super().__init__(message)
        self.groups = list(groups)


def parse_heartbeats(page: str) -> dict[str, tuple[float, bool]]:
    """The lighthouse status page's heartbeats: ``{replica id: (seconds since its last heartbeat, old)}``, old
    meaning past the lighthouse's heartbeat timeout. Pure."""
    return {m[2]: (float(m[3]) * _UNIT[m[4]], bool(m[1])) for m in _HEARTBEAT.finditer(page)}


def lighthouse_heartbeats(url: str, timeout: float = 2.0) -> dict[str, tuple[float, bool]] | None:
    """The lighthouse's heartbeats (:func:`parse_heartbeats`), or None when its page cannot be read."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/status", timeout=timeout) as r:
            return parse_heartbeats(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def lost_groups(heartbeats: dict[str, tuple[float, bool]] | None, names: Sequence[str]) -> list[str]:
    """Which of ``names`` (replica ids without torchft's ``:uuid`` suffix) the lighthouse marks old or no longer
    lists; none when its page could not be read (the collective's own timeout still applies). Pure."""
    if heartbeats is None:
        return []
    alive = {rid.split(":", 1)[0] for rid, (_, old) in heartbeats.items() if not old}
    return [n for n in names if n not in alive]


def wait_or_abandon(works: Sequence, lost: Callable[[], list[str]], check_every: float = 0.1,
                    poll: float = 0.005) -> None:
    """Wait for ``works`` (``torch.distributed`` Work objects) to complete, asking ``lost()`` every
    ``check_every`` seconds which peer groups are gone; raises :class:`PeerGroupLost` naming them instead of
    waiting on. A completed work's error is raised by its ``wait`` as usual."""
    next_check = time.monotonic() + check_every
    while not all(w.is_completed() for w in works):
        now = time.monotonic()
        if now >= next_check:
            gone = lost()
            if gone:
                raise PeerGroupLost(f"replica group(s) {', '.join(gone)} stopped heartbeating to the lighthouse while "
                                    "this group waited for them in the cross-group reduction; the step is redone "
                                    "without them", gone)
            next_check = now + check_every
        time.sleep(poll)
    for w in works:
        w.wait()


__all__ = ["PeerGroupLost", "lighthouse_heartbeats", "lost_groups", "parse_heartbeats", "wait_or_abandon"]
