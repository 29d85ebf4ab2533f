"""LION's chunk and rnn forms on flash-linear-attention's causal kernels, token-major end to end.

FLA's scalar-gated recurrence is  S_p = exp(g_p) S_{p-1} + k_p v_p^T,  o_p = scale q_p^T S_p,  over
[B, L, H, D] tensors. With a_t = log lam_t and a scan order o (o[p]: the token at scan position p),
every scan is two such sequences, stacked on the batch axis so that one kernel launch runs all of them
(docs/design.md section 3):

    forward:   q, k, v at o[p],  g_p = a(o[p-1])                     -> token o[p] gets o_p
    mirrored:  k, v at u[p] = o[L-1-p],  q at u[p+1],  g_p = a(u[p-1]) -> token u[p+1] gets lam(u[p]) o_p

The mirrored sequence is strictly causal: its query runs one token ahead of its keys, so it sums the
tokens after t in scan order without t itself, and the factor lam(u[p]) = lam of the token after t
(0 for the scan's last token) completes the mask; it scales that query (its "fold"). The diagonal is
counted once, by the forward pass. The normalisers (the same with v = 1) come from a scan of ours
(normaliser.py). Two fused steps (operands.py) surround the kernels: one reads raw q, k, v, applies the
feature maps and folds and writes the kernels' operands; one sums every token's outputs and normalisers
and divides. Autograd keeps raw q and k, the folds, the kernels' inputs, Y and the normaliser.

q is scaled by 2^-round(log2(L) / 2) inside the kernels (their `scale`): exact in binary, cancelled by
the division, and it keeps float16 normalisers of long sequences finite (docs/design.md, "float16").
"""
from __future__ import annotations

import importlib.util
import re
from functools import lru_cache, wraps
from typing import TYPE_CHECKING, Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..features import mapped, query_scale
from ..kept import kept
from ..tuning import tuning

if TYPE_CHECKING:  # (operands.py imports Triton: only once a call runs the kernels)
    from .operands import Layout


@torch.compiler.assume_constant_result  # (a compiled model's plan calls it instead of tracing into it)
def available() -> bool:
    """Whether flash-linear-attention's kernels import (`pip install "lion-vit[gpu]"`)."""
    return not isinstance(_kernels(), str)


def unavailable_reason() -> str:
    """Why the kernels are not available ("" where they are): not installed, or installed but failing to
    import (a missing dependency, a mismatched Triton), with the error's first line."""
    kernels = _kernels()
    return kernels if isinstance(kernels, str) else ""


@lru_cache(maxsize=None)
def _kernels():
    """FLA's two entry points used here, or the reason they do not import."""
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
        return "is not installed"
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except Exception as error:  # any failure of a third-party import
        return f"is installed but does not import ({type(error).__name__}: {str(error).partition(chr(10))[0]})"
    return chunk_simple_gla, fused_recurrent_simple_gla


@lru_cache(maxsize=None)
def _vector_kernels():
    """FLA's vector-gate kernels (chunk_gla, fused_recurrent_gla), for vector decays (vector.py)."""
    from fla.ops.gla import chunk_gla, fused_recurrent_gla
    return chunk_gla, fused_recurrent_gla


@torch.compiler.assume_constant_result
def chunk_backward_fails(device: torch.device) -> bool:
    """Whether FLA's gated chunk backward refuses to run on this device: on Hopper GPUs (H100, H200)
    Triton 3.4.0 to 3.7.0 miscompile it (fla-org/flash-linear-attention#640) and FLA raises instead."""
    return device.type == "cuda" and torch.cuda.is_available() and _hopper_triton_bug(
        torch.cuda.get_device_capability(device), _installed_triton_version())


def _hopper_triton_bug(capability: Tuple[int, int], triton_version: str) -> bool:
    version = tuple(int(part) for part in re.findall(r"\d+", triton_version)[:3])
    return capability[0] == 9 and (3, 4, 0) <= version < (3, 7, 1)


@lru_cache(maxsize=None)
def _installed_triton_version() -> str:
    import triton
    return triton.__version__


class _Indices(NamedTuple):
    """Where every token goes, for S scans of L tokens."""
    order: Tensor  # [S, L]: scan position -> token
    following: Tensor  # [S, L]: token -> the next token in scan order
    last: Tensor  # [S, 1, L, 1]: whether a token is its scan's last
    layout: Layout  # what the fused steps read (operands.py)
    position: Tensor  # [S, L]: token -> scan position


