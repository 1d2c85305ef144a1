"""A replica group ends as soon as one of its ranks ends: every rank holds a TCP connection to group rank 0, and a
connection that closes without a goodbye means that rank's process is gone.

Why: a replica group that lost a rank cannot train, but its other ranks stay alive, and group rank 0 keeps
heartbeating to the lighthouse (torchft's manager server runs in it). The other groups then wait for it inside a
cross-group collective or a quorum, and its own restart waits until its rank 0 times out in ``should_commit`` or
the watchdog's ``fault_timeout`` passes. The kernel closes a killed process's sockets at once, so the link sees the
loss within milliseconds: the group's ranks end (``FAULT_EXIT_CODE``, torchrun restarts or re-forms the group), its
heartbeats stop, and the lighthouse drops it after its heartbeat timeout. A host that vanishes without closing its
connections (power, network) is still caught by the watchdog after ``fault_timeout``.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading

import torch.distributed as dist

BYE = b"B"  # sent before a normal close: the end of training is no loss
CONNECT_S = 120.0  # every rank reached the broadcast just before: only a dead or unreachable rank takes this long


class GroupLinks:
    """This rank's link(s): rank 0 accepts one connection per other rank and watches them all; every other rank
    watches its connection to rank 0. ``on_loss(message)`` runs once when a link closes without a goodbye
    (default: write the message and end this process with ``FAULT_EXIT_CODE``)."""

    def __init__(self, rank: int, world: int, group: int, on_loss=None):
        self.rank, self.world, self.group = rank, world, group
        if on_loss is None:
            from lightning_mm.fault_tolerance.watchdog import exit_process as on_loss
        self.on_loss = on_loss
        self._socks: dict[int, socket.socket] = {}  # peer rank -> connection
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, host: str) -> "GroupLinks":
        """Connect the group (a collective of the group's default process group: every rank calls it)."""
        server = None
        if self.rank == 0:
            server = socket.create_server(("", 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                          backlog=self.world)
            server.settimeout(CONNECT_S)
        box = [server.getsockname()[1] if server is not None else None]
        dist.broadcast_object_list(box, src=0)
        if self.rank == 0:
            for _ in range(self.world - 1):
                conn, _ = server.accept()
                conn.settimeout(None)
                (peer,) = struct.unpack("!i", _recv_exact(conn, 4))
                self._socks[peer] = conn
            server.close()
        else:
            conn = socket.create_connection((host, box[0]), timeout=CONNECT_S)
            conn.settimeout(None)
            conn.sendall(struct.pack("!i", self.rank))
            self._socks[0] = conn
        dist.barrier()  # every link is up before anyone may close one
        self._thread = threading.Thread(target=self._watch, name="lightning-mm-group-links", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Normal end: say goodbye on every link, then close them."""
        self._closing.set()
        for conn in self._socks.values():
            try:
                conn.sendall(BYE)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        for peer, conn in self._socks.items():
            sel.register(conn, selectors.EVENT_READ, peer)
        open_links = set(self._socks)
        while open_links:
            for key, _ in sel.select():
                peer = key.data
                try:
                    data = key.fileobj.recv(16)
                except OSError:
                    data = b""
                if data.startswith(BYE) or self._closing.is_set():
                    sel.unregister(key.fileobj)
                    open_links.discard(peer)
                    continue
                if not data:
                    self.on_loss(f"replica group {self.group}: rank {peer}'s process ended (its link to this rank "
                                 f"closed without a goodbye); ending rank {self.rank} of the group at once, so that "
                                 "its heartbeats stop, the other replica groups go on without it after the "
                                 "lighthouse's heartbeat timeout, and its launcher restarts or re-forms it")
                    return
        sel.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("a rank closed its group link while connecting")
        out += chunk
    return out


__all__ = ["GroupLinks"]
