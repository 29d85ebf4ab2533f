"""The one place that decides what runs: (form, backend, device, dtype, sequence length) -> a Plan.

Every form computes the same function (docs/design.md section 1); the plan only picks the cheapest
exact way to get it:
- backend "auto" is "triton" on CUDA when flash-linear-attention is installed (not for float64, nor
  under torch.export, whose programs are torch ops), "torch" otherwise; "torch" is the portable
  PyTorch forms (attention.py, recurrent.py, chunk.py: plain autograd, any device), "triton" the GPU
  kernels of lion_vit.ops.triton, for every form: the attention form fused in a bidirectional kernel of
  ours (one or two scans; nothing L x L in memory; more scans run the portable attention form), the chunk
  and rnn forms on FLA's; on a CPU without autograd, eagerly,
  "auto" runs the chunk form in groups of rows (lion_vit.ops.cpu, backend "cpu");
- form "auto" is the attention form, except for decayed sequences of at least Tuning.auto_chunk_min_tokens
  tokens (by training and number of scans: one, or two for two and more) on the triton backend, where the chunk
  kernels run, and of at least Tuning.cpu_auto_chunk_min_tokens on a CPU, where the chunk form runs (chunks of the
  call's chunk size, or Tuning.default_chunk_size); on CUDA without the kernels, the portable attention form at any
  length;
- the chunk form's chunks hold at most the call's chunk size, or Tuning.default_chunk_size tokens (the triton
  backend: its kernels' tile);
- the chunk form runs one product over the whole sequence where that takes fewer multiply-adds than
  chunks (chunk.whole_product_is_cheaper; always for LION-lit, where it is Q (K^T V)): on the triton
  backend the fused attention form's, elsewhere the portable one's;
- LION-lit's attention form is Q (K^T V), linear in L: on the triton backend two kernels of ours that map q and k
  as they read them (Tuning.linear_kernels), elsewhere torch matmuls;
- vector decays (one per key channel, vector.py) run FLA's vector-gate kernels on the triton backend, the
  portable vector forms elsewhere: eagerly on a CPU (training too) in groups of rows with masked products as
  large as the decays allow (backend "cpu"; training in float32 or float64 with a hand-written backward,
  Plan.hand_backward), else with the traceable fixed ones;
- training where the chunk kernels' backward fails (triton.chunk_backward_fails: Hopper GPUs with
  Triton 3.4.0-3.7.0) runs Tuning.chunk_backward_fallback instead, and says so once;
- a layer hands over q, k, v as views of its projection (token-major), which the triton backend reads as
  they are and the portable forms copy head-major;
- inference on the triton backend runs the batch in groups of images (Plan.grouped), so that the kernels'
  buffers stay a share of the batch's activations (Tuning.group_share);
- a batch whose kernel launches would pass CUDA's limit on a grid axis runs in parts (implementation).
The knobs (tuning.py) are read as a call is planned: `tuned(...)` sets them for a block.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import cpu as cpu_backend
from . import triton as triton_backend
from .attention import attention_form
from .chunk import chunk_count, chunk_form, whole_product_is_cheaper
from .features import mapped, query_scale
from .kept import kept
from .recurrent import recurrent_form
from .scalings import scaled
from .tuning import CHUNK_BACKWARD_FALLBACKS, tuning
from .vector import vector_form

FORM_NAMES = ("attention", "rnn", "chunk")
FORM_CHOICES = ("auto",) + FORM_NAMES
BACKENDS = ("auto", "torch", "triton")

# The fused attention form on the triton backend reads at most this many scans (the bidirectional kernel's).
# It was chosen over FLA's tiled quadratic kernel run on each scan forward and mirrored: timed side by side on an
# H200, it trained faster within less memory (docs/benchmarks.md, "Fused attention form").
FUSED_MAX_SCANS = 2

# The tile of flash-linear-attention's chunk kernels: the triton backend's chunk size.
TRITON_CHUNK = 64

# Vector decays' attention form is one chunk of their chunked form up to this many tokens, chunks of it above
# (the same function): the CPU training step's fastest chunk at 224 px (docs/benchmarks.md, "Vector decays").
VECTOR_ATTENTION_CHUNK = 32

_INSTALL_HINT = 'pip install "lion-vit[gpu]" (flash-linear-attention)'
_warned = set()


@dataclass(frozen=True)
class Plan:
    """What a LION layer runs for one sequence length.

    form: the form that runs (attention | rnn | chunk); backend: torch | cpu | triton; whole: the chunk form
    runs one product over the whole sequence; chunks: chunks per sequence (1 where whole or outside the
    chunk form); chunk_size: the most tokens per chunk the chunk form runs with (None: one chunk; on the
    triton backend its kernels' tile, TRITON_CHUNK); grouped: the triton backend runs the batch in groups
    of images (inference, where autograd keeps nothing and the kernels' buffers are what a call holds);
    backward_by_forward: the chunk kernels' backward runs as their forward pass (where FLA's own fails);
    vector: the decays are vectors, one per key channel (vector.py; triton/vector.py); hand_backward: the cpu
    backend trains them through chunks with a hand-written backward (cpu/chunks.py); linear: the one product is
    LION-lit's, Q (K^T V) with no mask (attention.py; triton/linear.py), linear in the tokens.
    """

    form: str
    backend: str
    whole: bool = False
    chunks: int = 1
    chunk_size: Optional[int] = None
    grouped: bool = False
    backward_by_forward: bool = False
    vector: bool = False
    hand_backward: bool = False
    linear: bool = False

    def __str__(self) -> str:
        if self.form == "rnn":
            what = "fused recurrent kernels" if self.backend == "triton" else "recurrence loop"
        elif (self.form == "chunk" or self.vector) and not self.whole:
            what = ("one chunk" if self.chunks == 1 else f"{self.chunks} chunks") + \
                {"triton": " (FLA kernels)", "cpu": " in groups of rows"}.get(self.backend, "") + \
                (", backward by their forward pass" if self.backward_by_forward else "") + \
                (", hand-written backward" if self.hand_backward else "")
        elif self.linear:
            what = "Q (K^T V), linear in the tokens" + (" (linear kernels)" if self.backend == "triton" else "")
        else:
            what = "one masked product" if self.form == "attention" or self.whole else ""
            if self.backend == "triton":
                what = "one fused masked product (bidirectional kernel)"
        return f"{self.form} form, {self.backend} backend: {what}" + (", in groups of images" if self.grouped else "") \
            + (", vector decays" if self.vector else "")


def check_form(form: str, chunk_size: Optional[int] = None) -> None:
    """Raise ValueError for an unknown form or a chunk size that is not a positive integer."""
    if form not in FORM_CHOICES:
        raise ValueError(f"unknown attn_form {form!r}; choose one of {sorted(FORM_CHOICES)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None (Tuning.default_chunk_size), got "
                         f"{chunk_size!r}")


def check_backend(backend: str) -> None:
    """Raise ValueError for an unknown backend."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attn_backend {backend!r}; choose one of {list(BACKENDS)}")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """"torch" or "triton" for a call on this device and dtype (see the module docstring).

    "triton" asked for off CUDA (unless Triton's interpreter runs), without flash-linear-attention, for float64
    or under torch.export is a ValueError; "auto" on CUDA without it warns once how to get the kernels.
    """
    check_backend(backend)
    if backend == "triton":
        if device.type != "cuda" and not triton_backend.interpreting():
            raise ValueError(f"the triton backend runs Triton kernels, which need a CUDA GPU, and this call is on "
                             f"{device.type}; choose the backend auto (the kernels on CUDA, the portable forms "
                             f"elsewhere) or torch (TRITON_INTERPRET=1 runs the kernels on a CPU, slowly: the tests' "
                             f"way)")
        if not triton_backend.available():
            raise ValueError(f"attn_backend='triton' needs flash-linear-attention, which "
                             f"{triton_backend.unavailable_reason()}: {_INSTALL_HINT}")
        if dtype == torch.float64:
            raise ValueError("attn_backend='triton' has no float64 kernels; use attn_backend='torch' for float64")
        if exporting():
            raise ValueError("torch.export cannot trace the triton kernels; export with attn_backend='torch' "
                             "(or 'auto', which exports the PyTorch forms)")
        return "triton"
    if backend == "auto" and device.type == "cuda" and dtype != torch.float64 and not exporting():
        if triton_backend.available():
            return "triton"
        _warn_once(f"LION layers run their portable PyTorch forms on CUDA (flash-linear-attention "
                   f"{triton_backend.unavailable_reason()}); for the GPU kernels: {_INSTALL_HINT}")
    return "torch"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def plan(form: str, chunk_size: Optional[int], length: int, key_dim: int, value_dim: int, *,
         num_scans: int = 1, decayed: bool = True, device: torch.device = torch.device("cpu"),
         dtype: torch.dtype = torch.float32, backend: str = "auto", training: bool = False,
         vector: bool = False) -> Plan:
    """What runs for a call of `form` on sequences of `length` tokens (see the module docstring).
    training: autograd records the call (its backward will run); vector: decays per key channel."""
    check_form(form, chunk_size)
    auto_backend = backend == "auto"
    backend = resolve_backend(backend, device, dtype)
    knobs = tuning()
    if form == "chunk" and chunk_size is None:  # chunks, as the form's name says (the triton kernels': their own)
        chunk_size = knobs.default_chunk_size
    if vector:  # vector.py: the attention form one chunk (or FLA's chunks), the rnn form chunks of 1
        form = "attention" if form == "auto" else form
        if backend == "triton":  # FLA's vector-gate kernels: chunked (attention and chunk forms) or recurrent
            return Plan(form, "triton", chunks=chunk_count(length, TRITON_CHUNK) if form != "rnn" else 1,
                        chunk_size=TRITON_CHUNK if form != "rnn" else None, vector=True)
        if form == "attention" and length > VECTOR_ATTENTION_CHUNK:  # one chunk where it fits, else chunks of it
            chunk_size = VECTOR_ATTENTION_CHUNK
        # eagerly on a CPU: in groups of rows, each group's chunks at once, leaves read from the decays
        # (lion_vit.ops.cpu; a compiler traces the portable forms)
        rows = auto_backend and backend == "torch" and device.type == "cpu" and not torch.compiler.is_compiling()
        if form != "rnn" and (rows or (chunk_size is not None and chunk_size < length)):
            return Plan(form, "cpu" if rows else "torch", chunks=chunk_count(length, chunk_size or length),
                        chunk_size=chunk_size, vector=True,
                        hand_backward=rows and training and dtype in (torch.float32, torch.float64) and
                        min(chunk_size or length, length) > 1)  # (chunks of one token: vector._in_loop)
        return Plan(form, "torch", whole=form != "rnn", vector=True)
    if form == "auto":  # (the triton backend's chunks are its kernels' tile, below)
        scans = min(num_scans, 2)  # (the thresholds' keys: one scan, or two and more)
        if backend == "triton":
            form = "chunk" if decayed and length >= knobs.auto_chunk_min_tokens[training, scans] else "attention"
        elif device.type == "cpu" and decayed and length >= knobs.cpu_auto_chunk_min_tokens[training, scans]:
            form = "chunk"
            chunk_size = knobs.default_chunk_size if chunk_size is None else chunk_size
        else:
            form = "attention"
    grouped = backend == "triton" and not training
    # the bidirectional kernel, or LION-lit's linear kernels
    fused = backend == "triton" and (num_scans <= FUSED_MAX_SCANS if decayed else knobs.linear_kernels)
    if form == "attention":
        return Plan("attention", "triton" if fused else "torch", whole=True, linear=not decayed)
    if form == "rnn":
        return Plan("rnn", backend, grouped=grouped)
    if backend == "triton":
        chunk_size = TRITON_CHUNK
    whole = (num_scans > 1 and chunk_size >= length) or whole_product_is_cheaper(
        length, chunk_size, key_dim, value_dim, num_scans, decayed=decayed)
    if whole:  # the attention form's product: fused on the triton backend (LION-lit: its linear kernels)
        return Plan("chunk", "triton" if fused else "torch", whole=True, linear=not decayed)
    fails = knobs.chunk_backward_fails
    if backend == "triton" and training and decayed and (
            triton_backend.chunk_backward_fails(device) if fails is None else fails):
        fallback = knobs.chunk_backward_fallback
        instead = CHUNK_BACKWARD_FALLBACKS[fallback]
        _warn_once(f"flash-linear-attention's chunk backward fails on Hopper GPUs with Triton 3.4.0 to 3.7.0 "
                   f"(fla-org/flash-linear-attention#640): LION layers train through {instead} instead (the same "
                   f"function); for the chunk kernels, upgrade Triton to 3.7.1 or later")
        if fallback == "rnn":
            return Plan("rnn", "triton")
        if fallback == "forward":
            return Plan("chunk", "triton", chunks=chunk_count(length, chunk_size), chunk_size=chunk_size,
                        backward_by_forward=True)
        return Plan("chunk", "torch", chunks=chunk_count(length, chunk_size), chunk_size=chunk_size)
    # (a compiler traces whole tensors: groups would tie its graph to the traced batch size)
    if auto_backend and backend == "torch" and device.type == "cpu" and not training and \
            not torch.compiler.is_compiling():
        backend = "cpu"
    return Plan("chunk", backend, chunks=chunk_count(length, chunk_size), chunk_size=chunk_size, grouped=grouped)