def _scan_indices(orders: Optional[Tensor], length: int, device: torch.device) -> _Indices:
    """The indices of S scans (orders [S, L], or None: one scan in token order), built once per orders
    tensor (a model keeps one per grid) or length and kept, so that a call launches no index arithmetic."""
    return kept(orders, ("scan indices", length, device), lambda: _indices(orders, length, device))


def _indices(orders: Optional[Tensor], length: int, device: torch.device) -> _Indices:
    """_scan_indices' indices, built."""
    from .operands import Layout
    order = torch.arange(length, device=device)[None] if orders is None else orders
    mirrored = order.flip(-1)
    position = torch.argsort(order, dim=-1)  # token -> scan position
    # the mirrored sequence's queries run one token ahead of its keys: u[p + 1] against u[p]
    q_index = torch.stack([order, mirrored.roll(-1, -1)], 1).flatten()
    kv_index = torch.stack([order, mirrored], 1).flatten()
    layout = Layout(q_index, kv_index, torch.stack([position, (length - 2 - position) % length], 1).flatten(0, 1),
                    torch.stack([position, length - 1 - position], 1).flatten(0, 1))
    following = order.roll(-1, -1).gather(-1, position)
    return _Indices(order, following, (position == length - 1)[:, None, :, None], layout, position)


def _gates_and_folds(log_decays: Optional[Tensor], indices: _Indices, batch: int, heads: int
                     ) -> Tuple[Optional[Tensor], Tensor]:
    """The kernels' gates [B * 2S, L, H] in float32 (None without decays) and each token's fold, the factor
    on its mirrored query, [S, B, L, H] float32 in token order: lam of the next token in scan order, 0 for
    the scan's last token."""
    scans, length = indices.order.shape
    if log_decays is None:
        return None, (~indices.last).float().expand(scans, batch, length, heads)
    a = log_decays.float()  # [S, B|1, H|1, L|1] in token order
    if a.shape[-1] == 1:  # one decay per head: every gate is it (the first one meets a zero state)
        gates = a.expand(scans, batch, heads, 1).permute(1, 0, 3, 2).expand(batch, scans, 2 * length, heads)
        fold = a.exp().permute(0, 1, 3, 2)
    else:
        a = a.expand(scans, a.shape[1], a.shape[2], length)
        sequences = a.unflatten(-1, (1, length)).expand(-1, -1, -1, 2, -1).gather(
            -1, indices.layout.kv.view(scans, 1, 1, 2, length).expand(-1, *a.shape[1:3], -1, -1))
        gates = F.pad(sequences[..., :-1], (1, 0)).flatten(-2).permute(1, 0, 3, 2)  # g_p = a(previous token)
        gates = gates.expand(batch, scans, 2 * length, heads)
        fold = a.gather(-1, indices.following[:, None, None].expand_as(a)).exp().permute(0, 1, 3, 2)
    folds = fold.masked_fill(indices.last, 0.0).expand(scans, batch, length, heads)
    # contiguous once here: FLA's input guard and the normaliser scan read the same tensor, no copy each
    return gates.reshape(batch * scans * 2, length, heads).contiguous(), folds


def _chunk(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, scale: Optional[float] = None):
    """FLA's chunk_simple_gla, (o, final state); looked up inside the call, which a compiler does not trace."""
    return _kernels()[0](q, k, v, g=g, scale=scale)


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None, scale: Optional[float] = None):
    """FLA's fused_recurrent_simple_gla, (o, final state), looked up as _chunk's."""
    return _kernels()[1](q, k, v, g=g, scale=scale)


