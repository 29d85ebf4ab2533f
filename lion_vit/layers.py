"""LionAttention: a drop-in replacement for timm's `Attention` built on the LION ops.

One module covers every variant: `decay` names the kind of mask (lion_vit.decays: lit, all ones;
fixed, one learnable decay per head; selective, an input-dependent decay per token and head; or a
kind registered there), which the layer builds as its submodule `decay`, and `num_scans` picks
single-scan (raster order) or the two snake scans of the "natural" models. The form
(attention | rnn | chunk) can be switched at any time without touching the weights.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .decays import DECAYS, Decay
from .gates import KEY_GATES, KeyGate
from .ops import (POSITIVE_FEATURE_MAPS, Plan, check_backend, check_form, check_scaling, get_feature_map,
                  lion_attention, mask_dtype, plan, snake_orders)
from .ops.features import QUERIES_ONLY


def fx_tracing() -> bool:
    """Whether torch.fx symbolic tracing is running this code: shapes and arguments are then symbols,
    which Python checks cannot read."""
    fx = torch.fx._symbolic_trace
    return getattr(fx, "is_fx_symbolic_tracing", fx.is_fx_tracing)()  # (the latter: torch < 2.6)


# torch.fx symbolic tracing records these as single calls (leaves) instead of tracing through their
# branches on shapes, dtypes and devices; they run with real tensors when the traced graph runs
def _log_decays(log_decay: Tensor, x: Tensor, fixed_prefix: int = 0, vector: bool = False) -> Tensor:
    """A decay kind's log decays [S, B|1, H, L|1] (vector: [S, B|1, H, L, Dk]) in float32 (float64 for float64
    inputs) on x's device; the first fixed_prefix tokens' per-token decays are 1."""
    log_decay = log_decay.to(x.device, mask_dtype(x.dtype))
    tokens = -2 if vector else -1
    if fixed_prefix and log_decay.shape[tokens] > 1:
        log_decay = torch.cat([torch.zeros_like(log_decay.narrow(tokens, 0, fixed_prefix)),
                               log_decay.narrow(tokens, fixed_prefix, log_decay.shape[tokens] - fixed_prefix)], tokens)
    return log_decay


def _eager(value: object) -> bool:
    """Whether value is a tensor of an eager call, whose shape Python may check: not a torch.fx symbol (a Proxy), not
    traced by torch.compile or torch.export (whose guards a check would add to)."""
    return isinstance(value, Tensor) and not torch.compiler.is_compiling()


def _gated(k: Tensor, gate: Tensor, replaces: bool = False) -> Tensor:
    """Key features [B, H, L, D] times their gate [B|1, H, L, 1 | D] in the keys' dtype (or, replaces, the gate as
    the keys, in k's shape and dtype)."""
    return gate.to(k.dtype).expand_as(k) if replaces else k * gate.to(k.dtype)


def _scan_orders(cache: dict, height: int, width: int, prefix: int, num_tokens: int, device: torch.device) -> Tensor:
    """The two snake orders of a height x width grid after `prefix` leading tokens, on device, kept in cache."""
    if height * width + prefix != num_tokens:
        raise ValueError(f"grid {height}x{width} + {prefix} prefix tokens does not match {num_tokens} tokens")
    if torch.compiler.is_compiling():  # built in the graph: a graph that read the cache would be guarded on what it
        return snake_orders(height, width, prefix).to(device)  # held, and recompiled once a forward had filled it
    key = (height, width, prefix, device)
    if key not in cache:
        cache[key] = snake_orders(height, width, prefix).to(device)
    return cache[key]


for _leaf in ("_log_decays", "_gated", "_scan_orders", "lion_attention"):
    torch.fx.wrap(_leaf)


