"""Run flash-linear-attention's Triton kernels on a CPU: Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before Triton's language module is imported) and the adaptations that the interpreter needs
and a GPU does not, which is why they live in the tests:

- the autotuner would time every configuration through the GPU driver, absent here: keep the first, and
  time nothing (Triton before 3.7 times even a single configuration);
- Triton before 3.7 reads a scalar's value with `int()` of a one-element array, which numpy 2.4 refuses:
  squeeze it first, as later Triton does;
- FLA calls `.to(tl.int64)` on loop indices, which the interpreter leaves Python ints: make each loop
  index a Triton scalar at the top of the loop body, as the compiler does;
- speed only: the interpreter patches triton.language for each launch and again at every call of a
  @triton.jit helper inside it (`inspect.getmembers` over three modules each time), while the launch's
  patch is still in place: skip the repeats (docs/benchmarks.md, "Test-suite time").
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
    autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]  # (then run once)

    class LoopIndexAsScalar(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):  # `i = i`, which the interpreter turns into a scalar
                node.body.insert(0, self.visit_Assign(ast.Assign(
                    targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                    value=ast.Name(id=node.target.id, ctx=ast.Load()))))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopIndexAsScalar()
    if hasattr(interpreter, "_LangPatchScope"):  # (Triton whose launches undo their patch through a scope)
        interpreter._patch_lang = _patched_once(interpreter._patch_lang)
        patch_tensor = interpreter._patch_lang_tensor

        def patch_tensor_index(tensor, scope):
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        interpreter._patch_lang_tensor = patch_tensor_index
    adapt_interpreter.done = True


def _patched_once(patch_lang):
    """interpreter._patch_lang(fn), which patches the language modules that fn's globals hold and returns a
    scope that undoes it, as a no-op while a launch's patch of those same modules is in place."""
    import inspect

    from triton.runtime import interpreter
    patched = set()  # the language modules that the running launch patched

    def languages(fn):  # (as _patch_lang picks them)
        return {value for value in fn.__globals__.values()
                if inspect.ismodule(value) and value in (interpreter.tl, interpreter.tl.core)}

    def patch_once(fn):
        wanted = languages(fn)
        if wanted and wanted <= patched:
            return interpreter._LangPatchScope()  # (nothing to undo)
        scope = patch_lang(fn)
        patched.update(wanted)
        restore = scope.restore

        def restore_and_forget():  # (the launch's own scope: device calls' scopes are never restored)
            restore()
            patched.clear()
        scope.restore = restore_and_forget
        return scope
    return patch_once
