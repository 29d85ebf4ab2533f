#!/usr/bin/env python
"""A CPU proxy for a LION layer's GPU memory traffic on the triton path (docs/benchmarks.md, "Traffic").

    TRITON_INTERPRET=1 python scripts/benchmark_traffic.py                 # chunk and rnn, 256 tokens
    TRITON_INTERPRET=1 python scripts/benchmark_traffic.py --forms chunk --tokens 1024 --dtype float16

One attention module of a one-block lion_d (qkv projection, LION op, output projection) runs a
training-mode forward on the triton backend under Triton's interpreter. Two byte counts, as multiples
of |q| + |k| + |v| (the bytes of the three projections' outputs):
- written: every PyTorch operator's outputs (allocations included: a kernel's output buffer is
  allocated by one), not what the interpreter does inside a kernel launch;
- saved: the tensors autograd keeps for backward (each storage once, parameters excluded).
Counted on the module's second call, as in every training step after the first.
On a GPU the kernels' own reads and writes add to these; what this counts is everything around them.
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from collections import Counter
from typing import Dict, Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's language module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lion_vit.layers import LionAttention

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _Written(TorchDispatchMode):
    """Sums the bytes of every operator's new tensor outputs, by operator and by dtype, while `counting`."""

    def __init__(self) -> None:
        super().__init__()
        self.by_operator: Counter = Counter()
        self.by_dtype: Counter = Counter()
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            # a view shares its input's storage (nothing written); an in-place operator writes into it
            inputs = set() if func._schema.is_mutable else {
                t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.by_operator[func.__name__.split(".")[0]] += t.numel() * t.element_size()
                    self.by_dtype[t.dtype] += t.numel() * t.element_size()
        return out


@contextmanager
def _not_inside_launches(mode: _Written) -> Iterator[None]:
    """The interpreter copies a launch's arguments to host arrays and back with torch operators: not
    traffic a GPU would see."""
    from triton.runtime.interpreter import GridExecutor

    call = GridExecutor.__call__

    def launch(self, *args, **kwargs):
        mode.counting = False
        try:
            return call(self, *args, **kwargs)
        finally:
            mode.counting = True

    GridExecutor.__call__ = launch
    try:
        yield
    finally:
        GridExecutor.__call__ = call


def measure_traffic(form: str, tokens: int = 256, heads: int = 6, head_dim: int = 64,
                    dtype: torch.dtype = torch.float32, decay: str = "fixed") -> Dict[str, float]:
    """written and saved bytes of one training-mode forward of a LION attention module on the triton
    backend, as multiples of |q| + |k| + |v|."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import interpret  # the interpreter's two adaptations (tests/interpret.py)
    interpret.adapt_interpreter()

    torch.manual_seed(0)
    dim = heads * head_dim
    layer = LionAttention(dim, heads, qkv_bias=True, decay=decay, attn_form=form, attn_backend="triton").to(dtype)
    layer.train()
    x = torch.randn(1, tokens, dim, dtype=dtype, requires_grad=True)
    qkv_bytes = 3 * x.numel() * x.element_size()
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() != x.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    layer(x)  # a first call builds what the path keeps between calls (its index tensors): count a later one
    written = _Written()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _not_inside_launches(written), written:
        y = layer(x)
    y.float().sum().backward()  # the backward runs (and the saved tensors were enough)
    total = sum(written.by_operator.values())
    return {"written": total / qkv_bytes, "saved": sum(saved.values()) / qkv_bytes,
            "float32 share": written.by_dtype[torch.float32] / total,
            "by operator": {name: size / qkv_bytes for name, size in written.by_operator.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", choices=["chunk", "rnn"], default=["chunk", "rnn"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--decay", choices=["fixed", "selective"], default="fixed")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--by-operator", action="store_true",
                        help="also list the bytes written by each operator, and the float32 share")
    args = parser.parse_args()
    print(f"| form | written / (q+k+v) | saved / (q+k+v) |   ({args.tokens} tokens, {args.heads} heads of "
          f"{args.head_dim}, {args.decay} decay, {args.dtype}, training)")
    print("|---|---|---|")
    for form in args.forms:
        result = measure_traffic(form, args.tokens, args.heads, args.head_dim, DTYPES[args.dtype], args.decay)
        print(f"| {form} | {result['written']:.1f} | {result['saved']:.1f} |")
        if args.by_operator:
            print("   " + ", ".join(f"{name} {size:.2f}" for name, size in result["by operator"].items() if size >= 0.01))
            print(f"   float32: {result['float32 share']:.1%} of the bytes written")


if __name__ == "__main__":
    main()
