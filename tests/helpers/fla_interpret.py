"""flash-linear-attention's Triton kernels on CPU, under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.

Two things keep fla 0.6.0's kernels from running interpreted as they are, and ``interpreted_fla`` (a context)
changes both for its duration only:

* its autotuned kernels list several configs, and Triton's autotuner benchmarks them through the active driver,
  which a CPU machine lacks (``RuntimeError: 0 active drivers ([]). There should only be one.``): the first config
  of each is taken instead;
* its kernels call methods on ``range`` loop variables (``i_t.to(tl.int64)``), which compiled Triton makes tensors
  and the interpreter leaves Python ints (``AttributeError: 'int' object has no attribute 'to'``): the
  interpreter's rewrite of each kernel makes them tensors as the compiler does (``tl.static_range`` loops, constant
  in compiled Triton too, stay ints).

Kernels are rewritten under these rules into a cache of their own, dropped afterwards, so other interpreted
kernels in the process are untouched.
"""

from __future__ import annotations

import ast
import contextlib
import os
import sys


def load_fla_interpreted():
    """Import ``fla`` with its kernels interpreted on CPU: ``TRITON_INTERPRET=1`` set, triton imported again as
    ``tests/test_kernels.py`` does (when an earlier test imported it natively), then fla imported afresh (its
    kernels are decorated at import). On CUDA the plain import. Returns the module."""
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        import test_kernels  # noqa: F401  (imports triton again, interpreted, if it was not)

        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
    import fla

    return fla


def _visit_for(self, node):
    """The interpreter's rewrite of a ``for`` over ``range`` / ``tl.range``: the loop variable becomes a tensor."""
    node = self.generic_visit(node)
    call = node.iter
    func = getattr(call, "func", None)
    name = getattr(func, "attr", None) or getattr(func, "id", None)
    if name == "range" and isinstance(node.target, ast.Name):
        target = node.target.id
        wrap = ast.Assign(targets=[ast.Name(id=target, ctx=ast.Store())],
                          value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                           attr="to_tensor", ctx=ast.Load()),
                                         args=[ast.Name(id=target, ctx=ast.Load()), ast.Constant(value=False)],
                                         keywords=[]))
        node.body.insert(0, ast.copy_location(wrap, node))
    return node


@contextlib.contextmanager
def interpreted_fla():
    """Within: fla's autotuned kernels take their first config and ``range`` loop variables are tensors (see the
    module). Nothing changes on CUDA."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs
    cache = interpreter.InterpretedFunction.rewritten_fn
    Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]
    interpreter.ASTTransformer.visit_For = _visit_for
    interpreter.InterpretedFunction.rewritten_fn = {}
    try:
        yield
    finally:
        Autotuner.prune_configs = prune
        del interpreter.ASTTransformer.visit_For
        interpreter.InterpretedFunction.rewritten_fn = cache
