"""A rough peak-memory estimate of a training step (or an evaluation forward), checked against the memory
the device has free, so that a run far too large says so before the kernel or CUDA ends it silently."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

# Values a ViT block keeps per token and channel for its backward (q, k, v, the attention output, two
# norms, the 4x MLP hidden layer before and after its GELU, residuals), and what a forward without
# autograd holds at its peak (the MLP's hidden layer and its input).
TRAINING_VALUES_PER_TOKEN_CHANNEL = 34
INFERENCE_VALUES_PER_TOKEN_CHANNEL = 8


def estimate_peak_bytes(model: nn.Module, img_size: int, batch_size: int, training: bool,
                        value_bytes: int = 4) -> Optional[int]:
    """Bytes a step of a ViT-like model (timm's `blocks`, `patch_embed`) needs at img_size, or None for
    another model. Counted: weights (with gradients and AdamW's two moments when training), the blocks'
    activations, and the L x L attention weights where the model forms them (a LION layer's attention
    form with decays keeps one per block for its backward; softmax attention is counted as keeping them
    too, which CPU SDPA does, so a GPU estimate errs high)."""
    blocks, patch = getattr(model, "blocks", None), getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if blocks is None or not patch or not len(blocks):
        return None
    tokens = (img_size // patch[0]) * (img_size // patch[1]) + getattr(model, "num_prefix_tokens", 0)
    width, depth = model.embed_dim, len(blocks)
    heads = getattr(blocks[0].attn, "num_heads", 1)
    per_value = TRAINING_VALUES_PER_TOKEN_CHANNEL if training else INFERENCE_VALUES_PER_TOKEN_CHANNEL
    activations = batch_size * tokens * width * per_value * value_bytes * (depth if training else 1)
    # float32 L x L tensors: in training the scores, masks and weights that autograd keeps for backward
    square = batch_size * heads * tokens * tokens * 4 * (3 * depth if training else 1)
    if hasattr(model, "attn_plan"):
        attn = blocks[0].attn
        run = model.attn_plan((img_size, img_size))
        if not attn.decayed or not (run.form == "attention" or run.whole):
            square = 0  # Q (K^T V), the rnn form, chunks: nothing of size L x L
    parameters = sum(p.numel() for p in model.parameters()) * 4 * (4 if training else 1)
    return parameters + activations + square


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory free for this process on device: CUDA's free memory, or the CPU's MemAvailable (Linux)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_warning(model: nn.Module, img_size: int, batch_size: int, training: bool, device: torch.device,
                   value_bytes: int = 4, available: Optional[int] = None) -> Optional[str]:
    """One line saying that the step will not fit, or None where it fits (or cannot be estimated)."""
    needed = estimate_peak_bytes(model, img_size, batch_size, training, value_bytes)
    available = free_bytes(device) if available is None else available
    if needed is None or available is None or needed <= available:
        return None
    what = "a training step" if training else "an evaluation forward"
    return (f"img_size {img_size} with batch_size {batch_size} needs about {needed / 2**30:.1f} GiB for {what}, "
            f"more than the {available / 2**30:.1f} GiB free on {device.type}: the run will likely be killed; "
            f"lower batch_size or img_size (to evaluate at high resolution use model.attn_form=chunk)")
