"""data.decode=gpu: JPEG decoding and DeiT's training augmentation on the device.

The workers only read each file's bytes and draw the augmentation's random parameters, with timm's own
code in the order timm's PIL transform draws them (the same seed gives the same crops, flips and
RandAugment ops). The main process decodes the batch with nvJPEG (`decode_jpeg(..., device="cuda")`,
batched: TorchCodec's, or torchvision's, jpeg_decoder), then crops and resizes, flips and applies each image's
RandAugment ops as tensor ops, normalises and draws timm's random erasing, all on the device. A file the
device decoder rejects (CMYK, a PNG named .JPEG, ...) is decoded by PIL instead; those are counted.

The tensor ops follow PIL's arithmetic (Image.blend's truncation, its affine transform's sampling and
cubic kernel), so each equals timm's PIL op up to float rounding (tests/test_gpu_decode.py states the
bounds); on CUDA the crops are resized in one Triton kernel for the batch with PIL's own bits (resize.py). On a
CPU device the same path runs (slowly: it is for tests), the crops through torchvision's resize.
"""
from __future__ import annotations

import copy
import functools
import io
import logging
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from PIL import Image
from timm.data.auto_augment import RandAugment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import MaybePILToTensor, RandomResizedCropAndInterpolation, ToNumpy
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision.transforms import ColorJitter, InterpolationMode, RandomHorizontalFlip

from ..errors import UserError, first_line
from .jpeg import PIL_ERRORS, as_rgb, open_bytes

log = logging.getLogger(__name__)

# PIL's resampling filters as torchvision's interpolation modes (RandomResizedCrop's resize)
_MODES = {Image.Resampling.NEAREST: InterpolationMode.NEAREST, Image.Resampling.BILINEAR: InterpolationMode.BILINEAR,
          Image.Resampling.BICUBIC: InterpolationMode.BICUBIC}


class Encoded(NamedTuple):
    """A file's bytes (uint8 [N]), its size from the header (width, height), its path and its EXIF orientation
    (1: as stored; PIL's decoding, and so timm's, ignores it)."""
    data: Tensor
    size: Tuple[int, int]
    path: str
    orientation: int = 1


_ORIENTATION = 0x0112  # the EXIF tag


def read_encoded(path: str) -> Encoded:
    """An ImageFolder loader for the workers: the bytes, and the size and EXIF orientation PIL reads from the
    header (PIL raises for a file it cannot identify, as it does when it decodes one)."""
    with open(path, "rb") as f:
        data = f.read()
    with open_bytes(data) as image:
        size, orientation = image.size, _orientation(image)
    return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), size, path, orientation)


def _orientation(image: Image.Image) -> int:
    """The image's EXIF orientation, 1 where it has none or none that parses (its pixels decode all the same)."""
    try:
        value = image.getexif().get(_ORIENTATION, 1)
    except Exception:  # (PIL's EXIF parser raises what its input makes it: struct, value, syntax errors)
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


@dataclass
class Draw:
    """One image's augmentation: crop box (top, left, height, width) resized to `size` with
    `interpolation`, a horizontal flip, then RandAugment's ops as (timm function name, level args, kwargs)."""
    box: Tuple[int, int, int, int]
    size: Tuple[int, int]
    interpolation: Any
    flip: bool = False
    ops: List[Tuple[str, tuple, Dict[str, Any]]] = field(default_factory=list)


class Sample(NamedTuple):
    encoded: Encoded
    draw: Draw


