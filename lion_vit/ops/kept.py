"""What a call derives from a tensor it is given again and again (a model's scan orders), made once and kept."""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional, Tuple, TypeVar

from torch import Tensor

_kept: Dict[tuple, Tuple[Optional[weakref.ref], object]] = {}
_KEPT_AT_MOST = 64
_Kept = TypeVar("_Kept")


def kept(owner: Optional[Tensor], key: tuple, make: Callable[[], _Kept]) -> _Kept:
    """make()'s result, made once per owner tensor (while that lives: a model keeps its orders) and key, or per key
    where owner is None, and kept (at most _KEPT_AT_MOST at a time), so that a call launches none of its work."""
    full = key if owner is None else (id(owner), *key)
    found = _kept.get(full)
    if found is not None and (owner is None or found[0]() is owner):
        return found[1]  # type: ignore[return-value]
    value = make()
    if len(_kept) >= _KEPT_AT_MOST:
        _kept.clear()
    _kept[full] = (None if owner is None else weakref.ref(owner), value)
    return value
