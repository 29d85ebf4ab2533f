"""The CPU backend: the portable chunk forms (scalar and vector decays) one group of (batch, head) rows
at a time, for inference (docs/design.md section 2). The rows of a LION layer are independent, so each
group is the same function on fewer rows; its temporaries (padded copies, chunk scores, states) are then
a group's size, not the batch's, and a 1248 px image's attention stays below its MLP's peak memory. Vector
decays run each group's chunks at once (vector.py, chunks_at_once): few operations on a few rows, with
masked products as large as the group's decays keep in exp's range (vector.leaf_tokens, read eagerly from
the values); for them the backend serves training too.
"""
from .rows import GROUP_BYTES, chunk_form, vector_form

__all__ = ["GROUP_BYTES", "chunk_form", "vector_form"]
