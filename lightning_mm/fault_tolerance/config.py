"""The fault-tolerance settings (``FaultTolerance``), their checks, and torchft's import."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time

log = logging.getLogger("lightning_mm.fault_tolerance")

REPLICA_GROUP_ENV = "LMM_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
TOKEN_KEY = "ft_step_token"


class FaultToleranceError(RuntimeError):
    """A fault-tolerance setting or situation the run cannot go on with (raised before training where possible)."""


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (also ``"http://host:port"`` and ``"[::1]:port"``) -> (host, port)."""
    text = address.strip()
    for prefix in ("http://", "https://"):
        text = text.removeprefix(prefix)
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"fault_tolerance.lighthouse must be 'host:port' (e.g. 'localhost:29510'), got {address!r}")
    return host, int(port)


@dataclasses.dataclass
class FaultTolerance:
    """Fault-tolerant data parallelism across replica groups (torchft; ``pip install lightning-mm[ft]``).

    ``lighthouse``: "host:port" of the torchft lighthouse (``lightning-mm lighthouse``; default ``$TORCHFT_LIGHTHOUSE``).
    ``replica_group``: this group's id, 0..``num_replica_groups``-1 (default ``$LMM_REPLICA_GROUP``).
    ``num_replica_groups``: how many groups the job is planned with: the global batch is the loader's batch size x
    the group's data-parallel size x this, whatever groups are alive. ``min_replicas``: the fewest groups a step
    commits with. ``timeout`` (s): cross-group collectives, commits and healing; ``quorum_timeout`` (s): how long a
    quorum may take (a group waits that long for ``min_replicas`` groups); ``connect_timeout`` (s): reaching the
    lighthouse and peers. ``heartbeat_interval`` (s): how often a group tells the lighthouse it is alive.
    ``max_retries``: consecutive failed commits before the group gives up (None: never). ``manager_port``: the port
    of group rank 0's torchft manager (0: any free one). ``hostname``: the name other groups reach this group's
    manager and checkpoint server by (default: this host's name). ``global_batch``: samples per step, whatever groups
    are alive; when given, the groups may differ in pipeline stages and encoder placement (each parameter's
    gradient is reduced with the groups' holders of its layer, keyed by name), and every group must give the
    same value. ``templates``: a templates file (``lightning-mm plan --templates``); with it a group takes the layout
    of its world size at every (re)start (a group launched with ``torchrun --nnodes MIN:MAX`` that loses a node
    re-forms at a smaller template), and the global batch is split over the groups in whole microbatches by their
    templates' planned step times (Oobleck's Eq. 2.6, every group at least one). It needs ``global_batch``."""

    lighthouse: str = ""
    replica_group: int | None = None
    num_replica_groups: int = 1
    min_replicas: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0
    heartbeat_interval: float = 0.1
    max_retries: int | None = None
    manager_port: int = 0
    hostname: str | None = None
    global_batch: int | None = None
    templates: str | None = None

    def __post_init__(self):
        if not self.lighthouse:
            self.lighthouse = os.environ.get(LIGHTHOUSE_ENV, "")
        if not self.lighthouse:
            raise ValueError("fault_tolerance.lighthouse is not set: give 'host:port' of the lighthouse "
                             f"(lightning-mm lighthouse) or set ${LIGHTHOUSE_ENV}")
        parse_address(self.lighthouse)
        if self.replica_group is None:
            env = os.environ.get(REPLICA_GROUP_ENV)
            if env is None or not env.strip().lstrip("-").isdigit():
                raise ValueError(f"fault_tolerance.replica_group is not set: give this group's id (0..num_replica_groups"
                                 f"-1), or set ${REPLICA_GROUP_ENV} in each group's launch")
            self.replica_group = int(env)
        if self.num_replica_groups < 1:
            raise ValueError(f"fault_tolerance.num_replica_groups must be >= 1, got {self.num_replica_groups}")
        if not 0 <= self.replica_group < self.num_replica_groups:
            raise ValueError(f"fault_tolerance.replica_group={self.replica_group} is not in 0..{self.num_replica_groups - 1} "
                             f"(num_replica_groups={self.num_replica_groups})")
        if not 1 <= self.min_replicas <= self.num_replica_groups:
            raise ValueError(f"fault_tolerance.min_replicas must be in 1..num_replica_groups={self.num_replica_groups}, "
                             f"got {self.min_replicas}")
        for name in ("timeout", "quorum_timeout", "connect_timeout", "heartbeat_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fault_tolerance.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError(f"fault_tolerance.max_retries must be >= 0 or None, got {self.max_retries}")
        if self.templates and self.global_batch is None:
            raise ValueError("fault_tolerance.templates needs fault_tolerance.global_batch: groups re-formed at other "
                             "templates must agree on the samples of a step")
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"fault_tolerance.global_batch must be >= 1 samples (or None), got {self.global_batch}")
        if not 0 <= self.manager_port < 65536:
            raise ValueError(f"fault_tolerance.manager_port must be a port (0: any), got {self.manager_port}")

    def elastic_launch_problem(self, environ=os.environ) -> str | None:
        """What is wrong with a torchrun launch that re-forms at templates, or None. torch 2.13's shared rendezvous
        store does not publish the next round's master address when the agent that was rank 0 stays rank 0 (a node
        joins): every agent then waits 60 s and fails; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it."""
        if not self.templates or "TORCHELASTIC_RUN_ID" not in environ:
            return None
        if environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
            return ("fault_tolerance.templates re-forms groups when torchrun changes their nodes, but torchrun runs "
                    "with its shared rendezvous store, which does not publish the master address when a node joins "
                    "(every agent then fails after 60 s): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun")
        return None

    def template(self, world_size: int):
        """The template of ``world_size`` devices from ``templates`` (a ValueError names the sizes covered)."""
        from lightning_mm.plan.templates import Templates

        return Templates.load(self.templates).template_for(world_size)

    @property
    def address(self) -> tuple[str, int]:
        return parse_address(self.lighthouse)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def as_fault_tolerance(value) -> FaultTolerance | None:
    """None, a FaultTolerance or its fields as a dict (a YAML) -> a FaultTolerance (or None)."""
    if value is None or isinstance(value, FaultTolerance):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in dataclasses.fields(FaultTolerance)}
        if unknown:
            raise TypeError(f"fault_tolerance got unknown fields {sorted(unknown)}; it takes "
                            f"{[f.name for f in dataclasses.fields(FaultTolerance)]}")
        return FaultTolerance(**value)
    raise TypeError(f"fault_tolerance must be a lightning_mm.FaultTolerance or a dict of its fields, got {type(value)}")


