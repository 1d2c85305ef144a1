"""Pipeline templates (Oobleck, seed 003 ch. 2): one planned layout per node count, made once and only read later.

A ``PipelineTemplate`` is the layout of one replica group on ``nodes`` nodes: its ParallelSpecs, placement, the
layers of each stage per module and its planned time (``step_time(n)``: fill + n x the time per microbatch).
``Templates`` holds consecutive node counts n0 .. N - f n0 and reads/writes them as YAML; ``lightning-mm plan
--templates`` writes them. ``split_batch`` is Eq. 2.6 with this project's choices: a fixed global batch of
microbatches split over the groups of a quorum, every group at least one, minimising the slowest group's time.
``instantiate`` picks the group sizes for a node count (Eq. 2.5). Pure: no process group, no planner import.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lightning_mm.plan.layout import ParallelSpec


@dataclass(frozen=True)
class PipelineTemplate:
    """One replica group's layout on ``nodes`` nodes of ``devices_per_node`` devices. ``partition``: layers per
    stage per module (the strategy's ``partition``); ``specs``: the ParallelSpec per module; ``dp``: data-parallel
    replicas inside the group. Planned times in the planner's unit (seconds with a profile or FLOP/s):
    ``microbatch_time`` per extra microbatch and ``fill_time`` once per step (the pipeline's fill and drain).
    ``planning_seconds``: how long the search took."""

    nodes: int
    devices_per_node: int
    specs: dict[str, ParallelSpec]
    partition: dict[str, tuple[int, ...]]
    placement: str = "parallel"
    dp: int = 1
    microbatch_time: float = 1.0
    fill_time: float = 0.0
    planning_seconds: float = 0.0

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"a template needs nodes >= 1 and devices_per_node >= 1, got {self.nodes} x "
                             f"{self.devices_per_node}")
        for module, sizes in self.partition.items():
            pp = self.specs[module].pp if module in self.specs else None
            if pp != len(sizes):
                raise ValueError(f"template on {self.nodes} nodes: module {module!r} has {len(sizes)} stages in its "
                                 f"partition {list(sizes)} but its ParallelSpec says pp={pp}")
        if self.microbatch_time <= 0 or self.fill_time < 0:
            raise ValueError(f"template on {self.nodes} nodes: microbatch_time must be > 0 and fill_time >= 0, got "
                             f"{self.microbatch_time} and {self.fill_time}")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def step_time(self, microbatches: int) -> float:
        """Planned time of one step of ``microbatches`` microbatches (0 for none)."""
        return self.fill_time + microbatches * self.microbatch_time if microbatches > 0 else 0.0

    def fqns_per_stage(self, module: str, layer_names: Sequence[str]) -> list[list[str]]:
        """``layer_names`` (a module's layers in order, e.g. its parameter-name prefixes) cut into this template's
        stages of ``module``."""
        sizes = self.partition[module]
        if sum(sizes) != len(layer_names):
            raise ValueError(f"template on {self.nodes} nodes cuts {module!r} into {list(sizes)} = {sum(sizes)} "
                             f"layers, but {len(layer_names)} names were given")
        out, start = [], 0
        for n in sizes:
            out.append(list(layer_names[start:start + n]))
            start += n
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["specs"] = {m: {k: v for k, v in asdict(s).items() if v is not None} for m, s in self.specs.items()}
        d["partition"] = {m: list(v) for m, v in self.partition.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PipelineTemplate:
        d = dict(d)
        d["specs"] = {m: ParallelSpec(**s) for m, s in d["specs"].items()}
        d["partition"] = {m: tuple(v) for m, v in d["partition"].items()}
        return cls(**d)


@dataclass(frozen=True)
class Templates:
    """Templates for consecutive node counts, tolerating ``failures`` simultaneous node failures: with n0 the
    smallest count, any N' in [(f + 1) n0, N] nodes splits into groups of these sizes (``instantiate``)."""

    templates: tuple[PipelineTemplate, ...]
    failures: int = 1
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.templates:
            raise ValueError("Templates needs at least one PipelineTemplate")
        counts = [t.nodes for t in self.templates]
        if counts != list(range(counts[0], counts[0] + len(counts))):
            raise ValueError(f"templates must cover consecutive node counts in order, got {counts}")
        if len({t.devices_per_node for t in self.templates}) != 1:
            raise ValueError("every template needs the same devices_per_node")

    @property
    def node_counts(self) -> list[int]:
        return [t.nodes for t in self.templates]

    @property
    def devices_per_node(self) -> int:
        return self.templates[0].devices_per_node

    def template_for(self, world_size: int) -> PipelineTemplate:
        """The template of a group of ``world_size`` ranks, or a ValueError naming the sizes covered and the fix."""
        m = self.devices_per_node
        nodes, rest = divmod(world_size, m)
        if rest == 0 and nodes in self.node_counts:
            return self.templates[nodes - self.node_counts[0]]
        sizes = ", ".join(str(n * m) for n in self.node_counts)
        raise ValueError(f"no pipeline template for a group of {world_size} ranks: the templates cover {sizes} ranks "
                         f"({self.node_counts[0]}-{self.node_counts[-1]} nodes x {m} devices); start the group on "
                         "one of these sizes (torchrun --nnodes MIN:MAX within them), or plan templates for this "
                         "size: lightning-mm plan --templates --nodes N --devices-per-node M --failures f")

    def save(self, path: str | Path) -> None:
        import yaml

        doc = {"failures": self.failures, "meta": self.meta, "templates": [t.to_dict() for t in self.templates]}
        Path(path).write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=None))

    @classmethod
    def load(cls, path: str | Path) -> Templates:
        import yaml

        doc = yaml.safe_load(Path(path).read_text())
        if not isinstance(doc, dict) or "templates" not in doc:
            raise ValueError(f"{path} is not a templates file (written by lightning-mm plan --templates)")
        return cls(tuple(PipelineTemplate.from_dict(t) for t in doc["templates"]), doc.get("failures", 1),
                   doc.get("meta") or {})


def split_batch(groups: Sequence[PipelineTemplate], microbatches: int) -> list[int]:
    """Eq. 2.6 as this project solves it: ``microbatches`` (the fixed global batch) split over ``groups`` in
    integers, every group at least one, minimising max_i step_time(N_i). Greedy: each next microbatch goes to the
    group whose step time after it is smallest (ties to the earlier group), exact for step times rising with N.
    A batch smaller than the number of groups raises."""
    if not groups:
        raise ValueError("split_batch needs at least one group")
    if microbatches < len(groups):
        raise ValueError(f"a global batch of {microbatches} microbatches cannot give each of the {len(groups)} "
                         f"groups one; use a global batch of at least {len(groups)} microbatches (or a smaller "
                         "microbatch), or fewer groups")
    counts = [1] * len(groups)
    heap = [(g.step_time(2), i) for i, g in enumerate(groups)]
    heapq.heapify(heap)
    for _ in range(microbatches - len(groups)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (groups[i].step_time(counts[i] + 1), i))
    return counts


def step_time(groups: Sequence[PipelineTemplate], counts: Sequence[int]) -> float:
    """The slowest group's planned step time under the split ``counts``."""
    return max(g.step_time(n) for g, n in zip(groups, counts))


def instantiate(templates: Templates, nodes: int, microbatches: int) -> list[int]:
    """Group sizes (node counts, largest first) for ``nodes`` nodes: every node used, at least f + 1 groups, the
    fastest planned step of ``microbatches`` microbatches (Eq. 2.5, by enumerating the size multisets). Raises
    below (f + 1) n0 nodes."""
    counts, f = templates.node_counts, templates.failures
    if nodes < (f + 1) * counts[0]:
        raise ValueError(f"{nodes} nodes cannot hold {f + 1} groups of at least {counts[0]} nodes (failures={f}); "
                         "checkpoint and stop, or add nodes")
    options = []
    for sizes in _multisets(nodes, counts[::-1], counts[-1]):
        if f + 1 <= len(sizes) <= microbatches:
            groups = [templates.templates[n - counts[0]] for n in sizes]
            options.append((_lower_bound(groups, microbatches), sizes, groups))
    options.sort(key=lambda o: o[0])
    best, best_time = None, float("inf")
    for bound, sizes, groups in options:  # exact split only while the bound can still beat the best
        if bound >= best_time:
            break
        t = step_time(groups, split_batch(groups, microbatches))
        if t < best_time:
            best, best_time = sizes, t
    if best is None:
        raise ValueError(f"no split of {nodes} nodes into {f + 1}+ groups of {counts[0]}-{counts[-1]} nodes with at "
                         f"most {microbatches} groups")
    return best


def _lower_bound(groups: Sequence[PipelineTemplate], microbatches: int) -> float:
    """A bound no integer split beats: the continuous split of step times fill + N x per microbatch, and every
    group's one microbatch."""
    rates = sum(1 / g.microbatch_time for g in groups)
    fluid = (microbatches + sum(g.fill_time / g.microbatch_time for g in groups)) / rates
    return max(fluid, max(g.step_time(1) for g in groups)) * (1 - 1e-12)


def _multisets(total: int, sizes: Sequence[int], largest: int):
    """Non-increasing sequences of ``sizes`` summing to ``total`` with no part above ``largest``."""
    if total == 0:
        yield []
        return
    for s in sizes:
        if s <= min(total, largest):
            for rest in _multisets(total - s, sizes, s):
                yield [s, *rest]