class DrawAugmentation:
    """The transform the workers run: draws what timm's DeiT transform `transform` would do to an image of
    the file's size, with the same random calls in the same order, and applies none of it."""

    def __init__(self, transform: Callable) -> None:
        steps = getattr(transform, "transforms", [transform])
        self.crop: Optional[RandomResizedCropAndInterpolation] = None
        self.flip: Optional[RandomHorizontalFlip] = None
        self.augment: Optional[RandAugment] = None
        self.jitter: Optional[ColorJitter] = None
        for step in steps:
            if isinstance(step, RandomResizedCropAndInterpolation) and self.crop is None:
                self.crop = step
            elif isinstance(step, RandomHorizontalFlip) and self.crop is not None and self.flip is None:
                self.flip = step
            elif isinstance(step, RandAugment) and self.crop is not None and self.augment is None:
                self.augment = _recording(step)
            elif isinstance(step, ColorJitter) and _no_jitter(step):  # aug.color_jitter=0 without RandAugment
                self.jitter = step
            elif not isinstance(step, (MaybePILToTensor, ToNumpy)):
                if self.crop is None:  # no RandomResizedCrop first: aug.enabled=false's resize and crop (below)
                    break
                raise UserError(f"data.decode=gpu has no device version of {type(step).__name__} (it runs timm's "
                                f"RandomResizedCrop, flip and RandAugment); set data.decode=cpu, or aug.color_jitter=0 "
                                f"with aug.auto_augment=null")
        if self.crop is None:
            raise UserError("data.decode=gpu runs DeiT's training augmentation (RandomResizedCrop first): set "
                            "aug=deit (or aug.enabled=true), or data.decode=cpu")
        _check_filters(self.crop, self.augment)

    def __call__(self, encoded: Encoded) -> Sample:
        crop = self.crop
        width, height = encoded.size  # an image of that size without pixels: all get_params reads
        box = crop.get_params(torch.empty(1, 1, 1).expand(1, height, width), crop.scale, crop.ratio)
        interpolation = crop.interpolation
        if isinstance(interpolation, (tuple, list)):
            interpolation = random.choice(interpolation)
        draw = Draw(tuple(int(b) for b in box), tuple(crop.size), interpolation)
        if self.flip is not None:
            draw.flip = bool(torch.rand(1) < self.flip.p)  # torchvision's RandomHorizontalFlip draws so
        if self.jitter is not None:
            self.jitter.get_params(None, None, None, None)  # the order it draws (and nothing to jitter)
        if self.augment is not None:
            self.augment(draw.ops)
        return Sample(encoded, draw)


def _check_filters(crop: RandomResizedCropAndInterpolation, augment: Optional[RandAugment]) -> None:
    """The device path resamples with PIL's bicubic and bilinear filters only (DeiT's is bicubic; timm's "random"
    picks one of the two): any other, in the crop's resize or RandAugment's geometric ops, is refused here, before
    a worker runs, rather than at the first batch that draws it."""
    ops = augment.ops if augment is not None else []
    filters = _each(crop.interpolation) + [f for op in ops for f in _each(op.kwargs.get("resample"))]
    unknown = [f for f in filters if f not in _KERNEL_FILTERS]
    if unknown:  # (torchvision's InterpolationMode and PIL's Resampling both name theirs)
        raise UserError(f"data.decode=gpu resamples with the bicubic and bilinear filters only, not "
                        f"{unknown[0].name.lower()}; set data.interpolation=bicubic (DeiT's) or bilinear, or "
                        f"data.decode=cpu")


def _each(filters: Any) -> list:
    """timm's filter setting as a list: one filter, a tuple of them to draw from ("random"), or none."""
    return [] if filters is None else list(filters) if isinstance(filters, (tuple, list)) else [filters]


def _no_jitter(jitter: ColorJitter) -> bool:
    return all(getattr(jitter, name) is None for name in ("brightness", "contrast", "saturation", "hue"))


def _recording(augment: RandAugment) -> RandAugment:
    """A copy of timm's RandAugment whose ops append (name, level args, kwargs) to the list they are given
    in place of changing an image: timm's own code draws the ops, their application and magnitudes."""
    for op in augment.ops:
        if op.aug_fn.__name__ not in BATCH_OPS:
            raise UserError(f"data.decode=gpu has no device version of RandAugment's {op.name}; set data.decode=cpu "
                            f"or leave {op.name} out of aug.auto_augment")
    recording = copy.copy(augment)
    recording.ops = []
    for op in augment.ops:
        op = copy.copy(op)
        op.aug_fn = _Record(op.aug_fn.__name__)
        recording.ops.append(op)
    return recording