class _ForwardBackward(torch.autograd.Function):
    """FLA's chunk kernels with a backward made of their own forward pass, for where FLA's chunk backward
    fails (chunk_backward_fails). The gradients of o = scale (q k^T * M) v, M_ts = exp(G_t - G_s) for s <= t
    (G: the gates' cumulative sum), are such causal products themselves (docs/design.md section 3):

        dq = forward(do, v, k; g)      dk = R forward(R v, R do, R q; g')      dv = R forward(R k, R q, R do; g')

    R reverses the tokens, and g'_p = g_{L-p} (g'_0 = 0) makes the reversed sequence's mask M^T; the gates'
    gradient is the reverse cumulative sum of q . dq - k . dk. One launch runs the three problems, stacked
    on the batch axis, where the key and value widths agree."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], scale: float) -> Tensor:
        ctx.save_for_backward(q, k, v, g)
        ctx.scale = scale
        return _chunk(q, k, v, g=g, scale=scale)[0]

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, g = ctx.saved_tensors
        gates = None if g is None else F.pad(g.flip(1)[:, :-1], (0, 0, 1, 0))  # g'_p = g_{L-p}
        dq, dk, dv = _forwards([(do, v, k, g, False), (v, do, q, gates, True), (k, q, do, gates, True)], ctx.scale)
        dk, dv = dk.flip(1), dv.flip(1)  # (a reversed problem's output comes in reversed token order)
        dg = None
        if g is not None and ctx.needs_input_grad[3]:  # d/dG_t; g_s is in every G_t with t >= s
            dG = (q * dq).sum(-1, dtype=torch.float32) - (k * dk).sum(-1, dtype=torch.float32)
            dg = dG.flip(1).cumsum(1).flip(1)
        return dq, dk, dv, dg, None


def _forwards(problems, scale: float) -> list:
    """The outputs of causal problems by FLA's chunk forward, those of the same query and value widths in
    one call, stacked on the batch axis. A problem: queries, keys, values [N, L, H, D], gates [N, L, H] or
    None, and whether its tensors are read in reversed token order."""
    outputs = [None] * len(problems)
    widths: Dict[Tuple[int, int], list] = {}
    for index, (q, _, v, _, _) in enumerate(problems):
        widths.setdefault((q.shape[-1], v.shape[-1]), []).append(index)
    for members in widths.values():
        chosen = [problems[index] for index in members]
        q, k, v = (_stacked([problem[part] for problem in chosen], [problem[4] for problem in chosen])
                   for part in range(3))
        g = None if chosen[0][3] is None else torch.cat([problem[3] for problem in chosen])
        out, _ = _chunk(q, k, v, g=g, scale=scale)
        for index, output in zip(members, out.chunk(len(members))):
            outputs[index] = output
    return outputs


def _stacked(tensors, reversed_: list) -> Tensor:
    """tensors [N, L, ...] stacked on the batch axis, each written once, in reversed token order where
    reversed_ says so (no flipped copy first)."""
    first = tensors[0]
    out = first.new_empty((len(tensors) * first.shape[0], *first.shape[1:]))
    backwards = torch.arange(first.shape[1] - 1, -1, -1, device=first.device) if any(reversed_) else None
    for target, tensor, reverse in zip(out.chunk(len(tensors)), tensors, reversed_):
        if reverse:
            torch.index_select(tensor, 1, backwards, out=target)
        else:
            target.copy_(tensor)
    return out


def _chunk_with_forward_backward(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                                 scale: Optional[float] = None) -> Tuple[Tensor, None]:
    """chunk_simple_gla's call and outputs, with _ForwardBackward's backward."""
    return _ForwardBackward.apply(q, k, v, g, scale), None


class _FirstOrderOnly(torch.autograd.Function):
    """The identity, whose backward refuses to be differentiated: the kernels' hand-written backwards have no
    double backward, and without this a second-order gradient fails deep inside autograd or comes
    back silently missing."""

    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is wanted
            raise RuntimeError("the triton backend has no double backward; for "
                               "second-order gradients use attn_backend='torch'")
        return grad


def chunk_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor] = None,
               chunk_size: Optional[int] = None, feature_map: Optional[str] = None, grouped: bool = False,
               backward_by_forward: bool = False, scaling: str = "sum") -> Tensor:
    """Y [B, H, L, Dv] by FLA's chunked kernels (`chunk_simple_gla`), every scan and direction in one call.
    chunk_size is the torch backend's; the kernels use their own tile of 64 tokens. q, k, v: [B, H, L, D]
    (any strides; token-major reads best); log_decays: None or [S, B|1, H|1, L|1] in token order; orders:
    [S, L] or None; feature_map: a FEATURE_MAPS name that maps q and k first, or None (q, k are features);
    grouped: one call per group of images (Tuning.group_share), for inference: no autograd; backward_by_forward:
    the kernels' backward runs as their forward pass (_ForwardBackward), where FLA's own fails; scaling: a
    scalings.SCALINGS name, which the finishing step applies."""
    kernel = _chunk_with_forward_backward if backward_by_forward else _chunk
    return _run(kernel, q, k, v, log_decays, orders, feature_map, grouped, "chunk", scaling)


def recurrent_form(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor] = None,
                   chunk_size: Optional[int] = None, feature_map: Optional[str] = None,
                   grouped: bool = False, scaling: str = "sum") -> Tensor:
    """Y by FLA's fused recurrent kernel: every scan and direction in one launch, O(L d) memory. Arguments
    as chunk_form's."""
    return _run(_recurrent, q, k, v, log_decays, orders, feature_map, grouped, "rnn", scaling)


