"""Feature maps phi for queries and keys: strictly positive ones (which keep every normaliser
q_i^T sum_j M_ij k_j > 0, as scaling "sum" needs), and the identity for the other scalings."""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def elu_plus_one(x: Tensor) -> Tensor:
    """ELU(x) + 1 (Katharopoulos et al., the linear transformer)."""
    return F.elu(x) + 1.0


def shifted_silu(x: Tensor) -> Tensor:
    """SiLU(x) + 0.5; SiLU >= -0.279, so the result is >= 0.22."""
    return F.silu(x) + 0.5


def normalized_shifted_silu(x: Tensor) -> Tensor:
    """(SiLU(x) + 0.5) / ||SiLU(x) + 0.5||: the paper's choice for every LION variant (the norm is at
    least 0.22 sqrt(D), never zero)."""
    y = shifted_silu(x)
    return y / torch.linalg.vector_norm(y, dim=-1, keepdim=True)


def identity(x: Tensor) -> Tensor:
    """x: the queries and keys as projected (RetNet, Mamba-2, xLSTM in the paper's Table 1)."""
    return x


def scaled_keys(x: Tensor) -> Tensor:
    """x / sqrt(D): RetNet's and xLSTM's keys."""
    return x * x.shape[-1] ** -0.5


FeatureMap = Callable[[Tensor], Tensor]

# name -> (map for queries, map for keys). Scale() divides each row by its sum, so a positive
# factor on q_i cancels: normalising the queries changes nothing and is skipped (exactly the
# same function as normalising both, for less work).
FEATURE_MAPS: Dict[str, Tuple[FeatureMap, FeatureMap]] = {
    "silu_norm": (shifted_silu, normalized_shifted_silu),
    "silu": (shifted_silu, shifted_silu),
    "elu": (elu_plus_one, elu_plus_one),
    # q and k of both signs, for the scalings other than "sum" (ops/scalings.py): as projected; keys scaled by
    # 1 / sqrt(D) (RetNet's and xLSTM's); both through SiLU (Mamba-2's C and B)
    "identity": (identity, identity),
    "scaled": (identity, scaled_keys),
    "swish": (F.silu, F.silu),
}
POSITIVE_FEATURE_MAPS = frozenset({"silu_norm", "silu", "elu"})  # q . k > 0: what scaling "sum" divides by


# A feature map name with this suffix maps the queries as the name does and takes the keys as given: keys a
# layer has made features itself (a key gate's, lion_vit.gates), while the op maps the queries (row by row on
# the cpu backend, never a whole copy).
QUERIES_ONLY = ":queries"


def get_feature_map(name: str) -> Tuple[FeatureMap, FeatureMap]:
    """(query map, key map) for a feature map name (with QUERIES_ONLY: the key map is the identity)."""
    base = name[:-len(QUERIES_ONLY)] if name.endswith(QUERIES_ONLY) else name
    if base not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {name!r}; choose one of {sorted(FEATURE_MAPS)}")
    query_map, key_map = FEATURE_MAPS[base]
    return (query_map, identity) if base != name else (query_map, key_map)


def query_scale(length: int) -> float:
    """2^-round(log2(L) / 2), about 1 / sqrt(L): the factor on q that keeps the numerator and normaliser of
    L tokens within float16's range. A power of two, so exact, and cancelled by the division
    (docs/design.md, "float16")."""
    return 2.0 ** -round(math.log2(length) / 2)


def mapped(q: Tensor, k: Tensor, feature_map: Optional[str]) -> Tuple[Tensor, Tensor]:
    """q and k as features: through a feature map's name, or as they are (None)."""
    if feature_map is None:
        return q, k
    query_map, key_map = get_feature_map(feature_map)
    return query_map(q), key_map(k)