class _Record:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, ops: list, *args: Any, **kwargs: Any) -> list:
        if self.name in _MATRICES:  # timm draws a random resampling filter there when given several
            resample = kwargs.get("resample")
            if isinstance(resample, (tuple, list)):
                kwargs["resample"] = random.choice(resample)
        ops.append((self.name, args, kwargs))
        return ops


# ---- the tensor ops: uint8 [n, 3, H, W] images, per-image parameters, PIL's arithmetic ----

def host_to_device(values: Tensor, device: torch.device) -> Tensor:
    """A small host tensor (a batch's drawn parameters) on `device`, without waiting for the device: on CUDA through
    pinned memory, non-blocking. A copy from pageable memory waits for its stream, so the host would wait for every
    kernel queued before it (the training step's) and the GPU then for the host, at every copy of every batch."""
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def _per_image(values: Sequence[float], images: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """[n, 1, 1, 1] of one value per image, on the images' device."""
    return host_to_device(torch.tensor(values, dtype=dtype), images.device).view(-1, 1, 1, 1)


def _blend(degenerate: Tensor, images: Tensor, factor: Tensor) -> Tensor:
    """PIL's Image.blend(degenerate, image, factor) (factor [n, 1, 1, 1]): truncated towards zero, clipped."""
    return (degenerate.float() + factor * (images.float() - degenerate.float())).clamp_(0, 255).to(torch.uint8)


def _grey(images: Tensor) -> Tensor:
    """PIL's convert("L"): (19595 R + 38470 G + 7471 B + 2^15) >> 16, [n, 1, H, W]."""
    r, g, b = images.int().unbind(-3)
    return ((19595 * r + 38470 * g + 7471 * b + 0x8000) >> 16).to(torch.uint8).unsqueeze(-3)


def _smooth(images: Tensor) -> Tensor:
    """PIL's SMOOTH filter, the border left as it is (ImageEnhance.Sharpness's degenerate image): torchvision's
    adjust_sharpness(images, 0.0), whose kernel it makes on the device from a list, a copy that waits for the
    device (host_to_device)."""
    channels, height, width = images.shape[-3:]
    if height <= 2 or width <= 2:
        return images
    a, b = 1.0 / 13.0, 5.0 / 13.0  # (as torchvision's, rounded once to float32)
    kernel = host_to_device(torch.tensor([[a, a, a], [a, b, a], [a, a, a]]), images.device).expand(channels, 1, 3, 3)
    smoothed = images.float()
    smoothed[..., 1:-1, 1:-1] = F.conv2d(smoothed, kernel, groups=channels).round_()
    return smoothed.clamp_(0, 255).to(torch.uint8)


def _affine(images: Tensor, matrices: Tensor, fills: Tensor, resamples: Sequence[Any]) -> Tensor:
    """PIL's Image.transform(size, AFFINE, matrix, resample, fillcolor) per image (matrices [n, 6] float64 and fills
    [n, 3] on the host, a resampling filter each): output pixel (x, y) samples the input at
    (a x' + b y' + c, d x' + e y' + f), x' = x + 1/2, with PIL's kernels (its bicubic is the a = -1 cubic) and
    edge-clamped taps; a point outside the input gets the fill. Bilinear images take the cubic's 4 x 4 taps with the
    outer ones' weights 0 (each sum the same), so one call serves every filter."""
    count, channels, height, width = images.shape
    grid = dict(device=images.device, dtype=torch.float64)
    ys, xs = torch.meshgrid(torch.arange(height, **grid) + 0.5, torch.arange(width, **grid) + 0.5, indexing="ij")
    a, b, c, d, e, f = host_to_device(matrices.double(), images.device).view(count, 6, 1, 1).unbind(1)
    x_in, y_in = a * xs + b * ys + c, d * xs + e * ys + f  # [n, H, W]
    inside = (x_in >= 0) & (x_in < width) & (y_in >= 0) & (y_in < height)
    unknown = set(resamples) - {Image.Resampling.BILINEAR, Image.Resampling.BICUBIC}
    if unknown:
        raise UserError(f"data.decode=gpu: no device version of PIL resampling filter {unknown.pop()}; use "
                        f"data.interpolation=bicubic or bilinear")
    cubic = [r == Image.Resampling.BICUBIC for r in resamples]
    cubic = None if all(cubic) else host_to_device(torch.tensor(cubic), images.device).view(count, 1, 1)
    (x0, x_taps), (y0, y_taps) = _taps(x_in - 0.5, cubic), _taps(y_in - 0.5, cubic)
    flat = images.reshape(count, channels, -1).double()
    out = torch.zeros(count, channels, height * width, **grid)
    for dy, wy in y_taps:
        rows = (y0 + dy).clamp_(0, height - 1) * width
        for dx, wx in x_taps:
            index = (rows + (x0 + dx).clamp(0, width - 1)).view(count, 1, -1).expand(-1, channels, -1)
            out += (wy * wx).view(count, 1, -1) * flat.gather(-1, index)
    out = out.view(count, channels, height, width).clamp_(0, 255).to(torch.uint8)
    fills = host_to_device(fills.to(torch.uint8), images.device).view(count, -1, 1, 1)
    return torch.where(inside.unsqueeze(1), out, fills)


def _taps(position: Tensor, cubic: Optional[Tensor]) -> Tuple[Tensor, List[Tuple[int, Tensor]]]:
    """First tap index and (offset, weight) pairs of PIL's bicubic filter at `position`, or where `cubic` [n, 1, 1]
    is False its bilinear one (the weights of offsets 0 and 1; 0 at -1 and 2); cubic None: every image's bicubic."""
    start = position.floor()
    t = position - start
    weights = [-t * (1 - t) ** 2, 1 - 2 * t ** 2 + t ** 3, t + t ** 2 - t ** 3, -t ** 2 * (1 - t)]
    if cubic is not None:
        zero = torch.zeros_like(t)
        weights = [torch.where(cubic, weight, linear) for weight, linear in zip(weights, (zero, 1 - t, t, zero))]
    return start.long(), list(zip((-1, 0, 1, 2), weights))


def _rotation(degrees: float, width: int, height: int) -> List[float]:
    """PIL's Image.rotate matrix: about the centre, same size."""
    angle = -math.radians(degrees)
    m = [round(math.cos(angle), 15), round(math.sin(angle), 15), 0.0,
         round(-math.sin(angle), 15), round(math.cos(angle), 15), 0.0]
    cx, cy = width / 2.0, height / 2.0
    m[2], m[5] = m[0] * -cx + m[1] * -cy + cx, m[3] * -cx + m[4] * -cy + cy
    return m


# The affine matrix of each geometric op from its level argument and the image's (width, height)
_MATRICES: Dict[str, Callable[[float, int, int], Sequence[float]]] = {
    "rotate": _rotation,
    "shear_x": lambda factor, w, h: (1, factor, 0, 0, 1, 0),
    "shear_y": lambda factor, w, h: (1, 0, 0, factor, 1, 0),
    "translate_x_abs": lambda pixels, w, h: (1, 0, pixels, 0, 1, 0),
    "translate_y_abs": lambda pixels, w, h: (1, 0, 0, 0, 1, pixels),
    "translate_x_rel": lambda pct, w, h: (1, 0, pct * w, 0, 1, 0),
    "translate_y_rel": lambda pct, w, h: (1, 0, 0, 0, 1, pct * h),
}


def _geometric(images: Tensor, ops: List[Tuple[str, tuple, dict]]) -> Tensor:
    """Each image through its own geometric op (name, level args, kwargs), all in one affine call."""
    height, width = images.shape[-2:]
    matrices = torch.tensor([_MATRICES[name](args[0], width, height) for name, args, _ in ops], dtype=torch.float64)
    fills = torch.tensor([_fill(kwargs.get("fillcolor", 128), images.shape[-3]) for _, _, kwargs in ops])
    return _affine(images, matrices, fills, [kwargs.get("resample", Image.Resampling.BICUBIC) for _, _, kwargs in ops])


def _fill(fillcolor: Any, channels: int) -> Tuple[int, ...]:
    return tuple(fillcolor) if isinstance(fillcolor, (tuple, list)) else (int(fillcolor),) * channels


def _posterize(images: Tensor, args: List[tuple], _: List[dict]) -> Tensor:
    """Keep each image's top `bits` bits (8 or more: all; 0 or fewer: none, black, as compat.py)."""
    masks = [0xFF if bits >= 8 else 0 if bits <= 0 else (0xFF << (8 - bits)) & 0xFF for bits, *_ in args]
    return images & _per_image(masks, images, torch.uint8)


def _solarize(images: Tensor, args: List[tuple], _: List[dict]) -> Tensor:
    thresholds = _per_image([a[0] for a in args], images, torch.int32)
    return torch.where(images.int() >= thresholds, 255 - images, images)


def _solarize_add(images: Tensor, args: List[tuple], kwargs: List[dict]) -> Tensor:
    adds = _per_image([a[0] for a in args], images, torch.int32)
    thresholds = _per_image([a[1] if len(a) > 1 else kw.get("thresh", 128) for a, kw in zip(args, kwargs)], images,
                            torch.int32)
    return torch.where(images.int() < thresholds, (images.int() + adds).clamp_(max=255).to(torch.uint8), images)


def _contrast(images: Tensor, args: List[tuple], _: List[dict]) -> Tensor:
    means = (_grey(images).double().mean((-3, -2, -1), keepdim=True) + 0.5).floor()  # PIL's ImageStat, rounded
    return _blend(means.float().expand_as(images), images, _factors(args, images))


def _factors(args: List[tuple], images: Tensor) -> Tensor:
    return _per_image([a[0] for a in args], images)


# timm's RandAugment functions (auto_augment.NAME_TO_OP's values, by name) on batches of images on the device:
# (images [n, 3, H, W] uint8, each image's level args, each image's kwargs) -> images
BATCH_OPS: Dict[str, Callable[[Tensor, List[tuple], List[dict]], Tensor]] = {
    "auto_contrast": lambda images, args, kwargs: TF.autocontrast(images),
    "equalize": lambda images, args, kwargs: TF.equalize(images),
    "invert": lambda images, args, kwargs: TF.invert(images),
    "posterize": _posterize,
    "solarize": _solarize,
    "solarize_add": _solarize_add,
    "color": lambda images, args, kwargs: _blend(_grey(images).expand_as(images), images, _factors(args, images)),
    "contrast": _contrast,
    "brightness": lambda images, args, kwargs: _blend(torch.zeros_like(images), images, _factors(args, images)),
    "sharpness": lambda images, args, kwargs: _blend(_smooth(images), images, _factors(args, images)),
    **{name: lambda images, args, kwargs, name=name: _geometric(images, [(name, a, kw) for a, kw in zip(args, kwargs)])
       for name in _MATRICES},
}


def device_op(name: str, image: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """One image ([3, H, W]) through timm's RandAugment function `name` with these arguments, on its device."""
    return BATCH_OPS[name](image[None], [args], [kwargs])[0]


# the crop's resampling filters that resize.py's kernels compute: whether each is bicubic (else bilinear)
_KERNEL_FILTERS = {InterpolationMode.BICUBIC: True, InterpolationMode.BILINEAR: False,
                   Image.Resampling.BICUBIC: True, Image.Resampling.BILINEAR: False}


def augment(images: Sequence[Tensor], draws: Sequence[Draw], crop_kernels: Optional[bool] = None) -> Tensor:
    """Decoded images (uint8 [3, H_i, W_i], on one device) through their drawn augmentations: [n, 3, S, S].
    The crops in two launches for the batch, in PIL's arithmetic (resize.py; crop_kernels None: on CUDA), or one
    by one with torchvision's resize (their sizes differ); then, step by step, each RandAugment op once for all the
    images that drew it at that step (the geometric ones together)."""
    if _crops_in_kernels(images, draws, crop_kernels):
        from .resize import resized_crops
        batch = resized_crops(images, [draw.box for draw in draws], draws[0].size,
                              [_KERNEL_FILTERS[draw.interpolation] for draw in draws])
    else:
        batch = torch.stack([_resized_crop(image, draw) for image, draw in zip(images, draws)])
    if any(draw.flip for draw in draws):  # (decided on the host: a device value read back would wait for the device)
        flips = host_to_device(torch.tensor([draw.flip for draw in draws]), batch.device)
        batch = torch.where(flips.view(-1, 1, 1, 1), batch.flip(-1), batch)
    for step in range(max((len(draw.ops) for draw in draws), default=0)):
        groups: Dict[str, List[int]] = {}  # the images of each op, and of every geometric op together
        for i, draw in enumerate(draws):
            if step < len(draw.ops):
                name = draw.ops[step][0]
                groups.setdefault("affine" if name in _MATRICES else name, []).append(i)
        for name, members in groups.items():
            index = host_to_device(torch.tensor(members), batch.device)
            ops = [draws[i].ops[step] for i in members]
            images = batch.index_select(0, index)
            batch.index_copy_(0, index, _geometric(images, ops) if name == "affine" else
                              BATCH_OPS[name](images, [op[1] for op in ops], [op[2] for op in ops]))
    return batch


def _resized_crop(image: Tensor, draw: Draw) -> Tensor:
    """torchvision's resize of the drawn crop; an empty crop (timm draws one from an image of a few pixels)
    resizes to black, as PIL's does and the kernels' do."""
    top, left, height, width = draw.box
    if height == 0 or width == 0:
        return image.new_zeros(image.shape[0], *draw.size)
    return TF.resized_crop(image, top, left, height, width, list(draw.size), antialias=True,
                           interpolation=_MODES.get(draw.interpolation, draw.interpolation))


def _crops_in_kernels(images: Sequence[Tensor], draws: Sequence[Draw], asked: Optional[bool]) -> bool:
    """Whether augment resizes the crops in resize.py's kernels: asked, or (None) on CUDA where Triton imports;
    never for a filter they do not compute, crops of several sizes, or images that are not RGB."""
    if not images or asked is False or not (asked or images[0].is_cuda):
        return False
    if any(draw.interpolation not in _KERNEL_FILTERS for draw in draws) or len({draw.size for draw in draws}) > 1 \
            or any(image.shape[0] != 3 for image in images):
        return False
    if asked:
        return True
    try:
        import triton  # noqa: F401
    except ImportError:  # (a CUDA machine without Triton: torchvision's resize)
        return False
    return True


# ---- decoding and the loader ----

def collate_samples(batch: List[Tuple[Sample, int]]) -> Tuple[List[Sample], Tensor]:
    """The workers' batches: the samples as a list (files differ in length), the targets as a tensor."""
    return [sample for sample, _ in batch], torch.tensor([target for _, target in batch])


class JpegDecoder(NamedTuple):
    """A library's JPEG decoder: decode(data or a list of data, mode="RGB", device=...) -> uint8 [3, H, W] (or their
    list); turns: whether it turns each image by its EXIF orientation (TorchCodec's always does)."""
    name: str
    decode: Callable[..., Any]
    turns: bool


JPEG_DECODERS = ("torchcodec", "torchvision")  # jpeg_decoder's order: the first that works decodes


def jpeg_decoder(names: Sequence[str] = JPEG_DECODERS, device: Optional[torch.device] = None) -> JpegDecoder:
    """The first of `names` whose decoder loads (and, given a device, decodes a small JPEG there: nvJPEG's library
    may be missing): TorchCodec's (the one torchvision 0.29 deprecated its own for: the same libjpeg-turbo and
    nvJPEG, but it turns images by their EXIF orientation), torchvision's (while it has one). One installed that
    does not work is named in a warning; none is a UserError saying what to install."""
    failed, broken = [], False  # (broken: one of them is installed but does not work)
    for name in names:
        try:
            decode = _library_decoder(name)
        except ModuleNotFoundError:
            failed.append(f"{name} is not installed")
            continue
        except (ImportError, OSError, RuntimeError) as error:  # a torchvision without it; a build for another torch
            failed.append(f"{name}'s does not load ({first_line(error)})")
            broken = True
            continue
        if device is not None:
            try:
                decode(torch.frombuffer(bytearray(_small_jpeg()), dtype=torch.uint8), mode="RGB", device=device)
            except RuntimeError as error:
                failed.append(f"{name}'s does not decode on {device} ({_decoder_error(error)})")
                broken = True
                continue
        if broken:
            log.warning("data.decode=gpu decodes with %s's JPEG decoder: %s", name, "; ".join(failed))
        return JpegDecoder(name, decode, turns=name == "torchcodec")
    raise UserError(f"data.decode=gpu needs a JPEG decoder that runs on the device ({'; '.join(failed)}): pip install "
                    f"torchcodec, or set data.decode=cpu")


def _library_decoder(name: str) -> Callable[..., Any]:
    if name == "torchcodec":
        from torchcodec.decoders import decode_jpeg
    else:
        from torchvision.io import decode_jpeg
    return decode_jpeg


def _decoder_error(error: RuntimeError) -> str:
    """A decoder's error without the C++ function and source line before it (TorchCodec's and torchvision's
    "decode_jpeg, /path/decode_jpeg.cpp:171, Not a JPEG file: ..."): what it says of the file."""
    return re.sub(r"^\w+, \S+:\d+, ", "", first_line(error))


@functools.lru_cache(maxsize=1)
def _small_jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (124, 116, 104)).save(out, "JPEG")
    return out.getvalue()


# an EXIF orientation's turn undone: [3, H, W] as decoded -> as stored (2-4 and 5, 7: their own inverses)
_UNTURN: Dict[int, Callable[[Tensor], Tensor]] = {
    2: lambda x: x.flip(2), 3: lambda x: x.flip(1, 2), 4: lambda x: x.flip(1), 5: lambda x: x.transpose(1, 2),
    6: lambda x: x.rot90(1, (1, 2)), 7: lambda x: x.transpose(1, 2).flip(1, 2), 8: lambda x: x.rot90(-1, (1, 2))}


class Decoder:
    """Batched JPEG decoding on `device` (jpeg_decoder's, or `jpeg`), each image as stored, as PIL decodes it (a
    decoder that turns images by their EXIF orientation has the turn undone), and PIL's decoding for the files
    the decoder rejects or decodes to another size than their header's (counted in `fallbacks`; the first is
    reported with its reason).

    On CUDA it decodes with a stream of its own current: nvJPEG's hardware decoder (A100, H100) writes its
    outputs before the work already queued on the stream they were allocated on has run, so on the training
    stream it would be handed, and overwrite, memory freed by the last step that queued kernels still read
    (pytorch/vision#9606: NaNs or wrong numbers in code that never touched the decoder). Blocks freed on the
    training stream are not handed out on another; the training stream then waits for the decoding. (TorchCodec
    guards against the same bug by waiting on the host for the current stream before and after it decodes: on
    the training stream the host would wait for the last step's queued kernels; on this one, for nothing else.)"""

    def __init__(self, device: torch.device, jpeg: Optional[JpegDecoder] = None) -> None:
        self.device = device
        self.jpeg = jpeg or jpeg_decoder(device=device)
        self.fallbacks = 0
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, files: Sequence[Encoded]) -> List[Tensor]:
        if self.stream is None:
            return self._decode(files)
        with torch.cuda.stream(self.stream):
            images = self._decode(files)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for image in images:  # used on the training stream: not reused on the decoder's until that use is done
            image.record_stream(current)
        return images

    def _decode(self, files: Sequence[Encoded]) -> List[Tensor]:
        try:
            images = self.jpeg.decode([f.data for f in files], mode="RGB", device=self.device)
        except RuntimeError:  # one file the decoder rejects fails the batch: one at a time, to find it
            return [self.one(f) for f in files]
        return [self._as_stored(image, f) for image, f in zip(images, files)]

    def one(self, file: Encoded) -> Tensor:
        try:
            image = self.jpeg.decode(file.data, mode="RGB", device=self.device)
        except RuntimeError as error:
            return self._by_pil(file, _decoder_error(error))
        return self._as_stored(image, file)

    def _as_stored(self, image: Tensor, file: Encoded) -> Tensor:
        """image with its EXIF turn undone where the decoder made it; PIL's decoding where it is not of the size the
        header gave (the workers drew its crop for that size): EXIF that PIL and the decoder read differently."""
        if self.jpeg.turns and file.orientation in _UNTURN:
            image = _UNTURN[file.orientation](image)
        if image.shape[1:] != (file.size[1], file.size[0]):
            return self._by_pil(file, f"decoded {image.shape[2]}x{image.shape[1]} of a {file.size[0]}x{file.size[1]} "
                                      f"header")
        return image

    def _by_pil(self, file: Encoded, reason: str) -> Tensor:
        try:
            with open_bytes(file.data.numpy().tobytes()) as image:
                pixels = torch.from_numpy(np.array(as_rgb(image))).permute(2, 0, 1)
        except PIL_ERRORS as error:
            raise UserError(f"unreadable training image {file.path} ({error}); remove or replace it") from None
        if not self.fallbacks:
            log.warning("data.decode=gpu: %s was decoded by PIL on the CPU (the device decoder: %s); such files "
                        "are counted and reported at the end of each epoch", file.path, reason)
        self.fallbacks += 1
        return host_to_device(pixels, self.device)