def check_reachable(config: FaultTolerance) -> None:
    """A TCP connect to the lighthouse, tried for up to ``connect_timeout`` seconds (a lighthouse started beside the
    groups may still be importing), with a message saying how to start one."""
    host, port = config.address
    deadline = time.monotonic() + config.connect_timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(config.connect_timeout, 5.0)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise FaultToleranceError(
                    f"the fault-tolerance lighthouse at {host}:{port} is unreachable ({e}); start it before the "
                    f"replica groups (`lightning-mm lighthouse --min_replicas {config.min_replicas} --bind "
                    f"[::]:{port}`, or torchft's `torchft_lighthouse`) and check fault_tolerance.lighthouse / "
                    f"${LIGHTHOUSE_ENV}") from None
        time.sleep(0.2)


class _NoNcclNotes(logging.Filter):
    """Drops torchft's note that it cannot reset NCCL's flight recorder: a gloo run has no NCCL to trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def quiet_torchft() -> None:
    """torchft's Rust side logs ~9 INFO lines per step and group (quorum, commit votes) to stderr; it reads
    ``RUST_LOG`` once, when first imported. Default it to warnings; ``RUST_LOG=info`` brings the lines back. The
    project's own lines (``fault tolerance: {"event": ...}``, lost groups) are unaffected."""
    os.environ.setdefault("RUST_LOG", "warn")


def import_torchft():
    quiet_torchft()
    try:
        import torchft  # noqa: F401
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
    except ImportError as e:
        raise FaultToleranceError(f"fault_tolerance needs torchft: pip install 'lightning-mm[ft]' ({e})") from None
    return Manager, ProcessGroupGloo, ProcessGroupNCCL