# what inference traced by a compiler runs (_INFERENCE_OP), by form
_KERNELS = {"chunk": _chunk, "rnn": _recurrent}


def _run(kernel: Callable[..., Tuple[Tensor, Tensor]], q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor],
         orders: Optional[Tensor], feature_map: Optional[str], grouped: bool, form: str, scaling: str) -> Tensor:
    """Y [B, H, L, Dv] (a view of [B, L, H, Dv]). A compiler traces inference (grouped) as one op of its
    graph (_INFERENCE_OP), so that CUDA graphs can capture it, and breaks its graph around a call that
    autograd records: the kernels' own autograd Functions run eagerly."""
    if grouped:
        from ..dispatch import records_autograd
        if records_autograd(q, k, v, log_decays):
            raise RuntimeError("grouped calls of the triton kernels are for inference: autograd cannot record them")
        if _INFERENCE_OP is not None and torch.compiler.is_compiling():
            return _INFERENCE_OP(q, k, v, log_decays, orders, feature_map, form, scaling).transpose(1, 2)
    return _eagerly(kernel, q, k, v, log_decays, orders, feature_map, grouped, form, scaling).transpose(1, 2)


def launched_on_device_of(position: int) -> Callable[[Callable], Callable]:
    """Runs the decorated function with the CUDA device of its positional argument `position` current: Triton
    launches on the current device, so a model on cuda:1 in a process whose current device is cuda:0 would
    otherwise fail (FLA's own entry points guard theirs the same way)."""
    def decorate(function: Callable) -> Callable:
        @wraps(function)
        def run(*args, **kwargs):
            tensor = args[position]
            if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
                with torch.cuda.device(tensor.device):
                    return function(*args, **kwargs)
            return function(*args, **kwargs)
        return run
    return decorate


