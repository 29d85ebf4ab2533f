"""GPU kernels for the attention, chunk and rnn forms (docs/design.md, "The Triton backend").

The attention form is one bidirectional kernel of ours (bidirectional.py): both directions, the scans and the
normaliser in one pass; LION-lit's, whose mask is all ones, two linear kernels of ours (linear.py): Q (K^T V).
For the chunk and rnn forms, LION is two causal scalar-gated linear attentions, one over the sequence and one over
its mirror, with the decays shifted by one token and the diagonal counted once;
flash-linear-attention's Triton kernels (PyPI `fla-core`, imported as `fla`) compute those with hand-written
backwards (fla.py), and two fused steps of ours build their operands and finish their outputs (operands.py).
Nothing here is imported until a call picks the triton backend.
"""
import os

import torch

from .fla import available, chunk_backward_fails, chunk_form, recurrent_form, unavailable_reason


@torch.compiler.assume_constant_result  # (a compiled model's plan calls it instead of tracing into it)
def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1, read as Triton reads it): the tests' way
    of running them on a CPU, slowly; otherwise they launch on CUDA devices only."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def bidirectional_form(*args, **kwargs):
    """The attention form in one bidirectional kernel of ours (bidirectional.py; imported at the first call)."""
    from .bidirectional import bidirectional_form as run
    return run(*args, **kwargs)


def linear_form(*args, **kwargs):
    """LION-lit's attention form, Q (K^T V), in two kernels of ours (linear.py; imported at the first call)."""
    from .linear import linear_form as run
    return run(*args, **kwargs)


def vector_form(*args, **kwargs):
    """Vector decays on FLA's vector-gate kernels (vector.py; imported, with Triton, at the first call)."""
    from .vector import vector_form as run
    return run(*args, **kwargs)


__all__ = ["available", "bidirectional_form", "chunk_backward_fails", "chunk_form", "interpreting", "linear_form",
           "recurrent_form", "unavailable_reason", "vector_form"]
