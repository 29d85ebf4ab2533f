"""RandomResizedCrop's resize of a batch of crops in two launches of one Triton kernel (data.decode=gpu on CUDA), in
PIL's arithmetic.

timm's RandomResizedCrop crops an image and resizes the crop with PIL, in two one-dimensional passes (Pillow's
Resample.c), the first into 8-bit pixels. Output i of a pass from n inputs to m outputs sums the inputs from
xmin = int(c - support + 1/2) (at least 0) up to int(c + support + 1/2) (at most n), c = (i + 1/2) s, s = n / m,
support = the filter's support x max(s, 1), weighted by filter((j - c + 1/2) / max(s, 1)) normalised by their sum,
in float64; in fixed point: each weight rounded half away from zero to an int32 of weight x 2^22, the sum of pixel
x weight started at 2^21, shifted right by 22 and clipped to [0, 255]. The kernel computes exactly that (float64
without fused multiply-adds, as PIL's C does on x86-64), one pass of every image of the batch in a launch, and the
passes run in the order the installed Pillow takes (`_horizontal_first`), so on the same decoded pixels each crop
equals PIL's bit for bit. The per-image resize it replaces (torchvision's port of PIL's filters, in float32) costs a
launch or more an image and differs by up to 2 levels.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .gpu import host_to_device

_LINES = 16  # lines (rows, or columns for a vertical pass) of a program's tile


@triton.jit
def _weight(x, cubic):
    """PIL's bicubic (a = -0.5) or bilinear filter at x, float64, in PIL's order of operations."""
    x = tl.abs(x)
    near = (1.5 * x - 2.5) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * -0.5
    bicubic = tl.where(x < 1.0, near, tl.where(x < 2.0, far, 0.0))
    bilinear = tl.where(x < 1.0, 1.0 - x, 0.0)
    return tl.where(cubic != 0, bicubic, bilinear)


@triton.jit
def _pass_kernel(source, target, table, TAPS, BLOCK_L: tl.constexpr, BLOCK_O: tl.constexpr):
    """One pass of one image and channel: lines [BLOCK_L] of it resampled along their axis, from its parameters
    (source base, channel, line and axis strides; lines, inputs and outputs along the axis; the same strides of the
    target; whether the filter is bicubic)."""
    image_channel, block = tl.program_id(0), tl.program_id(1)  # (images on the first axis: no 65,535 limit)
    p = table + (image_channel // 3) * 12  # ('params' would clash with Triton's launcher)
    channel = image_channel % 3
    src = source + tl.load(p) + channel * tl.load(p + 1)
    src_line, src_along, lines = tl.load(p + 2), tl.load(p + 3), tl.load(p + 4)
    inputs, outputs = tl.load(p + 5), tl.load(p + 6)
    dst = target + tl.load(p + 7) + channel * tl.load(p + 8)
    dst_line, dst_along, cubic = tl.load(p + 9), tl.load(p + 10), tl.load(p + 11)
    line = block * BLOCK_L + tl.arange(0, BLOCK_L)
    out = tl.arange(0, BLOCK_O)
    line_ok, out_ok = line < lines, out < outputs
    # each output's window, as PIL's precompute_coeffs
    scale = inputs.to(tl.float64) / outputs.to(tl.float64)
    filterscale = tl.maximum(scale, 1.0)
    support = tl.where(cubic != 0, 2.0, 1.0) * filterscale
    center = (out.to(tl.float64) + 0.5) * scale
    first = tl.maximum((center - support + 0.5).to(tl.int32), 0)  # (C's int(): towards zero)
    count = tl.minimum((center + support + 0.5).to(tl.int32), inputs) - first
    inverse = 1.0 / filterscale
    total = tl.zeros_like(center)  # the window's sum, tap by tap as PIL adds it
    for t in range(0, TAPS):
        total += tl.where(t < count, _weight(((t + first).to(tl.float64) - center + 0.5) * inverse, cubic), 0.0)
    divisor = tl.where(total != 0.0, total, 1.0)
    acc = tl.full([BLOCK_L, BLOCK_O], 1 << 21, tl.int32)
    for t in range(0, TAPS):
        read = out_ok & (t < count)
        w = tl.where(read, _weight(((t + first).to(tl.float64) - center + 0.5) * inverse, cubic) / divisor, 0.0)
        k = tl.where(w < 0, w * 4194304.0 - 0.5, w * 4194304.0 + 0.5).to(tl.int32)  # (unread taps: 0)
        along = tl.where(read, first + t, 0)
        values = tl.load(src + line[:, None] * src_line + along[None, :] * src_along,
                         mask=line_ok[:, None] & read[None, :], other=0)
        acc += values.to(tl.int32) * k[None, :]
    clipped = tl.where(acc >= 1 << 30, 255, tl.where(acc <= 0, 0, acc >> 22)).to(tl.uint8)
    tl.store(dst + line[:, None] * dst_line + out[None, :] * dst_along, clipped,
             mask=line_ok[:, None] & out_ok[None, :])


def taps(inputs: int, outputs: int, cubic: bool) -> int:
    """The most inputs one output of a pass sums (PIL's ksize)."""
    support = (2.0 if cubic else 1.0) * max(inputs / outputs, 1.0)
    return int(-(-support // 1)) * 2 + 1


@lru_cache(maxsize=None)
def _pillow_orders_passes() -> bool:
    """Whether the installed Pillow runs a resize's vertical pass first where it shrinks the height by more than
    twice what it takes off the width (Pillow 13 does; earlier ones always run the horizontal pass first): read
    from Pillow itself, on an image whose two orders give different pixels."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8))
    bicubic = Image.Resampling.BICUBIC
    vertical_first = image.resize((24, 8), bicubic).resize((28, 8), bicubic)
    return np.array_equal(np.asarray(image.resize((28, 8), bicubic)), np.asarray(vertical_first))


def _horizontal_first(crop_h: int, crop_w: int, height: int, width: int) -> bool:
    """The order of PIL's passes for a crop resized to height x width (Pillow's ImagingResampleInner)."""
    return not (_pillow_orders_passes() and crop_h - height > 0 and crop_h - height > (crop_w - width) * 2)


def _in_memory_order(image: Tensor) -> Tuple[Tensor, Tuple[int, int, int]]:
    """A [3, H, W] image's pixels as a 1-d view in memory order (planar, or interleaved as a CPU's decoder writes
    them; a copy only where they are neither) and the (channel, row, column) strides that address them there."""
    for order in ((0, 1, 2), (1, 2, 0)):
        in_order = image.permute(order)
        if in_order.is_contiguous():
            return in_order.reshape(-1), tuple(image.stride())
    dense = image.contiguous()
    return dense.reshape(-1), tuple(dense.stride())


def resized_crops(images: Sequence[Tensor], boxes: Sequence[Tuple[int, int, int, int]], size: Tuple[int, int],
                  bicubic: Sequence[bool]) -> Tensor:
    """Each image's crop box (top, left, height, width) resized to size (height, width) with PIL's bicubic filter,
    or its bilinear one where `bicubic` says False, as PIL's crop and resize compute it: uint8 [n, 3, height, width]
    from RGB uint8 [3, H_i, W_i] images on one device (CUDA, or a CPU under Triton's interpreter)."""
    height, width = size
    count = len(images)
    passes: List[List[List[int]]] = [[], []]
    flat, start, between = [], 0, 0
    for index, (image, (top, left, crop_h, crop_w), cubic) in enumerate(zip(images, boxes, bicubic)):
        pixels, (channel, row, column) = _in_memory_order(image)
        crop = start + top * row + left * column  # (channel 0's first pixel of the crop, in the images' buffer)
        out = index * 3 * height * width
        if _horizontal_first(crop_h, crop_w, height, width):  # rows to width columns, then columns to height rows
            passes[0].append([crop, channel, row, column, crop_h, crop_w, width,
                              between, crop_h * width, width, 1, int(cubic)])
            passes[1].append([between, crop_h * width, 1, width, width, crop_h, height,
                              out, height * width, 1, width, int(cubic)])
            between += 3 * crop_h * width
        else:  # columns to height rows, then rows to width columns
            passes[0].append([crop, channel, column, row, crop_w, crop_h, height,
                              between, height * crop_w, 1, crop_w, int(cubic)])
            passes[1].append([between, height * crop_w, crop_w, 1, height, crop_w, width,
                              out, height * width, width, 1, int(cubic)])
            between += 3 * height * crop_w
        flat.append(pixels)
        start += pixels.numel()
    device = images[0].device
    pixels = torch.cat(flat)
    halfway = torch.empty(between, dtype=torch.uint8, device=device)
    result = torch.empty(count, 3, height, width, dtype=torch.uint8, device=device)
    table = host_to_device(torch.tensor(passes, dtype=torch.int64), device)
    for pass_, (source, target) in enumerate(((pixels, halfway), (halfway, result))):
        lines = max(p[4] for p in passes[pass_])
        most = max(taps(p[5], p[6], p[11] == 1) for p in passes[pass_])
        block_o = triton.next_power_of_2(max(p[6] for p in passes[pass_]))
        _pass_kernel[(count * 3, triton.cdiv(lines, _LINES))](source, target, table[pass_], most, BLOCK_L=_LINES,
                                                              BLOCK_O=block_o, enable_fp_fusion=False)
    return result
