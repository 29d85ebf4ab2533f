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
    where owner is None, and kept (at most _KEPT_AT_MOST at a time), so that a call launches none of its work. A full
    store drops what no live tensor owns, then its oldest entries, never what the same call kept a moment before
    (which the next call would make again)."""
    full = key if owner is None else (id(owner), *key)
    found = _kept.get(full)
    if found is not None and (owner is None or found[0]() is owner):
        return found[1]  # type: ignore[return-value]
    value = make()
    if len(_kept) >= _KEPT_AT_MOST:  # those of tensors gone first, then the oldest: never those this call just made
        for gone in [entry for entry, (ref, _) in _kept.items() if ref is not None and ref() is None]:
            del _kept[gone]
        while len(_kept) >= _KEPT_AT_MOST:
            del _kept[next(iter(_kept))]
    _kept[full] = (None if owner is None else weakref.ref(owner), value)
    return value
