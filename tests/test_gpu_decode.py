"""data.decode=gpu (lion_vit.data.gpu) on a CPU: each device op against timm's PIL op on the same image and
parameters, the drawn augmentation against timm's DeiT transform for the same seed, decoding and its PIL
fallback, and train.py with it.

Tolerances, in uint8 levels: the RandAugment ops follow PIL's arithmetic and differ by at most 1 (float
rounding at a truncation); the crop's resize in resize.py's kernel (CUDA's path; under Triton's interpreter here)
not at all, in torchvision's port of PIL's filters (a CPU device's path) by at most 2, 0.5 on average. Through a whole DeiT transform those differences stay under 0.5 levels on average; where
an op thresholds (solarize, posterize: a pixel one level apart falls on the other side) or stretches levels
(equalize: one level becomes up to four), at most 3 % of pixels are more than 2 levels apart.
"""
from __future__ import annotations

import io
import logging
import random
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from omegaconf import OmegaConf
from PIL import Image
from timm.data import auto_augment, create_transform

import lion_vit.data.build  # noqa: F401  (timm's posterize as the CPU path runs it: compat.py)
from lion_vit.data import build_dataset, build_loader, on_device
from lion_vit.data.gpu import (BATCH_OPS, JPEG_DECODERS, Decoder, DrawAugmentation, Encoded, JpegDecoder, augment,
                               device_op, jpeg_decoder, read_encoded)
from lion_vit.errors import UserError
from runs import SMALL_LION, assert_clean_error, assert_ok, read_metrics, run_train, two_gloo_ranks

# on a GPU machine (gpu-check part input_gpu) every test runs on CUDA too: nvJPEG and the ops on CUDA tensors
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _loads(name: str) -> bool:
    try:
        jpeg_decoder([name])
    except UserError:
        return False
    return True


DECODERS = [name for name in JPEG_DECODERS if _loads(name)]  # the JPEG decoders installed here (TorchCodec's: not CI's)
FILL = (124, 116, 104)  # timm's img_mean fill for ImageNet's mean
BICUBIC, BILINEAR = Image.Resampling.BICUBIC, Image.Resampling.BILINEAR


def photo(seed: int, width: int = 300, height: int = 260) -> Image.Image:
    """Smooth colour fields with grain and a few hard edges: what a photo's JPEG holds, not noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (6, 7, 3)).astype(np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float64)
    field[height // 3: height // 2, width // 4: width // 2] = rng.uniform(0, 255, 3)
    pixels = np.clip(field + rng.normal(0, 8, field.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def jpeg_bytes(image: Image.Image, orientation: int = 0, **kwargs) -> bytes:
    """A JPEG of image; orientation: an EXIF orientation tag (1-8) to store with it, which PIL's decoding ignores."""
    out = io.BytesIO()
    if orientation:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    image.save(out, "JPEG", quality=90, **kwargs)
    return out.getvalue()


def as_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def levels_apart(expected: Image.Image, got: torch.Tensor) -> torch.Tensor:
    return (as_tensor(expected).int() - got.int()).abs()


OP_CASES = [
    ("auto_contrast", ()), ("equalize", ()), ("invert", ()), ("posterize", (3,)), ("posterize", (0,)),
    ("posterize", (8,)), ("solarize", (100,)), ("solarize_add", (60,)),
    ("color", (0.3,)), ("color", (1.7,)), ("contrast", (0.3,)), ("contrast", (1.7,)),
    ("brightness", (0.3,)), ("brightness", (1.7,)), ("sharpness", (0.3,)), ("sharpness", (1.7,)),
    ("rotate", (17.3,)), ("rotate", (-29.0,)), ("shear_x", (0.21,)), ("shear_y", (-0.27,)),
    ("translate_x_abs", (40.3,)), ("translate_y_abs", (-20.0,)), ("translate_x_rel", (0.3,)),
    ("translate_y_rel", (-0.2,)),
]