class DeviceDecodeLoader:
    """Iterates a DataLoader of `collate_samples` batches as normalised, randomly erased float images on
    `device` (what the CPU path's timm PrefetchLoader yields; not that loader itself: on CUDA it normalises on
    a side stream, which would not wait for the decoding and augmentation queued on the current one).
    `pil_decoded`: the images of the last pass that PIL decoded (this process's; the epoch loop sums the ranks')."""

    def __init__(self, loader: DataLoader, device: torch.device, mean: Sequence[float], std: Sequence[float],
                 re_prob: float = 0.0, re_mode: str = "const", re_count: int = 1) -> None:
        self.loader, self.device = loader, device
        self.decoder = Decoder(device)
        self.pil_decoded = 0
        log.info("data.decode=gpu: the training JPEGs are decoded on %s by %s's decoder", device, self.decoder.jpeg.name)
        self.mean = torch.tensor([255 * m for m in mean], device=device).view(1, -1, 1, 1)
        self.std = torch.tensor([255 * s for s in std], device=device).view(1, -1, 1, 1)
        self.random_erasing = RandomErasing(probability=re_prob, mode=re_mode, max_count=re_count, device=device) \
            if re_prob > 0 else None

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def dataset(self):
        return self.loader.dataset

    def __iter__(self) -> Iterator[Tuple[Tensor, Tensor]]:
        before, self.pil_decoded = self.decoder.fallbacks, 0
        for samples, targets in self.loader:
            images = self.decoder([s.encoded for s in samples])
            self.pil_decoded = self.decoder.fallbacks - before
            batch = augment(images, [s.draw for s in samples])
            batch = batch.float().sub_(self.mean).div_(self.std)
            if self.random_erasing is not None:
                batch = self.random_erasing(batch)
            yield batch, targets.to(self.device, non_blocking=True)
