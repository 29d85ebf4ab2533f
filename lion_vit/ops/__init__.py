"""LION math as pure functions on tensors (no parameters): docs/design.md sections 1-3.

lion.py is the op, dispatch.py the one place that decides what runs (tuning.py its knobs), attention.py /
recurrent.py / chunk.py the portable forms, masks.py and scans.py what they share, reference.py the oracle, triton/
the GPU kernels.
"""
from .chunk import whole_product_is_cheaper
from .dispatch import BACKENDS, FORM_CHOICES, FORM_NAMES, TORCH_FORMS, Plan, check_backend, check_form, plan
from .features import FEATURE_MAPS, POSITIVE_FEATURE_MAPS, get_feature_map
from .lion import lion_attention
from .masks import decay_mask, mask_dtype
from .scalings import SCALINGS, check_scaling
from .scans import column_snake, row_snake, snake_orders
from .tuning import Tuning, tuned, tuning

__all__ = [
    "lion_attention", "plan", "Plan", "check_form", "check_backend", "Tuning", "tuned", "tuning",
    "FORM_NAMES", "FORM_CHOICES", "BACKENDS", "TORCH_FORMS", "FEATURE_MAPS", "POSITIVE_FEATURE_MAPS",
    "get_feature_map", "SCALINGS", "check_scaling",
    "decay_mask", "mask_dtype", "row_snake", "column_snake", "snake_orders", "whole_product_is_cheaper",
]