Form = Callable[..., Tuple[Tensor, Optional[Tensor]]]
# (q, k, v, log_decays [S, B|1, H|1, L|1] or None, orders [S, L] or None, chunk_size=, normalised=)
#   -> (numerator, normaliser or None where not normalised)
TORCH_FORMS = {"attention": attention_form, "rnn": recurrent_form, "chunk": chunk_form}


def implementation(run: Plan) -> Callable[..., Tensor]:
    """The function that computes a plan, (q, k, v, log_decays, orders, feature_map=, scaling=) -> Y: the triton
    backend's kernels (in parts of the batch where one launch could not take it whole), or a portable form (or the
    cpu backend's) divided by its normaliser, in chunks of the plan's chunk_size."""
    if run.backend == "triton":
        return partial(_within_launch_grids, _kernels(run), run)
    if run.vector:
        cpu_form = cpu_backend.trained_vector_form if run.hand_backward else cpu_backend.vector_form
        return _portable(cpu_form if run.backend == "cpu" else vector_form,
                         1 if run.form == "rnn" else run.chunk_size, in_rows=run.backend == "cpu")
    return _portable(TORCH_FORMS["attention" if run.whole else run.form], run.chunk_size,
                     in_rows=run.backend == "cpu")


def _kernels(run: Plan) -> Callable[..., Tensor]:
    """The triton backend's function for a plan (implementation's signature)."""
    if run.vector:
        return partial(triton_backend.vector_form, recurrent=run.form == "rnn")
    if run.whole:
        return triton_backend.linear_form if run.linear else triton_backend.bidirectional_form
    kernels = {"rnn": triton_backend.recurrent_form, "chunk": triton_backend.chunk_form}[run.form]
    if run.backward_by_forward:
        return partial(kernels, backward_by_forward=True)
    return partial(kernels, grouped=True) if run.grouped else kernels


