"""The CPU backend of the portable forms: on a CPU, eagerly (`tuned`), they work in cache-sized groups of
(batch, head) rows and build the selective mask in row blocks; a GPU and a compiler take whole tensors.
Same operations per row, so the same function: tests/test_ops.py runs both ways against the reference.

budgets.py holds the sizes, groups.py the switch (groups.tuned: the one hook that turns the tuning
off, as on a GPU) and the row groups, attention.py the grouped masked
product of training, masks.py the row blocks of the selective mask.
"""
from . import budgets, groups

__all__ = ["budgets", "groups"]
