"""The CPU backend: a LION call one group of (batch, head) rows at a time (docs/design.md section 2). The rows
of a LION layer are independent, so each group is the same function on fewer rows: features, form and
division per group, whose temporaries (features, head-major values, padded copies, chunk scores, states) are
then a group's size, not the batch's, and a 1248 px image's attention stays below its MLP's peak memory. It
runs the portable chunk form for inference, and vector decays (training too) each group's chunks at once
(vector.py, chunks_at_once): few operations on a few rows, with masked products as large as the group's decays
keep in exp's range (vector.leaf_tokens, read eagerly from the values); training in float32 or float64, the
same chunks through a hand-written backward (chunks.py).
"""
from .rows import GROUP_BYTES, in_row_groups, trained_vector_form, vector_form

__all__ = ["GROUP_BYTES", "in_row_groups", "trained_vector_form", "vector_form"]