def test_every_device_op_is_tested():
    assert {name for name, _ in OP_CASES} == set(BATCH_OPS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("resample", [BICUBIC, BILINEAR], ids=["bicubic", "bilinear"])
@pytest.mark.parametrize("name,args", OP_CASES, ids=[f"{n}{a}" for n, a in OP_CASES])
def test_device_op_equals_timms_pil_op(name, args, resample, device):
    image = photo(1, 224, 224)
    pil_op = auto_augment.NAME_TO_OP["PosterizeIncreasing"] if name == "posterize" else getattr(auto_augment, name)
    kwargs = dict(fillcolor=FILL, resample=resample)
    expected = pil_op(image, *args, **dict(kwargs))  # (timm's geometric ops consume their kwargs)
    apart = levels_apart(expected, device_op(name, as_tensor(image).to(device), *args, **kwargs).cpu())
    assert apart.max() <= 1, (name, apart.max())


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("device", DEVICES)
def test_decoding_equals_pils(device, decoder):
    """On a CPU TorchCodec's and torchvision's libjpeg-turbo decode as PIL's; nvJPEG's IDCT and chroma upsampling
    differ: at most one level on average. Each image as stored, whatever its EXIF orientation, as PIL decodes it
    (and timm's transform crops it): TorchCodec turns images by it, the Decoder turns them back."""
    decode = Decoder(torch.device(device), jpeg_decoder([decoder]))
    for orientation in range(9):  # (0: no EXIF)
        data = jpeg_bytes(photo(2, 300, 260), orientation)
        (decoded,) = decode([read_encoded_bytes(data)])
        expected = Image.open(io.BytesIO(data)).convert("RGB")
        assert decoded.shape == (3, 260, 300), orientation
        apart = levels_apart(expected, decoded.cpu())
        assert apart.max() == 0 if device == "cpu" else apart.float().mean() <= 1.0, orientation
    assert decode.fallbacks == 0


def test_jpeg_decoder_is_torchcodecs_else_torchvisions_else_a_line_saying_what_to_install(monkeypatch, caplog):
    """TorchCodec's where it loads and decodes on the device, else torchvision's (a TorchCodec that does not work
    said once), else one line: here with TorchCodec missing, broken and without nvJPEG, and a torchvision past its
    decoders' deprecation."""
    import torchvision.io
    assert jpeg_decoder(["torchvision"]) == JpegDecoder("torchvision", torchvision.io.decode_jpeg, turns=False)
    cpu = torch.device("cpu")

    def torchcodec(decoders):  # importing it: None raises ModuleNotFoundError, a module without decode_jpeg ImportError
        monkeypatch.setitem(sys.modules, "torchcodec", types.ModuleType("torchcodec") if decoders else None)
        monkeypatch.setitem(sys.modules, "torchcodec.decoders", decoders)

    def no_nvjpeg(*args, **kwargs):
        raise RuntimeError("nvjpeg library not found")

    for decoders, said in [(None, None), (types.ModuleType("torchcodec.decoders"), "torchcodec's does not load"),
                           (types.SimpleNamespace(decode_jpeg=no_nvjpeg),
                            "torchcodec's does not decode on cpu (nvjpeg library not found)")]:
        torchcodec(decoders)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lion_vit.data.gpu"):
            assert jpeg_decoder(device=cpu).name == "torchvision"
        assert (said in caplog.text) if said else not caplog.text
    monkeypatch.delattr(torchvision.io, "decode_jpeg")
    with pytest.raises(UserError, match=r"needs a JPEG decoder that runs on the device \(torchcodec's does not decode "
                                        r"on cpu .*; torchvision's does not load .*\): pip install torchcodec, or set "
                                        r"data.decode=cpu"):
        jpeg_decoder(device=cpu)
    torchcodec(None)
    with pytest.raises(UserError, match=r"\(torchcodec is not installed; torchvision's does not load"):
        jpeg_decoder(device=cpu)


def test_an_image_decoded_to_another_size_than_its_headers_is_decoded_by_pil(caplog):
    """The workers drew its crop for the header's size: EXIF that PIL and a decoder read differently must not
    hand the crops a turned image."""
    data = jpeg_bytes(photo(4, 90, 60))
    turning = JpegDecoder("turning", lambda data, mode, device: [image.transpose(1, 2) for image in
                                                                 jpeg_decoder().decode(data, mode=mode, device=device)],
                          turns=False)
    decoder = Decoder(torch.device("cpu"), turning)
    with caplog.at_level(logging.WARNING, logger="lion_vit.data.gpu"):
        (decoded,) = decoder([read_encoded_bytes(data)])
    assert levels_apart(Image.open(io.BytesIO(data)).convert("RGB"), decoded).max() == 0
    assert decoder.fallbacks == 1 and "decoded 60x90 of a 90x60 header" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG's decoding needs a GPU")
def test_device_decoding_leaves_alone_memory_that_queued_kernels_still_read():
    """nvJPEG's hardware decoder writes its outputs before the work queued on their stream has run
    (pytorch/vision#9606). Tensors freed while reductions over them wait behind a long kernel, as a training
    step's activations when the loader decodes the next batch, must keep their values through the decoding."""
    files = [read_encoded_bytes(jpeg_bytes(photo(3, 256, 256)))] * 4
    decoder = Decoder(torch.device("cuda"))
    decoder(files)  # its start-up (handles, buffers) first
    elements = 3 * 256 * 256 // 4  # float32 tensors of a decoded image's bytes: the blocks it would be handed
    wrong = 0
    for _ in range(50):
        victims = [torch.full((elements,), 1.5, device="cuda") for _ in files]
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # tens of ms of one kernel, ahead of the reductions
        sums = [victim.sum() for victim in victims]
        del victims  # their memory goes back to the allocator while the reductions are queued
        decoder(files)
        torch.cuda.synchronize()
        wrong += sum(total.item() != 1.5 * elements for total in sums)
    assert wrong == 0


def read_encoded_bytes(data: bytes, name: str = "x.JPEG") -> Encoded:
    """read_encoded of a file of these bytes."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(data)
        return read_encoded(str(path))._replace(path=name)


def deit_transform(img_size: int = 224, **kwargs):
    settings = dict(is_training=True, auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic",
                    use_prefetcher=True, scale=(0.08, 1.0), hflip=0.5)
    return create_transform(img_size, **{**settings, **kwargs})


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states():
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def decoded_on(device: str):
    """Decoding as PIL's (on the CPU), the images then on `device`: the ops' tolerances alone."""
    cpu = Decoder(torch.device("cpu"))
    return lambda files: [image.to(device) for image in cpu(files)]


@pytest.mark.parametrize("interpolation", ["bicubic", "random"])
@pytest.mark.parametrize("device", DEVICES)
def test_drawn_augmentation_equals_deit_transform_for_the_same_seed(tmp_path, device, interpolation):
    """Same seed: the same random calls (the generators end in the same state) and the same image, within
    the tolerances above. Over 150 seeds every op of DeiT's RandAugment is drawn. timm's "random" interpolation
    (a transform of one's own: train.py's settings name one filter) draws the crop's filter and each geometric op's
    where timm's does."""
    transform = deit_transform(interpolation=interpolation)
    draw = DrawAugmentation(transform)
    decoder = decoded_on(device)
    drawn_ops, flips, filters = set(), set(), set()
    for seed in range(150):
        path = tmp_path / f"{seed % 6}.JPEG"
        if not path.exists():  # (EXIF orientations among them, which PIL and so timm's transform ignore)
            path.write_bytes(jpeg_bytes(photo(seed % 6, 300 + 37 * (seed % 6), 260), orientation=3 + seed % 6))
        seed_all(seed)
        expected = transform(Image.open(path).convert("RGB"))
        after_pil = rng_states()
        seed_all(seed)
        sample = draw(read_encoded(str(path)))
        assert rng_states()[:2] == after_pil[:2] and torch.equal(rng_states()[2], after_pil[2])
        got = augment(decoder([sample.encoded]), [sample.draw])[0].cpu()
        apart = (expected.int() - got.int()).abs()
        assert apart.float().mean() <= 0.5 and (apart > 2).float().mean() <= 0.03, (seed, sample.draw)
        drawn_ops |= {name for name, _, _ in sample.draw.ops}
        flips.add(sample.draw.flip)
        filters.add(str(sample.draw.interpolation))
    assert drawn_ops == {auto_augment.NAME_TO_OP[name].__name__ for name in auto_augment._RAND_INCREASING_TRANSFORMS}
    assert flips == {True, False}
    assert len(filters) == (2 if interpolation == "random" else 1)
    # a batch applies each op once to all the images that drew it: the same images as one at a time
    samples = [draw(read_encoded(str(tmp_path / f"{i % 6}.JPEG"))) for i in range(24)]
    images = decoder([sample.encoded for sample in samples])
    batch = augment(images, [sample.draw for sample in samples])
    for image, sample, got in zip(images, samples, batch):
        assert torch.equal(got, augment([image], [sample.draw])[0])


def test_every_geometric_op_of_a_step_runs_in_one_call(monkeypatch):
    """Rotations, shears and translations, bicubic and bilinear, drawn at the same RandAugment step run as one
    affine call for the batch (a launch count that does not grow with the ops drawn), each image as it would
    alone."""
    from lion_vit.data import gpu
    calls = []
    affine = gpu._affine
    monkeypatch.setattr(gpu, "_affine", lambda images, *args: calls.append(len(images)) or affine(images, *args))
    steps = [[("rotate", (17.3,), BICUBIC), ("shear_x", (0.21,), BILINEAR), ("translate_y_rel", (-0.2,), BICUBIC),
              ("posterize", (3,), None)],
             [("shear_y", (-0.27,), BILINEAR), ("rotate", (-29.0,), BILINEAR), ("color", (0.3,), None),
              ("translate_x_abs", (40.3,), BICUBIC)]]
    draws = [gpu.Draw((3, 5, 30, 40), (24, 24), BICUBIC, flip=i % 2 == 1,
                      ops=[(name, args, {} if resample is None else dict(fillcolor=FILL, resample=resample))
                           for name, args, resample in (steps[0][i], steps[1][i])]) for i in range(4)]
    images = [as_tensor(photo(i, 50, 40)) for i in range(4)]
    batch = augment(images, draws)
    assert calls == [3, 3]
    for image, draw, got in zip(images, draws, batch):
        assert torch.equal(got, augment([image], [draw])[0])


@pytest.mark.parametrize("device", DEVICES)
def test_augmentation_never_waits_for_the_device(device):
    """A batch's augmentation reads no value back from the device and copies its drawn parameters there without
    waiting for the device's queue, so that the host queues the next batch while the GPU trains on this one: on a
    CPU no operator that reads a value back (.item(), bool(), nonzero) runs; on CUDA PyTorch's sync debug mode
    raises at any synchronising call. Every op of DeiT's RandAugment, flips, bicubic and bilinear."""
    from naive import AtenCalls
    draw = DrawAugmentation(deit_transform(64))
    seed_all(0)
    samples = [draw(read_encoded_bytes(jpeg_bytes(photo(i % 6, 80 + 7 * (i % 6), 70)))) for i in range(64)]
    draws = [sample.draw for sample in samples]
    for i in range(0, len(draws), 2):  # (DeiT's ops resample bicubic: half of them bilinear too)
        draws[i].ops = [(name, args, {**kwargs, "resample": BILINEAR} if "resample" in kwargs else kwargs)
                        for name, args, kwargs in draws[i].ops]
    assert {name for d in draws for name, _, _ in d.ops} == {
        auto_augment.NAME_TO_OP[name].__name__ for name in auto_augment._RAND_INCREASING_TRANSFORMS}
    assert {d.flip for d in draws} == {True, False}
    assert {kwargs.get("resample") for d in draws for _, _, kwargs in d.ops} >= {BICUBIC, BILINEAR}
    images = decoded_on(device)([sample.encoded for sample in samples])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            augment(images, draws)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        with AtenCalls() as seen:
            augment(images, draws)
        assert not {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"} & seen.names


def test_sharpness_smooths_as_torchvision_does():
    """The sharpness op's degenerate image (PIL's SMOOTH filter, the border kept), made with a kernel copied
    without waiting for the device: torchvision's adjust_sharpness(images, 0.0), bit for bit, small images too."""
    from lion_vit.data.gpu import _smooth
    generator = torch.Generator().manual_seed(0)
    for shape in [(5, 3, 40, 37), (2, 3, 3, 3), (1, 3, 2, 9)]:
        images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        assert torch.equal(_smooth(images), TF.adjust_sharpness(images, 0.0))


@pytest.mark.parametrize("device", DEVICES)
def test_crop_resize_alone_is_within_two_levels(tmp_path, device):
    transform = deit_transform(auto_augment=None, hflip=0.0, color_jitter=0.0)
    path = tmp_path / "a.JPEG"
    path.write_bytes(jpeg_bytes(photo(3)))
    seed_all(0)
    expected = transform(Image.open(path).convert("RGB"))
    seed_all(0)
    sample = DrawAugmentation(transform)(read_encoded(str(path)))
    apart = (expected.int() - augment(decoded_on(device)([sample.encoded]), [sample.draw])[0].cpu().int()).abs()
    assert apart.max() <= 2 and apart.float().mean() <= 0.5


CROPS = [((60, 70), (5, 7, 50, 60)), ((60, 70), (0, 0, 60, 70)), ((40, 33), (3, 2, 9, 12)), ((24, 24), (0, 0, 24, 24)),
         ((30, 90), (1, 4, 24, 85))]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_crop_kernels_resize_every_crop_as_pil_does(device, size=(20, 28)):
    """resize.py's kernel (under Triton's interpreter on a CPU) against PIL's crop and resize: the same bits,
    bicubic and bilinear, crops shrunk, kept and enlarged, in one batch of images of different sizes and memory
    layouts, their passes in the order the installed Pillow runs them (Pillow 13: vertical first for the 24 x 24
    crop)."""
    pytest.importorskip("triton")
    from lion_vit.data.resize import resized_crops
    images, boxes, bicubic, expected = [], [], [], []
    for i, ((height, width), box) in enumerate(CROPS):
        for cubic in (True, False):
            image = photo(i, width, height)
            top, left, crop_h, crop_w = box
            crop = image.crop((left, top, left + crop_w, top + crop_h))
            expected.append(as_tensor(crop.resize(size[::-1], BICUBIC if cubic else BILINEAR)))
            pixels = as_tensor(image)  # (interleaved in memory, as a CPU's decoder writes them; planar, as nvJPEG's)
            images.append((pixels if cubic else pixels.contiguous()).to(device))
            boxes.append(box)
            bicubic.append(cubic)
    got = resized_crops(images, boxes, size, bicubic).cpu()
    for index, want in enumerate(expected):
        assert torch.equal(got[index], want), (CROPS[index // 2], bicubic[index])


@pytest.mark.filterwarnings("error::RuntimeWarning")  # (the interpreter's cast of a value out of int32's range)
@pytest.mark.parametrize("img_size", [24, (16, 28)], ids=["square", "16x28"])
@pytest.mark.parametrize("device", DEVICES)
def test_augment_resizes_the_crops_in_the_kernels_as_deits_transform_does(tmp_path, device, img_size):
    """augment's crops in the kernels (on CUDA by default) give timm's RandomResizedCrop and flip for the same seed
    bit for bit, where torchvision's resize one image at a time is within two levels; crops of (height, width)
    too (img_size=[16,28])."""
    pytest.importorskip("triton")
    transform = deit_transform(auto_augment=None, color_jitter=0.0, img_size=img_size)
    decoder = decoded_on(device)
    for seed in range(4):
        path = tmp_path / f"{seed}.JPEG"
        path.write_bytes(jpeg_bytes(photo(seed, 60 + 9 * seed, 50)))
        seed_all(seed)
        expected = transform(Image.open(path).convert("RGB"))
        seed_all(seed)
        sample = DrawAugmentation(transform)(read_encoded(str(path)))
        images = decoder([sample.encoded])
        assert torch.equal(augment(images, [sample.draw], crop_kernels=True)[0].cpu(), expected)
        apart = (augment(images, [sample.draw], crop_kernels=False)[0].cpu().int() - expected.int()).abs()
        assert apart.max() <= 2


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_crop_of_a_tiny_image_resizes_to_black_as_pil_does(tmp_path, device):
    """timm's RandomResizedCrop draws a crop of no pixels from an image of a few (its width and height round to
    0); PIL resizes it to black, and so do both of augment's resizes."""
    pytest.importorskip("triton")
    transform = deit_transform(auto_augment=None, color_jitter=0.0, img_size=8)
    path = tmp_path / "tiny.JPEG"
    path.write_bytes(jpeg_bytes(photo(0, 1, 1)))
    empty = 0
    for seed in range(6):
        seed_all(seed)
        expected = transform(Image.open(path).convert("RGB"))
        seed_all(seed)
        sample = DrawAugmentation(transform)(read_encoded(str(path)))
        empty += 0 in sample.draw.box[2:]
        images = decoded_on(device)([sample.encoded])
        for kernels in (True, False):
            assert torch.equal(augment(images, [sample.draw], crop_kernels=kernels)[0].cpu(), expected), (seed, kernels)
    assert empty


def test_what_has_no_device_version_is_one_clear_line():
    with pytest.raises(UserError, match="no device version of ColorJitter"):
        DrawAugmentation(deit_transform(auto_augment=None, color_jitter=0.4))
    transform = deit_transform()
    transform.transforms[2] = auto_augment.RandAugment([auto_augment.AugmentOp("GaussianBlurRand", 0.5, 9)], 2)
    with pytest.raises(UserError, match="no device version of RandAugment's GaussianBlurRand"):
        DrawAugmentation(transform)
    DrawAugmentation(deit_transform(auto_augment=None, color_jitter=0.0))  # no jitter: RNG kept in step, no op
    # without augmentation (aug=digits, aug=none: resize and crop) the line names the augmentation, not Resize
    with pytest.raises(UserError, match=r"runs DeiT's training augmentation .*: set aug=deit"):
        DrawAugmentation(create_transform(32, is_training=False, use_prefetcher=True))
    # filters other than bicubic and bilinear: refused before any batch, in the crop's resize or RandAugment's ops
    for interpolation in ("nearest", "lanczos", "box", "hamming"):
        with pytest.raises(UserError, match=f"bicubic and bilinear filters only, not {interpolation}; set data.interp"):
            DrawAugmentation(deit_transform(interpolation=interpolation))
        with pytest.raises(UserError, match=f"not {interpolation};"):
            DrawAugmentation(deit_transform(interpolation=interpolation, auto_augment=None, color_jitter=0.0))
    transform = deit_transform()
    for resample in (Image.Resampling.NEAREST, Image.Resampling.LANCZOS):  # (PIL's enum, whose values are numbers)
        transform.transforms[2].ops[0].kwargs["resample"] = resample
        with pytest.raises(UserError, match=f"not {resample.name.lower()};"):
            DrawAugmentation(transform)
    DrawAugmentation(deit_transform(interpolation="random"))  # (timm's random: bilinear or bicubic)


def write_folder(root, pngs_named_jpeg: int = 0):
    """2 classes x 4 JPEGs (one grayscale, one progressive), and PNGs named .JPEG."""
    for k in range(2):
        folder = root / "train" / f"class_{k}"
        folder.mkdir(parents=True)
        for i in range(4):
            image = photo(10 * k + i, 120 + 10 * i, 100)
            image = image.convert("L") if i == 1 else image
            (folder / f"{i}.JPEG").write_bytes(jpeg_bytes(image, progressive=i == 2))
        for i in range(pngs_named_jpeg if k == 0 else 0):
            photo(99 + i, 90, 80).save(folder / f"png_{i}.JPEG", "PNG")
    return root


def data_config(root, decode="gpu", name="imagefolder"):
    return OmegaConf.create(dict(name=name, root=str(root), train_split="train", val_split="val", download=False,
                                 mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], interpolation="bicubic",
                                 crop_pct=0.875, decode=decode))


AUG = OmegaConf.create(dict(enabled=True, auto_augment="rand-m9-mstd0.5-inc1", color_jitter=0.4, scale=[0.08, 1.0],
                            hflip=0.5, reprob=1.0, remode="pixel", recount=1))


@pytest.mark.parametrize("device", DEVICES)
def test_loader_decodes_augments_and_counts_pil_fallbacks(tmp_path, caplog, device):
    root = write_folder(tmp_path, pngs_named_jpeg=2)
    data = data_config(root)
    dataset = build_dataset(data, "train", deit_transform())
    loader = build_loader(dataset, train=True, batch_size=5, num_workers=1, rank=0, world_size=1, seed=0,
                          encoded=True)
    device_loader = on_device(loader, data, AUG, torch.device(device))
    with caplog.at_level(logging.INFO, logger="lion_vit.data.gpu"):
        batches = list(device_loader)
    assert len(batches) == len(device_loader) == 2
    for images, targets in batches:
        assert images.shape == (5, 3, 224, 224) and images.dtype == torch.float32 and targets.shape == (5,)
        assert images.device.type == targets.device.type == device
        assert images.abs().max() < 10  # normalised (pixel-mode erasing draws N(0, 1))
    assert device_loader.pil_decoded == 2  # the PNGs, decoded by PIL
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    (warning,) = warnings  # the decoder's reason without its C++ source location
    assert "png_" in warning.getMessage() and "(the device decoder: Not a JPEG file" in warning.getMessage()
    with caplog.at_level(logging.INFO, logger="lion_vit.data.gpu"):
        list(device_loader)  # a second epoch: counted afresh, not warned of again
    assert device_loader.pil_decoded == 2 and device_loader.decoder.fallbacks == 4
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == warnings


class _DecodingLoader(list):
    """Batches that a device loader says PIL decoded `pil_decoded` images of."""
    pil_decoded = 0


def _sum_pil_decoded(rank: int, out: Path) -> None:
    """One rank of a two-process gloo group training an epoch whose loader says PIL decoded rank + 1 images."""
    from lion_vit.engine.loop import Precision, Training, classification_loss, train_one_epoch
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    loader = _DecodingLoader([(torch.randn(2, 1, 2, 2), torch.tensor([0, 1]))] * 2)
    loader.pil_decoded = rank + 1
    scheduler = types.SimpleNamespace(step_update=lambda num_updates: None)
    stats = train_one_epoch(Training(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     classification_loss(torch.nn.CrossEntropyLoss()), scheduler,
                                     Precision(torch.device("cpu"))), loader, 0, show_progress=False)
    (out / f"rank{rank}").write_text(str(stats["pil_decoded"]))


def test_the_epochs_pil_decoded_images_are_summed_over_the_ranks(tmp_path):
    """Each rank's Decoder counts its own fallbacks: the epoch's count (metrics.jsonl, rank 0's log) is the sum."""
    two_gloo_ranks(_sum_pil_decoded, tmp_path)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["3", "3"]


def test_unreadable_training_file_is_an_error_naming_it(tmp_path):
    root = write_folder(tmp_path)
    bad = root / "train" / "class_0" / "0.JPEG"
    bad.write_bytes(bad.read_bytes()[:2000])  # a header PIL reads, half an image
    data = data_config(root)
    dataset = build_dataset(data, "train", deit_transform())
    decoder = Decoder(torch.device("cpu"))
    sample, _ = dataset[dataset.samples.index((str(bad), 0))]
    with pytest.raises(UserError, match=f"unreadable training image {bad}"):  # the fallback cannot read it either
        decoder([sample.encoded])


def test_decode_gpu_needs_an_image_folder():
    with pytest.raises(UserError, match="data.decode=gpu decodes JPEG files: it needs data=imagefolder"):
        build_dataset(data_config(None, name="digits"), "train", deit_transform())


def test_train_py_with_decode_gpu_on_a_cpu(tmp_path):
    root = write_folder(tmp_path / "data", pngs_named_jpeg=2)  # (the PNGs drawn with DeiT's repeats: 4 times)
    for k in range(2):
        val = root / "val" / f"class_{k}"
        val.mkdir(parents=True)
        photo(50 + k, 100, 90).save(val / "0.JPEG")
    out = tmp_path / "run"
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={root}", "data.decode=gpu", "aug=deit",
                        "epochs=1", "batch_size=2", "img_size=32", f"output_dir={out}"))
    (line,) = read_metrics(out)
    assert line["epoch"] == 1 and 0 <= line["val_acc1"] <= 100 and line["pil_decoded"] > 0  # the PNGs' draws
    assert f"{line['pil_decoded']} training images of epoch 1 were decoded by PIL on the CPU" in \
        (out / "train.log").read_text()
    proc = run_train(*SMALL_LION, "data=digits", "data.decode=gpu", "epochs=1", f"output_dir={tmp_path / 'no'}")
    assert_clean_error(proc, "data.decode=gpu decodes JPEG files")
    assert not (tmp_path / "no").exists()
