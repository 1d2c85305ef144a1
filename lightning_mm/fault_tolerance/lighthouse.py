"""``lightning-mm lighthouse``: torchft's quorum service, with a banner that says how groups reach it."""

from __future__ import annotations

import signal
import socket
from urllib.parse import urlparse

from lightning_mm.fault_tolerance.config import parse_address, quiet_torchft


def lighthouse_banner(bind: str, announced: str, min_replicas: int) -> str:
    """What the lighthouse is bound to and the ``fault_tolerance.lighthouse`` value groups give to reach it
    (torchft announces this host's name, which a server bound to a loopback address does not answer on)."""
    host, port = parse_address(bind)
    if host in ("::", "0.0.0.0", ""):
        reach, where = f"{urlparse(announced).hostname or socket.gethostname()}:{port}", "every interface"
    else:
        reach, where = f"{'[' + host + ']' if ':' in host else host}:{port}", "this address only"
    return (f"lighthouse bound to {bind} ({where}), min_replicas={min_replicas}; replica groups reach it with "
            f"fault_tolerance.lighthouse={reach} (or TORCHFT_LIGHTHOUSE={reach})")


def lighthouse_main(args: list[str] | None = None) -> None:
    """``lightning-mm lighthouse``: run a torchft lighthouse (the quorum service every replica group reaches)."""
    import argparse

    parser = argparse.ArgumentParser(prog="lightning-mm lighthouse",
                                     description="the torchft lighthouse of fault-tolerant replica groups")
    parser.add_argument("--bind", default="[::]:29510", help="address to listen on (default [::]:29510)")
    parser.add_argument("--min_replicas", type=int, default=1, help="fewest replica groups a quorum has")
    parser.add_argument("--join_timeout_ms", type=int, default=60000,
                        help="how long a quorum waits for groups that heartbeat but have not asked to join")
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=5000,
                        help="a group silent this long is dead: the others go on without it")
    parser.add_argument("--quorum_tick_ms", type=int, default=20,
                        help="how often a waiting quorum is checked: groups waiting for a lost group's heartbeat "
                             "timeout get their quorum at most this long after it (default 20; torchft's 100)")
    a = parser.parse_args(args)
    quiet_torchft()
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        raise SystemExit(f"lightning-mm lighthouse needs torchft: pip install 'lightning-mm[ft]' ({e})")
    server = LighthouseServer(bind=a.bind, min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                              quorum_tick_ms=a.quorum_tick_ms, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    print(lighthouse_banner(a.bind, server.address(), a.min_replicas), flush=True)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        signal.sigwait(stop)
    finally:
        server.shutdown()
