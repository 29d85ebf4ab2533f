"""Training JPEGs decoded only down to the last row of their random crop.

DeiT's training transform starts with RandomResizedCrop, which keeps 8-100 % of an image's area (about half
on average); everything else of the decoded image is thrown away. A baseline JPEG decodes from the top down, and
libjpeg hands out each row final as it goes, so stopping at the crop's last row gives the same bits as
decoding the whole image and cropping it, for less work (the rows below are never decoded). Nothing else
changes: the crop, its draws and the resize are timm's, on a PIL image.

`read_for_crop` is the training split's ImageFolder loader where the transform crops first
(`build.build_dataset`): a JPEG comes back opened but not decoded, as a `DecodedOnCrop`, whose `crop` decodes
the rows the box needs. That is done only where the file is one scan whose data runs to the end-of-image marker
that ends the file, with no other marker on the way but restart markers (`_one_scan`): then libjpeg reads nothing
after the crop's rows that could fail the whole image. Anything else (a PNG named .JPEG, a progressive JPEG, a file
with bytes after its end marker or a marker where its scan should run, a box outside the image) takes PIL's usual
path, so a file PIL cannot read fails as it did: `crop` raises `UnreadableImage`, which the dataset handles as
the loader's own errors (datasets.SafeImageFolder).

`read_rgb` is every other ImageFolder read: torchvision's loader, but with 16-bit greyscale kept (`as_rgb`).
"""
from __future__ import annotations

import io
import re
import struct
from typing import Optional, Tuple

import numpy as np
from PIL import Image, JpegImagePlugin, UnidentifiedImageError

# A value for the ends of the last wanted row before decoding: if both are still there afterwards, the decoder
# stopped early (an error) or the row really ends in that colour; either way PIL decodes the whole image.
_SENTINEL = {"L": 7, "RGB": (7, 251, 13), "CMYK": (7, 251, 13, 3)}
_START, _END = b"\xff\xd8\xff", b"\xff\xd9"
_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # a marker: not a data byte 0xFF, a restart marker or fill


# What PIL raises for a file it cannot read: damaged data, and an image past twice its size limit
# (Image.MAX_IMAGE_PIXELS: DecompressionBombError, which is none of the others).
PIL_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class UnreadableImage(OSError):
    """PIL cannot read an image file: raised where a crop decodes it (inside the transform), and by
    SafeImageFolder for its loader's errors."""


class DecodedOnCrop(JpegImagePlugin.JpegImageFile):
    """A JPEG opened from memory, decoded by its first `crop`: rows 0 to the box's bottom only, then cropped
    and converted to RGB (pointwise, so in either order the same bits as ImageFolder's loader gives)."""

    def _open(self) -> None:
        super()._open()
        self._scan_start = self.fp.tell()  # (PIL reads the headers up to the first scan's, and stops there)

    def crop(self, box: Optional[Tuple[int, int, int, int]] = None) -> Image.Image:
        try:
            rows = self._decoded_rows(box) if box is not None else None
            image = rows.crop(box) if rows is not None else super().crop(box)  # (PIL's: the whole image)
        except PIL_ERRORS as error:  # as SafeImageFolder catches from a loader
            raise UnreadableImage(str(error)) from error
        return image if image.mode == "RGB" else image.convert("RGB")

    def _decoded_rows(self, box: Tuple[int, int, int, int]) -> Optional[Image.Image]:
        """The image's rows 0 to box's bottom, or None where this cannot be (or was not) done exactly."""
        width, height = self.size
        left, top, right, bottom = box
        data = self.fp.getbuffer()  # (the file's bytes, read once by read_for_crop)
        if (len(self.tile) != 1 or self.tile[0][0] != "jpeg"  # (an image loaded already has no tiles)
                or self.mode not in _SENTINEL or not 0 <= left <= right <= width or not 0 <= top <= bottom <= height
                or bottom == 0 or not _one_scan(data, self._scan_start)):
            return None
        _, _, offset, args = self.tile[0]
        rows, ends = Image.new(self.mode, (width, bottom)), ((0, bottom - 1), (width - 1, bottom - 1))
        for end in ends:
            rows.putpixel(end, _SENTINEL[self.mode])
        decoder = Image._getdecoder(self.mode, "jpeg", args, self.decoderconfig)
        decoder.setimage(rows.im, (0, 0, width, bottom))
        try:
            # (returns an error once it has stopped short of the image's end, after the rows asked for)
            decoder.decode(data[offset:])
        finally:
            decoder.cleanup()
        if all(rows.getpixel(end) == _SENTINEL[self.mode] for end in ends):
            return None
        return rows


def _one_scan(data: memoryview, start: int) -> bool:
    """Whether the bytes from `start` (a scan's entropy-coded data) run to the end-of-image marker that ends the
    file with no marker on the way but restart markers (0xFF 0x00 is a data byte 0xFF, 0xFF before 0xFF fill). Else
    libjpeg would read on after the rows a crop needs: the next scan of a progressive JPEG, tables, or what a
    damaged file has there (no end marker: PIL decides if truncated; a marker where the data should run: libjpeg
    fills the rest of the scan grey and, at some, fails the whole image after its last row)."""
    marker = _MARKER.search(data, start) if data[-2:] == _END else None
    return marker is not None and marker.start() == len(data) - 2


def read_for_crop(path: str) -> Image.Image:
    """ImageFolder's loader for a transform that crops first: a JPEG opened, its decoding left to the crop;
    any other file as ImageFolder's own loader reads it (PIL, converted to RGB)."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(_START):
        try:
            image = DecodedOnCrop(io.BytesIO(data), path)
        except (OSError, ValueError, SyntaxError, IndexError, TypeError, struct.error):  # (Image.open's catches)
            pass  # (PIL's Image.open tells why, as it did before)
        else:
            Image._decompression_bomb_check(image.size)  # (as Image.open: a warning, or an error past twice the limit)
            return image
    return as_rgb(open_bytes(data))


def read_rgb(path: str) -> Image.Image:
    """ImageFolder's loader (torchvision's pil_loader), by as_rgb."""
    with open(path, "rb") as f:
        return as_rgb(Image.open(f))


# PIL's modes of one 16-bit channel: PNG and TIFF greyscale of depth 16 (a 32-bit "I" image, whose range is not
# known, is converted as before)
_SIXTEEN_BITS = ("I;16", "I;16L", "I;16B", "I;16N")


def as_rgb(image: Image.Image) -> Image.Image:
    """image.convert("RGB"), but an image of 16-bit greyscale first keeps its top 8 bits, as PIL itself reads
    16-bit RGB PNGs: convert would clip every value above 255, turning all but the darkest 1/256 of the range
    white (torchvision's loader does)."""
    if image.mode in _SIXTEEN_BITS:
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    return image.convert("RGB")  # (loads it: read_rgb closes the file)


def open_bytes(data: bytes) -> Image.Image:
    """Image.open of a file's bytes; for a file of no format PIL reads, an error that says so (PIL's names the buffer,
    `<_io.BytesIO object at 0x...>`, where the callers name the file)."""
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError("not an image format PIL reads") from None
