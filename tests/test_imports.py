"""Imports run one way (docs/architecture.md): no cycle among lightning_mm's modules, the layer rules, and every
module imports alone.

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` statement, at module level
and inside functions (a function-level import is still a dependency; it only runs later). An edge goes from a
module to each lightning_mm module the statement makes Python execute: the named module (``from P import name``:
the submodule ``P.name`` if there is one, else ``P``) and the packages above it, except the importing module's own
enclosing packages, which Python has always started importing first (the root ``lightning_mm/__init__.py``
imports the public API, so every module runs it). ``lightning_mm/attention/kernels/`` is ``lightning_mm.attention.kernels``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_mm"
SOURCES = {PACKAGE: ROOT / "lightning_mm", f"{PACKAGE}.kernels": ROOT / "kernels"}

# the layer rules (docs/architecture.md): what each part may not import (directly or through any module it imports)
LIGHTNING_LAYER = ("lightning_mm.trainer",)  # strategy, module, CLI, launch, summary, callbacks
FORBIDDEN = {
    "lightning_mm.plan": "everything but lightning_mm.plan (pure: rank layout, placement, stages, schedules)",
    "lightning_mm.planner": ("lightning_mm.parallel", "lightning_mm.checkpoint", "lightning_mm.fault_tolerance",
                             *LIGHTNING_LAYER),
    "lightning_mm.model": ("lightning_mm.checkpoint", "lightning_mm.parallel", "lightning_mm.planner",
                           "lightning_mm.data", "lightning_mm.fault_tolerance", *LIGHTNING_LAYER),
    "lightning_mm.attention": ("lightning_mm.parallel", "lightning_mm.planner", "lightning_mm.model",
                               "lightning_mm.data", "lightning_mm.checkpoint", "lightning_mm.fault_tolerance",
                               *LIGHTNING_LAYER),
    "lightning_mm.attention.kernels": "everything but the kernels, the mask and plan/ (the mask's loops)",
    "lightning_mm.attention.mask": "everything but lightning_mm.plan (the mask's numba loops, plan/cp_loops.py)",
    "lightning_mm.plan.cp_loops": "everything",
    "lightning_mm.loss": "everything",
    "lightning_mm.fault_tolerance.watchdog": "everything",
    "lightning_mm.parallel": ("lightning_mm.checkpoint", "lightning_mm.fault_tolerance.training", *LIGHTNING_LAYER),
    "lightning_mm.checkpoint": ("lightning_mm.parallel", *LIGHTNING_LAYER),
    "lightning_mm.data": ("lightning_mm.parallel", "lightning_mm.checkpoint", "lightning_mm.planner",
                          *LIGHTNING_LAYER),
    "lightning_mm.fault_tolerance": LIGHTNING_LAYER,
    "lightning_mm.trainer.strategy": ("lightning_mm.trainer.cli",),
}
ALLOWED_ONLY = {"lightning_mm.plan": ("lightning_mm.plan",),
                "lightning_mm.attention.kernels": ("lightning_mm.attention.kernels", "lightning_mm.attention.mask",
                                                   "lightning_mm.plan"),
                "lightning_mm.attention.mask": ("lightning_mm.plan",), "lightning_mm.plan.cp_loops": (),
                "lightning_mm.loss": (), "lightning_mm.fault_tolerance.watchdog": ()}
# third-party imports a part may not make itself: no process group in plan/ and planner/, no Lightning below the
# Lightning layer (the data modules are LightningDataModules, the one exception)
EXTERNAL_FORBIDDEN = {"lightning_mm.plan": ("torch.distributed", "lightning"),
                      "lightning_mm.planner": ("torch.distributed",),
                      "lightning_mm.model": ("lightning",),
                      "lightning_mm.attention": ("lightning",),
                      "lightning_mm.parallel": ("lightning",),
                      "lightning_mm.fault_tolerance": ("lightning",),
                      "lightning_mm.checkpoint": ("lightning",)}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@lru_cache(maxsize=None)
def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package) for every module of lightning_mm."""
    out = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if prefix == PACKAGE and parts[:1] == ["kernels"]:
                continue
            out[".".join([prefix, *parts])] = (path, is_package)
    return out


def _statements(tree: ast.AST):
    """Every import statement, skipping ``if TYPE_CHECKING:`` blocks (they never run)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


@lru_cache(maxsize=None)
def imports_of(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(lightning_mm modules named by ``name``'s import statements, other top-level modules it imports)."""
    path, is_package = modules()[name]
    package = name if is_package else name.rpartition(".")[0]
    internal, external = [], []
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base for a in node.names]
        for t in targets:
            if _within(t, PACKAGE):
                while t not in modules():  # an attribute path: the module that defines it
                    t = t.rpartition(".")[0]
                internal.append(t)
            else:
                external.append(t)
    return tuple(dict.fromkeys(internal)), tuple(dict.fromkeys(external))


