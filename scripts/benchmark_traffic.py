#!/usr/bin/env python
r"""A CPU proxy for a LION layer's GPU memory traffic (docs/benchmarks.md, "Traffic").

    TRITON_INTERPRET=1 python scripts/benchmark_traffic.py                 # chunk and rnn, 256 tokens
    TRITON_INTERPRET=1 python scripts/benchmark_traffic.py --forms chunk --tokens 1024 --dtype float16
    TRITON_INTERPRET=1 python scripts/benchmark_traffic.py --forms chunk --tokens 576 --scans 2 --inference
    TRITON_INTERPRET=1 python scripts/benchmark_traffic.py --forms chunk --inference --batch 16 --heads 1
    TRITON_INTERPRET=1 python scripts/benchmark_traffic.py --forms chunk --heads 1 --fallback forward
    python scripts/benchmark_traffic.py --backend torch --forms deit attention --tokens 197 --batch 8 \
        --dtype bfloat16 --autocast                                          # GPU training at 224 px

One attention module of a one-block lion_d (qkv projection, LION op, output projection; --scans 2: of
lion_d_natural, on a square grid) runs a training-mode forward (--inference: an evaluation forward
without autograd, whose batch runs in groups of images on the triton backend: --batch) on the triton
backend under Triton's interpreter, or on the portable torch forms (--backend torch). Form "deit" is
timm's softmax Attention (SDPA) of the same width, the baseline; "attention" the attention form (on the triton
backend the bidirectional kernel, fused). --autocast keeps the weights in float32
and runs under CPU autocast to --dtype, as training on a GPU does. --fallback trains as where FLA's chunk
backward fails (Hopper with Triton 3.4.0-3.7.0), through that Tuning.chunk_backward_fallback. Byte
counts, as multiples of
|q| + |k| + |v| (the bytes of the three projections' outputs):
- written: every PyTorch operator's outputs (allocations included: a kernel's output buffer is
  allocated by one), not what the interpreter does inside a kernel launch;
- saved: the tensors autograd keeps for backward (each storage once, parameters excluded);
- peak: the most bytes of the tensors those operators allocated that are alive at once (the call's
  share of peak memory);
- backward (training): what the backward's operators write, parameter gradients included.
Counted on the module's second call, as in every step after the first.
On a GPU the kernels' own reads and writes add to these; what this counts is everything around them.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path
from collections import Counter
from typing import Dict, Iterator, Optional, Tuple

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's language module is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (benchmarking.py)

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from timm.layers import Attention

from lion_vit.layers import LionAttention
from lion_vit.ops.tuning import CHUNK_BACKWARD_FALLBACKS, tuned

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# allocations without values: counted as written by whatever fills them (a kernel, or an operator's out=)
_EMPTY = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted"}


class _Written(TorchDispatchMode):
    """Sums the bytes of every operator's new tensor outputs, by operator and by dtype, while `counting`,
    and the most bytes of the storages they allocated that are alive at once (`peak`). An empty allocation
    counts as written once: the first bytes an operator then writes into it (out=, in place) are not
    counted again, those a kernel writes are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.by_operator: Counter = Counter()
        self.by_dtype: Counter = Counter()
        self.counting = True
        self.unfilled: Dict[int, int] = {}  # storage address -> bytes of an empty allocation not yet written
        self.alive: Dict[int, Tuple[str, int]] = {}  # storage address -> (operator, bytes), while it lives
        self.peak = 0
        self.at_peak: Counter = Counter()  # the bytes alive at the peak, by the operator that allocated them

    def _allocated(self, operator: str, storage: torch.UntypedStorage) -> None:
        address = storage.data_ptr()
        if address in self.alive or not storage.nbytes():
            return
        self.alive[address] = (operator, storage.nbytes())
        alive = sum(size for _, size in self.alive.values())
        if alive > self.peak:
            self.peak = alive
            self.at_peak = Counter()
            for name, size in self.alive.values():
                self.at_peak[name] += size
        weakref.finalize(storage, self.alive.pop, address, None)  # (torch keeps one Python storage per storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            # a view shares its input's storage (nothing written); an in-place operator writes into it
            inputs = set() if func._schema.is_mutable else {
                t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            operator = func.__name__.split(".")[0]
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    size, storage = t.numel() * t.element_size(), t.untyped_storage()
                    if func._schema.is_mutable:  # into an allocation counted already: only what is beyond it
                        filled = min(size, self.unfilled.get(storage.data_ptr(), 0))
                        if filled:
                            self.unfilled[storage.data_ptr()] -= filled
                            size -= filled
                    else:
                        self._allocated(operator, storage)
                        if operator in _EMPTY:
                            self.unfilled[storage.data_ptr()] = storage.nbytes()
                            weakref.finalize(storage, self.unfilled.pop, storage.data_ptr(), None)
                    self.by_operator[operator] += size
                    self.by_dtype[t.dtype] += size
        return out

    def launched(self, arguments) -> None:
        """A kernel launch on these arguments, which may fill their empty allocations."""
        for t in tree_leaves(arguments):
            if isinstance(t, torch.Tensor):
                self.unfilled.pop(t.untyped_storage().data_ptr(), None)


@contextmanager
def _not_inside_launches(mode: _Written) -> Iterator[None]:
    """The interpreter copies a launch's arguments to host arrays and back with torch operators: not
    traffic a GPU would see. Its copying functions are closures in reference cycles that hold the launch's
    storages, alive until the cyclic garbage collector runs (when, varies with Python's version): they are
    collected after each launch, so that `peak` counts what the call itself keeps, as on a GPU (the objects
    made before are frozen, so that a collection reads only those made since)."""
    from triton.runtime.interpreter import GridExecutor

    call = GridExecutor.__call__

    def launch(self, *args, **kwargs):
        mode.launched((args, kwargs))
        mode.counting = False
        try:
            return call(self, *args, **kwargs)
        finally:
            gc.collect()
            mode.counting = True

    GridExecutor.__call__ = launch
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        GridExecutor.__call__ = call


@contextmanager
def _chunk_backward_failing(fallback: str) -> Iterator[None]:
    """dispatch's plans as on a Hopper GPU with Triton 3.4.0-3.7.0, training through `fallback` (its warning
    kept quiet)."""
    with tuned(chunk_backward_fallback=fallback, chunk_backward_fails=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*chunk backward fails")
        yield


def measure_traffic(form: str, tokens: int = 256, heads: int = 6, head_dim: int = 64,
                    dtype: torch.dtype = torch.float32, decay: str = "fixed", scans: int = 1,
                    training: bool = True, batch: int = 1, backend: str = "triton",
                    autocast: bool = False, chunk_size: Optional[int] = None,
                    fallback: Optional[str] = None) -> Dict[str, float]:
    """written, saved, peak and backward bytes of one forward (and backward) of a LION attention module
    (form "deit": timm's Attention) as multiples of |q| + |k| + |v|; scans=2 needs a square number of tokens
    (the grid the snakes read). autocast: float32 weights, the call under autocast to dtype; chunk_size: the
    torch backend's chunk form's (None: one chunk); fallback: train as where FLA's chunk backward fails, through
    this Tuning.chunk_backward_fallback."""
    if fallback is not None:
        with _chunk_backward_failing(fallback):
            return measure_traffic(form, tokens, heads, head_dim, dtype, decay, scans, training, batch, backend,
                                   autocast, chunk_size)
    if backend == "triton":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import interpret  # the interpreter's two adaptations (tests/interpret.py)
        interpret.adapt_interpreter()

    torch.manual_seed(0)
    dim = heads * head_dim
    if form == "deit":
        layer = Attention(dim, heads, qkv_bias=True)
    else:
        layer = LionAttention(dim, heads, qkv_bias=True, decay=decay, num_scans=scans, attn_form=form,
                              chunk_size=chunk_size, attn_backend=backend)
    weights = torch.float32 if autocast else dtype
    layer.to(weights).train(training)
    if scans == 2:
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise ValueError(f"--scans 2 reads a square grid: --tokens {tokens} is not a square (e.g. 576)")
        layer.grid_size = (side, side)
    x = torch.randn(batch, tokens, dim, dtype=weights, requires_grad=training)
    qkv_bytes = 3 * x.numel() * dtype.itemsize
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() != x.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    precision = torch.autocast("cpu", dtype=dtype, enabled=autocast)
    with torch.set_grad_enabled(training), precision:
        layer(x[:1])  # a first call builds what the path keeps between calls (its index tensors): count a later one
        written = _Written()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _not_inside_launches(written), written:
            y = layer(x)
    backward = _Written()
    if training:  # the backward runs (and the saved tensors were enough)
        loss = y.float().sum()
        with _not_inside_launches(backward), backward:
            loss.backward()
    total = sum(written.by_operator.values())
    return {"written": total / qkv_bytes, "saved": sum(saved.values()) / qkv_bytes, "peak": written.peak / qkv_bytes,
            "backward": sum(backward.by_operator.values()) / qkv_bytes,
            "float32 share": written.by_dtype[torch.float32] / total,
            "float32 backward": backward.by_dtype[torch.float32] / qkv_bytes,
            "by operator": {name: size / qkv_bytes for name, size in written.by_operator.most_common()},
            "backward by operator": {name: size / qkv_bytes for name, size in backward.by_operator.most_common()},
            "at peak": {name: size / qkv_bytes for name, size in written.at_peak.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="+", choices=["attention", "chunk", "rnn", "deit"],
                        default=["chunk", "rnn"], help="LION forms, or deit: timm's softmax Attention, the baseline")
    parser.add_argument("--backend", choices=["triton", "torch"], default="triton")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="the torch backend's chunk form's (default: one chunk; the triton kernels tile 64)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1, help="images (with --inference: run in groups)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--decay", choices=["lit", "fixed", "selective"], default="fixed")
    parser.add_argument("--scans", type=int, choices=[1, 2], default=1, help="2: lion_d_natural's two snakes")
    parser.add_argument("--inference", action="store_true", help="an evaluation forward, without autograd")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--autocast", action="store_true", help="float32 weights, the call under autocast to --dtype")
    parser.add_argument("--fallback", choices=sorted(CHUNK_BACKWARD_FALLBACKS),
                        help="train as where FLA's chunk backward fails, through this Tuning.chunk_backward_fallback")
    parser.add_argument("--by-operator", action="store_true",
                        help="also list the bytes written by each operator, and the float32 share")
    args = parser.parse_args()
    if args.scans == 2 and math.isqrt(args.tokens) ** 2 != args.tokens:
        parser.error(f"--scans 2 reads a square grid: --tokens {args.tokens} is not a square (e.g. 576)")
    mode = "inference" if args.inference else "training"
    precision = f"autocast to {args.dtype}" if args.autocast else args.dtype
    print(f"| form | written / (q+k+v) | saved / (q+k+v) | peak / (q+k+v) | backward / (q+k+v) |   ({args.batch} x "
          f"{args.tokens} tokens, {args.heads} heads of {args.head_dim}, {args.scans} scan(s), {args.decay} decay, "
          f"{args.backend} backend, {precision}, {mode}"
          + (f", where FLA's chunk backward fails: {args.fallback}" if args.fallback else "") + ")")
    print("|---|---|---|---|---|")
    for form in args.forms:
        result = measure_traffic(form, args.tokens, args.heads, args.head_dim, DTYPES[args.dtype], args.decay,
                                 args.scans, training=not args.inference, batch=args.batch, backend=args.backend,
                                 autocast=args.autocast, chunk_size=args.chunk_size, fallback=args.fallback)
        backward = "-" if args.inference else f"{result['backward']:.1f}"
        print(f"| {form} | {result['written']:.1f} | {result['saved']:.1f} | {result['peak']:.1f} | {backward} |")
        if args.by_operator:
            print("   " + ", ".join(f"{name} {size:.2f}" for name, size in result["by operator"].items() if size >= 0.01))
            print(f"   float32: {result['float32 share']:.1%} of the bytes written")
            print("   alive at the peak, by the operator that allocated it: "
                  + ", ".join(f"{name} {size:.2f}" for name, size in result["at peak"].items() if size >= 0.01))
            if not args.inference:
                print("   backward: " + ", ".join(f"{name} {size:.2f}" for name, size in
                                                  result["backward by operator"].items() if size >= 0.01)
                      + f"; float32 {result['float32 backward']:.2f}")


if __name__ == "__main__":
    main()