@torch.compiler.disable  # (the kernels and their bookkeeping run eagerly)
@launched_on_device_of(1)  # (q)
def _eagerly(kernel: Callable[..., Tuple[Tensor, Tensor]], q: Tensor, k: Tensor, v: Tensor,
             log_decays: Optional[Tensor], orders: Optional[Tensor], feature_map: Optional[str], grouped: bool,
             form: str, scaling: str) -> Tensor:
    """Y [B, L, H, Dv] of _run."""
    q, k, feature_map, dtype = kernel_inputs(q, k, v, feature_map)
    batch, heads, length, value_dim = v.shape
    indices = _scan_indices(orders, length, q.device)
    if not grouped:
        return _FirstOrderOnly.apply(_on_kernels(kernel, q, k, v, log_decays, indices, feature_map, dtype, scaling))
    y = v.new_empty(batch, length, heads, value_dim)
    groups = -(-batch // _images_per_group(batch, heads, q.shape[-1], value_dim, len(indices.layout.kv) // length,
                                           dtype, form, q.device))
    for group in range(groups):  # (sizes within one image of each other)
        part = slice(batch * group // groups, batch * (group + 1) // groups)
        decays = None if log_decays is None else log_decays[:, part] if log_decays.shape[1] > 1 else log_decays
        _on_kernels(kernel, q[part], k[part], v[part], decays, indices, feature_map, dtype, scaling, into=y[part])
    return y


def kernel_inputs(q: Tensor, k: Tensor, v: Tensor, feature_map: Optional[str]
                  ) -> Tuple[Tensor, Tensor, Optional[str], torch.dtype]:
    """q, k and the feature map the kernels apply as they read them (a map they do not know is applied here,
    and its name is then None), and the kernels' dtype: q's, k's and v's promoted (float64 refused)."""
    from .operands import FUSED_MAPS
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    if dtype == torch.float64:
        raise ValueError("the triton backend has no float64 kernels; use backend='torch' for float64")
    if feature_map is not None and feature_map not in FUSED_MAPS:  # a map the kernels do not know
        (q, k), feature_map = mapped(q, k, feature_map), None
    return q, k, feature_map, dtype


def _inference_op():
    """Inference through the kernels as a torch.library custom op: what a compiler traces in place of _run, an
    opaque node of its graph instead of a break. None where it cannot be registered."""

    def inference(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
                  feature_map: Optional[str], form: str, scaling: str) -> Tensor:
        return _eagerly(_KERNELS[form], q, k, v, log_decays, orders, feature_map, True, form, scaling)

    def shape(q: Tensor, k: Tensor, v: Tensor, log_decays: Optional[Tensor], orders: Optional[Tensor],
              feature_map: Optional[str], form: str, scaling: str) -> Tensor:
        batch, heads, length, value_dim = v.shape
        return v.new_empty(batch, length, heads, value_dim)

    try:
        op = torch.library.custom_op("lion_vit::triton_inference", inference, mutates_args=())
    except Exception:  # (a torch whose schema inference does not read these annotations)
        return None
    op.register_fake(shape)
    return op


_INFERENCE_OP = _inference_op()


def _images_per_group(batch: int, heads: int, key_dim: int, value_dim: int, sequences: int, dtype: torch.dtype,
                      form: str, device: torch.device) -> int:
    """How many images a group holds: its kernel buffers per token and head, sequences x (q, k, v stacked;
    the chunk kernels' outputs and states, one per tile of TRITON_CHUNK tokens, or the recurrent kernel's
    float32 outputs and their cast), within Tuning.group_share of the batch's q, k, v; for the recurrent kernel,
    at least the images whose programs (sequences x heads x its tiles) cover the multiprocessors."""
    from ..dispatch import TRITON_CHUNK
    from .operands import even
    itemsize = torch.finfo(dtype).bits // 8
    key_width, value_width = even(key_dim), even(value_dim)
    kernels = {"chunk": (value_width + key_width * value_width // TRITON_CHUNK) * itemsize,
               "rnn": value_width * (4 + itemsize)}[form]
    per_image = sequences * ((2 * key_width + value_width) * itemsize + kernels)
    images = max(1, int(tuning().group_share * batch * (2 * key_dim + value_dim) * itemsize // per_image))
    if form != "rnn":
        return images
    programs = sequences * heads * -(-key_width // 64) * -(-value_width // 64)  # FLA's tiles: 64 x 64 at most
    return max(images, -(-_multiprocessors(device) // programs))


def _multiprocessors(device: torch.device) -> int:
    """Tuning.recurrent_group_programs, or the device's multiprocessor count (1 but on CUDA)."""
    programs = tuning().recurrent_group_programs
    if programs is not None:
        return programs
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _on_kernels(kernel: Callable[..., Tuple[Tensor, Tensor]], q: Tensor, k: Tensor, v: Tensor,
                log_decays: Optional[Tensor], indices: _Indices, feature_map: Optional[str], dtype: torch.dtype,
                scaling: str, into: Optional[Tensor] = None) -> Tensor:
    """Y [B, L, H, Dv] of one call of the kernels on every scan and direction (or, without autograd, written
    into `into`, a slice of a batch's Y). q's power-of-two scale (query_scale) is for scaling "sum", whose
    division cancels it; "none" needs no normaliser."""
    from .normaliser import Normaliser
    from .operands import Finish, Operands, finish
    batch, heads, length, value_dim = v.shape
    gates, folds = _gates_and_folds(log_decays, indices, batch, heads)
    q2, k2, v2 = Operands.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), folds, indices.layout,
                                feature_map, dtype)
    scale = query_scale(length) if scaling == "sum" else 1.0
    out, _ = kernel(q2, k2, v2, g=gates, scale=scale)
    normalisers = out.new_zeros(out.shape[:3], dtype=torch.float32) if scaling == "none" else \
        Normaliser.apply(q2, k2, gates, scale)
    if into is None:
        return Finish.apply(out, normalisers, indices.layout, batch, value_dim, v.dtype, scaling)
    finish(out, normalisers, indices.layout, into, scaling)
    return into