@lru_cache(maxsize=None)
def graph() -> dict[str, set[str]]:
    """Module -> the lightning_mm modules importing it executes (see the module docstring)."""
    edges = {}
    for name in modules():
        own = set(_ancestors(name))
        out = set()
        for target in imports_of(name)[0]:
            out.update(a for a in _ancestors(target) if a not in own)
            if target != name:
                out.add(target)
        edges[name] = out
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for nxt in graph()[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    seen.discard(name)
    return seen


def _path(src: str, dst: str) -> list[str]:
    """One import chain from src to dst (for the failure message)."""
    parent, todo = {src: None}, [src]
    while todo:
        v = todo.pop(0)
        if v == dst:
            chain = []
            while v is not None:
                chain.append(v)
                v = parent[v]
            return chain[::-1]
        for nxt in sorted(graph()[v]):
            if nxt not in parent:
                parent[nxt] = v
                todo.append(nxt)
    return []


def test_the_graph_sees_function_level_imports():
    """The reader itself: a function-level import counts, and ``from P import submodule`` names the submodule."""
    internal, _ = imports_of("lightning_mm.trainer.cli")
    assert "lightning_mm.trainer.strategy" in internal  # imported inside MultimodalCLI.instantiate_classes
    assert "lightning_mm.checkpoint" in internal  # inside export_main
    assert "lightning_mm.attention.mask" in imports_of("lightning_mm.attention.reference")[0]
    assert "lightning_mm.attention.kernels.attention" in modules()
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    found = cycles(graph())
    detail = [" -> ".join(_path(c[0], c[1]) + _path(c[1], c[0])[1:]) for c in found]
    assert not found, "import cycles (function-level imports included):\n" + "\n".join(detail)


def test_layers_import_one_way():
    """plan <- planner; plan <- parallel <- trainer (strategy <- cli); model <- checkpoint <- cli; model knows no
    checkpoint, Lightning or pipeline runtime; plan/ and planner/ touch no process group; attention knows no
    pipeline; nothing below the Lightning layer (trainer/) imports it or Lightning itself."""
    broken = []
    for name in modules():
        reach = reachable(name)
        for layer, rule in FORBIDDEN.items():
            if not _within(name, layer):
                continue
            if layer in ALLOWED_ONLY:
                bad = [m for m in reach if not any(_within(m, ok) for ok in ALLOWED_ONLY[layer])
                       and m not in _ancestors(name)]
            else:
                bad = [m for m in reach if any(_within(m, f) for f in rule)]
            broken += [f"{name} ({layer}: not {rule}) reaches {m}: {' -> '.join(_path(name, m))}" for m in sorted(bad)]
        for layer, banned in EXTERNAL_FORBIDDEN.items():
            if _within(name, layer):
                broken += [f"{name} imports {e}" for e in imports_of(name)[1] if any(_within(e, b) for b in banned)]
    # nothing below the CLI imports it
    broken += [f"{name} imports the CLI" for name in modules()
               if not _within(name, "lightning_mm.trainer.cli") and "lightning_mm.trainer.cli" in graph()[name]]
    assert not broken, "\n".join(broken)


IMPORT_EACH = r"""
import importlib, json, sys, traceback
import torch, transformers, lightning  # dependencies stay loaded: only lightning_mm's modules start afresh
from lightning.pytorch.strategies import StrategyRegistry

failed = {}
for name in json.loads(sys.argv[1]):
    for m in [m for m in sys.modules if m == "lightning_mm" or m.startswith("lightning_mm.")]:
        del sys.modules[m]
    StrategyRegistry.pop("multimodal", None)  # registered by lightning_mm.trainer.strategy on import
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != "triton":  # the kernels need the optional triton
            failed[name] = traceback.format_exc(limit=-3)
    except Exception:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def test_each_module_imports_alone():
    """Every module imports as the first lightning_mm module of an interpreter (its dependencies' modules kept,
    lightning_mm's cleared before each), so none relies on another having been imported before it."""
    names = sorted(modules())
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    halves = [names[::2], names[1::2]]  # two interpreters at once: the machine has two cores or more
    procs = [subprocess.Popen([sys.executable, "-c", IMPORT_EACH, json.dumps(half)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) for half in halves]
    failed = {}
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-4000:]
        failed.update(json.loads(out.strip().splitlines()[-1]))
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


def test_every_package_is_installed():
    """pyproject.toml lists every package of lightning_mm (a wheel holds only the listed ones)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, (_, is_package) in modules().items() if is_package}
    assert packages == listed, f"missing: {sorted(packages - listed)}, not packages: {sorted(listed - packages)}"
