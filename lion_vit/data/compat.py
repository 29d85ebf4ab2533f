"""Keeps timm's DeiT augmentation running on Pillow >= 13.

RandAugment's "PosterizeIncreasing" keeps 4 - int(4 * level / 10) bits, so a magnitude drawn at its
maximum (rand-m9-mstd0.5 reaches 10 for about 2 % of ops) keeps 0 bits. Pillow < 13 turned that into
a black image; Pillow 13 raises ValueError instead, which ends a DeiT-recipe run within its first
batches. Here keeping 0 bits gives the black image again.
"""
from __future__ import annotations

from typing import Any

from PIL import Image, ImageOps
from timm.data import auto_augment

_timm_posterize = auto_augment.posterize


def posterize(img: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's posterize, with 0 (or fewer) bits kept giving a black image as on Pillow < 13."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return _timm_posterize(img, bits_to_keep, **kwargs)


def pillow_refuses_zero_bits() -> bool:
    try:
        ImageOps.posterize(Image.new("L", (1, 1)), 0)
    except ValueError:
        return True
    return False


def patch_timm_posterize() -> None:
    """Point timm's posterize ops at `posterize` where Pillow refuses 0 bits (before transforms are built)."""
    if pillow_refuses_zero_bits():
        for name, op in list(auto_augment.NAME_TO_OP.items()):
            if op is _timm_posterize:
                auto_augment.NAME_TO_OP[name] = posterize
