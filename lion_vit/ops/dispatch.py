"""The one place that decides what runs: (form, backend, device, dtype, sequence length) -> a Plan.

Every form computes the same function (docs/design.md section 1); the plan only picks the cheapest
exact way to get it:
- backend "auto" is "triton" on CUDA when flash-linear-attention is installed (not for float64, nor
  under torch.export, whose programs are torch ops), "torch" otherwise; "torch" is the portable PyTorch forms, which on a CPU, eagerly, work in the
  cache-sized groups and row blocks of lion_vit.ops.cpu (its groups.tuned is the switch); "triton"
  the GPU kernels of lion_vit.ops.triton, which exist for the chunk and rnn forms;
- form "auto" is the attention form, except on the triton backend for decayed sequences of at least
  AUTO_CHUNK_MIN_TOKENS tokens, where the chunk kernels run;
- the chunk form runs one product over the whole sequence where that takes fewer multiply-adds than
  chunks (chunk.whole_product_is_cheaper; always for LION-lit, where it is Q (K^T V));
- training where the chunk kernels' backward fails (triton.chunk_backward_fails: Hopper GPUs with
  Triton 3.4.0-3.7.0) runs the fused recurrent kernels instead, and says so once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import triton as triton_backend
from .chunk import chunk_count, whole_product_is_cheaper
from .cpu import groups as cpu_groups
from .rows import exporting

FORM_NAMES = ("attention", "rnn", "chunk")
FORM_CHOICES = ("auto",) + FORM_NAMES
BACKENDS = ("auto", "torch", "triton")

# Form "auto" on the triton backend runs the chunk kernels from this many tokens on (896 px at
# patch 16 has 3,136), the compilable attention form below. A guess until a GPU has run the forms
# part of `make gpu-check`, which times both forms side by side from 577 to 3,137 tokens.
AUTO_CHUNK_MIN_TOKENS = 1024

# The tile of flash-linear-attention's chunk kernels: the triton backend's chunk size.
TRITON_CHUNK = 64

_INSTALL_HINT = 'pip install "lion-vit[gpu]" (flash-linear-attention)'
_warned = set()


@dataclass(frozen=True)
class Plan:
    """What a LION layer runs for one sequence length.

    form: the form that runs (attention | rnn | chunk); backend: torch | triton; whole: the chunk form
    runs one product over the whole sequence; chunks: chunks per sequence (1 where whole or outside
    the chunk form); cpu_tuned: the torch backend on a CPU, eagerly, where the forms work in
    cache-sized groups of rows (lion_vit.ops.cpu; the same function either way, so not compared).
    """

    form: str
    backend: str
    whole: bool = False
    chunks: int = 1
    cpu_tuned: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        if self.form == "rnn":
            what = "fused recurrent kernels" if self.backend == "triton" else "recurrence loop"
        elif self.form == "chunk" and not self.whole:
            what = ("one chunk" if self.chunks == 1 else f"{self.chunks} chunks") + \
                (" (FLA kernels)" if self.backend == "triton" else "")
        else:
            what = "one masked product" if self.form == "attention" or self.whole else ""
        return f"{self.form} form, {self.backend} backend: {what}" + (", CPU row groups" if self.cpu_tuned else "")


def check_form(form: str, chunk_size: Optional[int] = None) -> None:
    """Raise ValueError for an unknown form or a chunk size that is not a positive integer."""
    if form not in FORM_CHOICES:
        raise ValueError(f"unknown attn_form {form!r}; choose one of {sorted(FORM_CHOICES)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None (whole sequence), got {chunk_size!r}")


def check_backend(backend: str) -> None:
    """Raise ValueError for an unknown backend."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attn_backend {backend!r}; choose one of {list(BACKENDS)}")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """"torch" or "triton" for a call on this device and dtype (see the module docstring).

    "triton" asked for without flash-linear-attention, for float64 or under torch.export is a ValueError;
    "auto" on CUDA without it warns once how to get the kernels.
    """
    check_backend(backend)
    if backend == "triton":
        if not triton_backend.available():
            raise ValueError(f"attn_backend='triton' needs flash-linear-attention: {_INSTALL_HINT}")
        if dtype == torch.float64:
            raise ValueError("attn_backend='triton' has no float64 kernels; use attn_backend='torch' for float64")
        if exporting():
            raise ValueError("torch.export cannot trace the triton kernels; export with attn_backend='torch' "
                             "(or 'auto', which exports the PyTorch forms)")
        return "triton"
    if backend == "auto" and device.type == "cuda" and dtype != torch.float64 and not exporting():
        if triton_backend.available():
            return "triton"
        _warn_once(f"LION layers run their portable PyTorch forms on CUDA; for the GPU kernels: {_INSTALL_HINT}")
    return "torch"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def plan(form: str, chunk_size: Optional[int], length: int, key_dim: int, value_dim: int, *,
         num_scans: int = 1, decayed: bool = True, device: torch.device = torch.device("cpu"),
         dtype: torch.dtype = torch.float32, backend: str = "auto", training: bool = False) -> Plan:
    """What runs for a call of `form` on sequences of `length` tokens (see the module docstring).
    training: autograd records the call (its backward will run)."""
    check_form(form, chunk_size)
    backend = resolve_backend(backend, device, dtype)
    if form == "auto":
        form = "chunk" if backend == "triton" and decayed and length >= AUTO_CHUNK_MIN_TOKENS else "attention"
    on_cpu = cpu_groups.tuned(device)  # (the torch backend's CPU tuning applies)
    if form == "attention":
        return Plan("attention", "torch", whole=True, cpu_tuned=on_cpu)
    if form == "rnn":  # (one token at a time: no groups)
        return Plan("rnn", backend)
    if backend == "triton":
        chunk_size = TRITON_CHUNK
    whole = (num_scans > 1 and (chunk_size is None or chunk_size >= length)) or whole_product_is_cheaper(
        length, chunk_size, key_dim, value_dim, num_scans, decayed=decayed)
    if whole:  # a product of torch matmuls either way
        return Plan("chunk", "torch", whole=True, cpu_tuned=on_cpu)
    if backend == "triton" and training and decayed and triton_backend.chunk_backward_fails(device):
        _warn_once("flash-linear-attention's chunk backward fails on Hopper GPUs with Triton 3.4.0 to 3.7.0 "
                   "(fla-org/flash-linear-attention#640): LION layers train through its fused recurrent kernels "
                   "instead (the same function); for the chunk kernels, upgrade Triton to 3.7.1 or later")
        return Plan("rnn", "triton")
    return Plan("chunk", backend, chunks=chunk_count(length, chunk_size), cpu_tuned=on_cpu and backend == "torch")
