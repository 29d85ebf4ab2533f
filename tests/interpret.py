"""Run flash-linear-attention's Triton kernels on a CPU: Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before Triton's language module is imported) and two adaptations that the interpreter needs
and a GPU does not, which is why they live in the tests:

- the autotuner would time every configuration through the GPU driver, absent here: keep the first;
- FLA calls `.to(tl.int64)` on loop indices, which the interpreter leaves Python ints: make each loop
  index a Triton scalar at the top of the loop body, as the compiler does.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]

KERNELS = all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))
SKIP_REASON = 'flash-linear-attention is not installed (pip install "lion-vit[gpu]")'


def adapt_interpreter() -> None:
    """Patch Triton's interpreter and autotuner as the module docstring says (once; no-op on a GPU)."""
    if ON_GPU or getattr(adapt_interpreter, "done", False):
        return
    from triton.runtime import autotuner, interpreter

    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]

    class LoopIndexAsScalar(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):  # `i = i`, which the interpreter turns into a scalar
                node.body.insert(0, self.visit_Assign(ast.Assign(
                    targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                    value=ast.Name(id=node.target.id, ctx=ast.Load()))))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopIndexAsScalar()
    adapt_interpreter.done = True