def grid_rows_per_head(run: Plan, scans: int) -> int:
    """The program rows one image and head of a triton plan adds to the grid axis on which its kernels launch
    images and heads: one for the bidirectional and linear kernels (every scan in the same program); for FLA's
    kernels, two a scan (its sequence forward and mirrored, stacked on the batch axis), six where their backward
    runs as three forward passes stacked."""
    if run.whole and not run.vector:
        return 1
    return scans * (6 if run.backward_by_forward else 2)


def _within_launch_grids(function: Callable[..., Tensor], run: Plan, q: Tensor, k: Tensor, v: Tensor,
                         log_decays: Optional[Tensor], orders: Optional[Tensor], **kwargs) -> Tensor:
    """function's Y, in parts of the batch where the whole batch would launch the kernels with more program rows
    on a grid's second or third axis than CUDA allows (Tuning.grid_axis_limit): they put images x sequences x
    heads there (flash-linear-attention's too), so that, whole, 10,923 images of LION-d-small (6 heads) would not
    launch. Each image's Y is the same either way."""
    scans = len(log_decays) if log_decays is not None else len(orders) if orders is not None else 1
    images = max(1, tuning().grid_axis_limit // (q.shape[1] * grid_rows_per_head(run, scans)))
    batch = q.shape[0]
    if batch <= images:
        return function(q, k, v, log_decays, orders, **kwargs)
    parts = []
    for start in range(0, batch, images):
        part = slice(start, start + images)
        decays = log_decays[:, part] if log_decays is not None and log_decays.shape[1] > 1 else log_decays
        parts.append(function(q[part], k[part], v[part], decays, orders, **kwargs).transpose(1, 2))
    return torch.cat(parts).transpose(1, 2)  # (token-major, as one call returns it)


def _portable(form: Form, chunk_size: Optional[int], in_rows: bool) -> Callable[..., Tensor]:
    """A portable form divided by its normaliser (`_divided`), on the whole batch or (in_rows, the cpu backend)
    group of rows by group."""
    call = partial(_divided, form, chunk_size=chunk_size)
    return partial(cpu_backend.in_row_groups, call) if in_rows else call


def _divided(form: Form, q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
             chunk_size: Optional[int] = None, feature_map: Optional[str] = None, scaling: str = "sum") -> Tensor:
    """Y of a form that returns numerator and normaliser: q, k mapped first (feature_map: a FEATURE_MAPS
    name, or None for features) and, for scaling "sum", q scaled by query_scale (float16 under autocast
    stays finite), then the scaling (scalings.py) in the dtype the form returns, cast to v's."""
    q, k = mapped(q, k, feature_map)
    if scaling == "sum":
        q = q * query_scale(q.shape[-2])  # rebound: the unscaled features are not kept while the form runs
    # head-major v, as the forms' matmuls read best (a layer hands over a view of its projection)
    numerator, normaliser = form(q, k, v.contiguous(), log_decays, orders, chunk_size=chunk_size,
                                 normalised=scaling != "none")  # (scaling "none" reads no normaliser)
    return scaled(numerator, normaliser, scaling).to(v.dtype)


def records_autograd(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a call on these tensors (None entries ignored): plan's `training`."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def exporting() -> bool:
    """Whether torch.export is tracing: its programs are torch ops, which the GPU kernels are not. The flag
    behind torch.compiler.is_exporting is read directly: Dynamo before torch 2.13 traces that function as
    True under torch.compile too (pytorch/pytorch#176347), which would keep compiled models off the kernels."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))  # (private: a torch without it, never)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
                 orders: Optional[Tensor] = None) -> None:
    """Raise ValueError for shapes the forms would otherwise fail on deep inside (or, for per-token
    decays, broadcast into a wrong result) or dtypes, and, on a CPU, for decays above 1 (the log-space masks
    assume log(lam) <= 0) and orders that are not permutations. (A GPU skips the value checks, which would
    synchronise every layer; so does a compiler.) log_decays: [S, ...] (ops.lion_attention); orders: [S, L], or
    None for one scan."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k [B, H, L, Dk] and v [B, H, L, Dv] with the same B, H, L; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k and v of one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}: "
                         "cast them alike, e.g. .float()")
    batch, heads, length = q.shape[:3]
    if length == 0:
        raise ValueError(f"expected at least one token; got q {tuple(q.shape)} (L = 0)")
    if orders is not None and (orders.dim() != 2 or orders.shape[-1] != length or orders.is_floating_point()):
        raise ValueError(f"orders must be integer [S, L] with L = {length} (q's tokens); got {orders.dtype} "
                         f"{list(orders.shape)}")
    if orders is not None and orders.device.type == "cpu" and not torch.compiler.is_compiling() and not kept(
            orders, ("permutations",), lambda: bool((orders.sort(-1).values == torch.arange(length)).all())):
        raise ValueError(f"orders must be permutations: each scan's row [L] holds every token 0..{length - 1} once "
                         f"(scan position -> token); a row repeats or misses one")
    if log_decays is None:
        return
    scans = 1 if orders is None else len(orders)
    if log_decays.dim() == 0 or len(log_decays) != scans:
        got = "a scalar" if log_decays.dim() == 0 else f"{len(log_decays)} scans ({list(log_decays.shape)})"
        raise ValueError(f"log_decays must be [S, ...] with one entry per scan, S = {scans} "
                         f"({'one scan: no orders' if orders is None else 'the orders given'}); got {got}"
                         + ("; for one scan pass log_decay[None]" if orders is None else ""))
    shape = tuple(log_decays.shape[1:])
    if len(shape) == 4:  # vector decays, one per key channel: [B|1, H|1, L, Dk]
        if shape[2:] != (length, q.shape[-1]) or \
                any(size not in (1, full) for size, full in zip(shape, (batch, heads))):
            raise ValueError(f"vector log decays must be [S, B|1, H|1, L, Dk] with [B, H, L, Dk] = [{batch}, {heads}, "
                             f"{length}, {q.shape[-1]}]; got {list(log_decays.shape)}")
    elif (len(shape) > 3 or (shape and shape[-1] not in (1, length))
            or any(size not in (1, full) for size, full in zip(shape[::-1][1:], (heads, batch)))):
        raise ValueError(f"each scan's log decays must broadcast to [B, H, L] = [{batch}, {heads}, {length}] with a "
                         f"last dimension of 1 (one decay per head) or L (one per token), or be [B|1, H|1, L, Dk] "
                         f"(one per key channel); got {list(shape)}")
    if log_decays.device.type == "cpu" and not torch.compiler.is_compiling() and bool((log_decays > 0).any()):
        raise ValueError(f"log decays must be <= 0 (decays in (0, 1]), got up to {log_decays.max().item():.3g}; "
                         "pass log(lam), e.g. F.logsigmoid(logits)")