def _decay_parameters_in_their_module(state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: a layer's decay parameters as checkpoints before the decay kinds were modules
    named them (`decay_logit`, `decay_proj.weight`) are the kind's own (`decay.logit`, `decay.proj.weight`)."""
    for key in [key for key in state_dict if key.startswith(prefix + "decay_")]:
        state_dict[prefix + "decay." + key[len(prefix + "decay_"):]] = state_dict.pop(key)


class LionAttention(nn.Module):
    """Multi-head LION attention with timm's `Attention` constructor and call signature."""

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.0,
            proj_drop: float = 0.0,
            norm_layer: Optional[type] = None,
            decay: str = "lit",
            num_scans: int = 1,
            feature_map: str = "silu_norm",
            scaling: str = "sum",
            key_gate: str = "none",
            attn_form: str = "attention",
            chunk_size: Optional[int] = None,
            attn_backend: str = "auto",
            prefix_decay_one: bool = False,
            device: Optional[torch.device] = None,
            dtype: Optional[torch.dtype] = None,
            **_: object,  # other timm Attention arguments (scale_norm, ...) are not used
    ) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be a positive integer, got {num_heads}")
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        if decay not in DECAYS:
            raise ValueError(f"unknown decay {decay!r}; choose one of {sorted(DECAYS)} (lion_vit.decays.register_decay "
                             "adds one)")
        if key_gate not in KEY_GATES:
            raise ValueError(f"unknown key_gate {key_gate!r}; choose one of {sorted(KEY_GATES)} "
                             "(lion_vit.gates.register_key_gate adds one)")
        if KEY_GATES[key_gate].replaces_keys and not DECAYS[decay].decayed:
            raise ValueError(f"key_gate={key_gate!r} makes the keys of the decays; decay={decay!r} has none")
        if KEY_GATES[key_gate].replaces_keys and num_scans > 1 and \
                not DECAYS[decay].shared_by_scans:
            raise ValueError(f"key_gate={key_gate!r} makes one set of keys of the decays, but decay={decay!r} "
                             "gives each scan its own; use a decay kind that every scan shares (hgrn2) or num_scans=1")
        if num_scans not in (1, 2):
            raise ValueError(f"num_scans must be 1 (raster) or 2 (row and column snakes), got {num_scans}")
        if num_scans == 2 and not DECAYS[decay].decayed:
            raise ValueError("multi-scan needs a decay: with an all-ones mask every scan is the same")
        if attn_drop:
            raise ValueError("attn_drop is not supported: the rnn and chunk forms never form attention weights")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.decay_name = decay
        self.num_scans = num_scans
        self.feature_map_name = feature_map
        get_feature_map(feature_map)  # (an unknown name is a ValueError here; the op applies the map)
        check_scaling(scaling)
        if scaling == "sum" and feature_map not in POSITIVE_FEATURE_MAPS:
            raise ValueError(f"scaling='sum' divides by sum_j q_i . k_j, which needs positive features: feature_map="
                             f"{feature_map!r} is not one of {sorted(POSITIVE_FEATURE_MAPS)}; pick one, or "
                             "scaling='none' or 'max'")
        self.scaling = scaling
        self.set_attn_form(attn_form, chunk_size, attn_backend)
        self.prefix_decay_one = prefix_decay_one  # selective decays of prefix (class) tokens fixed to 1
        # Set by the backbone before each forward: patch grid and leading class/register tokens.
        self.grid_size: Optional[Tuple[int, int]] = None
        self.num_prefix_tokens = 0
        self._orders: Dict[Tuple[int, int, int, torch.device], Tensor] = {}

        dd = {"device": device, "dtype": dtype}  # timm's factory arguments (meta-device construction)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        norm_layer = norm_layer or nn.LayerNorm
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.decay: Decay = DECAYS[decay](dim, num_heads, num_scans, **dd)
        self.key_gate_name = key_gate
        self.key_gate: KeyGate = KEY_GATES[key_gate](dim, num_heads, **dd)
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_decay_parameters()
        self._register_load_state_dict_pre_hook(_decay_parameters_in_their_module)

    def reset_decay_parameters(self) -> None:
        """Initialise the decays and the key gate (called again after timm's generic weight init)."""
        self.decay.reset_parameters()
        self.key_gate.reset_parameters()

    @property
    def decayed(self) -> bool:
        """Whether the mask has decays (False for LION-lit's all-ones mask)."""
        return self.decay.decayed

    def set_attn_form(self, attn_form: str, chunk_size: Optional[int] = None, backend: Optional[str] = None) -> None:
        """Switch the form (and chunk size; backend too unless None). Same weights, same function. Unknown
        values are a ValueError, and change nothing."""
        check_form(attn_form, chunk_size)
        if backend is not None:
            check_backend(backend)
            self.attn_backend = backend
        self.attn_form, self.chunk_size = attn_form, chunk_size

    def attn_plan(self, num_tokens: int, device: Optional[torch.device] = None,
                  dtype: Optional[torch.dtype] = None, training: Optional[bool] = None) -> Plan:
        """What this layer runs for num_tokens tokens on device (a torch.device or its name, "cuda") / dtype
        (default: its weights'), in training if training is True, or where it is None if the module is in
        training mode with gradients on: form, backend, and whether the chunk form runs chunks or one product
        (ops.dispatch.plan)."""
        weight = self.qkv.weight
        device = torch.device(device) if device is not None else weight.device
        if training is None:
            training = self.training and torch.is_grad_enabled() and weight.requires_grad
        return plan(self.attn_form, self.chunk_size, num_tokens, self.head_dim, self.head_dim,
                    num_scans=self.num_scans, decayed=self.decayed, device=device,
                    dtype=dtype or weight.dtype, backend=self.attn_backend, training=training,
                    vector=self.decay.vector)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, decay={self.decay_name}, scans={self.num_scans}, "
                f"feature_map={self.feature_map_name}, key_gate={self.key_gate_name}, scaling={self.scaling}, "
                f"attn_form={self.attn_form}, chunk_size={self.chunk_size}, "
                f"attn_backend={self.attn_backend}")

    def log_decay(self, x: Tensor) -> Optional[Tensor]:
        """log lam <= 0 as [S, B|1, H, L|1] (vector kinds: [S, B|1, H, L, Dk]) in token order, or None for LION-lit."""
        if not self.decayed:
            return None
        log_decay = self.decay(x)
        if _eager(log_decay):  # (a kind of one's own: [B, H, L] for one scan would read as B scans without an error)
            self._check_decay_shape(log_decay, x)
        return _log_decays(log_decay, x, self.num_prefix_tokens if self.prefix_decay_one else 0, self.decay.vector)

    def _check_decay_shape(self, log_decay: Tensor, x: Tensor) -> None:
        """ValueError unless the decay kind returned [S, B|1, H, L|1] (vector: [S, B|1, H, L, Dk]) for this layer."""
        vector, (batch, length), shape = self.decay.vector, x.shape[:2], log_decay.shape
        if len(shape) != 4 + vector or shape[0] != self.num_scans or shape[1] not in (1, batch) \
                or shape[2] != self.num_heads or shape[3] not in ((length,) if vector else (1, length)):
            want = f"[S, B|1, H, {'L, Dk' if vector else 'L|1'}] = [{self.num_scans}, {batch}|1, {self.num_heads}, " \
                   f"{f'{length}, Dk' if vector else f'{length}|1'}]"
            names = "scans, batch, heads, tokens" + (", key channels" if vector else "")
            raise ValueError(f"decay kind {type(self.decay).__name__} returned log decays {list(shape)}; a Decay's "
                             f"forward returns {want} ({names})")

    def _check_gate_shape(self, gate: Tensor, x: Tensor, head_dim: int) -> None:
        """ValueError unless the key gate kind returned [B|1, H, L, 1|Dk] for this layer (where broadcasting against
        the keys [B, H, L, Dk] could run with another shape)."""
        (batch, length), shape = x.shape[:2], gate.shape
        if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] != self.num_heads or shape[2] != length \
                or shape[3] not in (1, head_dim):
            raise ValueError(f"key gate kind {type(self.key_gate).__name__} returned a gate {list(shape)}; a KeyGate's "
                             f"forward returns [B|1, H, L, 1|Dk] = [{batch}|1, {self.num_heads}, {length}, "
                             f"1|{head_dim}]")

    def scan_orders(self, num_tokens: int, device: torch.device, grid: Optional[Tuple[int, int]] = None) -> Tensor:
        """Snake orders [2, num_tokens] for the grid (default: the one the model set), cached per (grid,
        prefix, device); a LionViT gives all its layers one cache."""
        grid = grid or self.grid_size
        if grid is None:
            raise ValueError("LionAttention with num_scans=2 needs grid_size set by the model")
        return _scan_orders(self._orders, grid[0], grid[1], self.num_prefix_tokens, num_tokens, device)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        if (attn_mask is not None or is_causal) and not fx_tracing():  # (traced, a mask argument is a symbol)
            raise ValueError("LionAttention takes no attn_mask / is_causal: its mask comes from the decays")
        batch, length, dim = x.shape
        grid = self.grid_size
        if fx_tracing():  # the traced grid is symbols, part of the graph: not kept on the module
            self.grid_size = None
        if self.key_gate.replaces_keys:  # the projected keys are never read: the queries' and values' rows of qkv
            weight, bias = self.qkv.weight.chunk(3), [None] * 3 if self.qkv.bias is None else self.qkv.bias.chunk(3)
            q, v = (F.linear(x, weight[i], bias[i]).unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for i in (0, 2))
            k = None
        else:
            q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
            k = self.k_norm(k)
        q = self.q_norm(q)  # q, k, v: [B, H, L, D]; q (and k) mapped to features by the op
        feature_map = self.feature_map_name
        log_decays = self.log_decay(x)
        if self.key_gate.gated:  # the gate multiplies the keys' features (or is the keys): keys made here, queries
            gate = self.key_gate(x, log_decays)  # mapped by the op
            if _eager(gate):
                self._check_gate_shape(gate, x, q.shape[-1])
            k = _gated(q, gate, replaces=True) if k is None else _gated(get_feature_map(feature_map)[1](k), gate)
            feature_map += QUERIES_ONLY
        orders = self.scan_orders(length, x.device, grid) if self.num_scans > 1 else None
        y = lion_attention(q, k, v, log_decays, orders, form=self.attn_form, chunk_size=self.chunk_size,
                           backend=self.attn_backend, feature_map=feature_map, scaling=self.scaling)
        y = y.transpose(1, 2).reshape(batch, length, dim)
        return self.proj_drop(self.proj(y))
