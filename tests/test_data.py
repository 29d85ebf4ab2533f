"""Datasets and transforms: image folders, CIFAR pickles, augmentation, classes that must match."""
from __future__ import annotations

import io
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runs import ROOT, SMALL_LION, assert_clean_error, assert_ok, make_cifar10, make_image_folder, run_train


def test_val_classes_must_match(trained, folder, tmp_path):
    """A class folder missing from val would shift every later label silently: training and eval_only refuse."""
    import shutil
    partial = shutil.copytree(folder, tmp_path / "partial")
    shutil.rmtree(partial / "val" / "class_1")
    assert_clean_error(run_train(*SMALL_LION, "data=imagefolder", f"data.root={partial}", "epochs=1",
                                 f"output_dir={tmp_path / 'fit'}"),
                       "validation split has 2 classes, not the 3 expected", "missing ['class_1']")
    assert_clean_error(run_train(*SMALL_LION, "data=imagefolder", f"data.root={partial}", "eval_only=true",
                                 f"checkpoint={trained / 'checkpoint-best.pt'}", f"output_dir={tmp_path / 'eval'}"),
                       "has 2 classes, not the 3 expected", "classes the checkpoint was trained on")
    assert torch.load(trained / "checkpoint-best.pt")["classes"] == \
        ["class_0", "class_1", "class_2"]


def test_corrupt_image_is_skipped_with_warning(tmp_path):
    root = make_image_folder(tmp_path / "imgs", classes=2, train_per_class=4, val_per_class=2)
    bad = root / "train" / "class_0" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={root}", "epochs=1", "batch_size=2",
                     "aug=none", f"output_dir={tmp_path / 'out'}")
    assert_ok(proc)
    assert "broken.png" in proc.stdout + proc.stderr


def test_randaugment_posterize_to_zero_bits_is_a_black_image():
    """Pillow >= 13 refuses to keep 0 bits, which RandAugment asks for at its top magnitude; Pillow < 13
    (and DeiT's training) gave a black image."""
    from PIL import ImageOps
    from timm.data.auto_augment import AugmentOp
    import lion_vit.data.build  # noqa: F401  (applies the fix before transforms are built)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (9, 7, 3), dtype=np.uint8))
    zero_bits = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)  # keeps 4 - 4 = 0 bits
    out = zero_bits(image)
    assert out.mode == image.mode and out.size == image.size and not np.asarray(out).any()
    four_bits = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=0)
    assert np.array_equal(np.asarray(four_bits(image)), np.asarray(ImageOps.posterize(image, 4)))


def test_deit_augmentation_runs_through_many_images():
    """The DeiT transform (RandAugment m9, mstd 0.5) over 2,000 draws: about 1 in 400 kept 0 bits."""
    from hydra import compose, initialize_config_dir
    from lion_vit.data.build import build_transform
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["data=imagefolder", "aug=deit"])
    transform = build_transform(cfg.data, cfg.aug, 32, train=True)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    torch.manual_seed(0)
    random.seed(0)
    shapes = {tuple(transform(image).shape) for _ in range(2000)}
    assert shapes == {(3, 32, 32)}


def test_cifar_format_loading(tmp_path):
    from lion_vit.data.datasets import cifar
    from lion_vit.errors import UserError
    root = make_cifar10(tmp_path)
    train, val = cifar(str(root), 10, train=True), cifar(str(root), 10, train=False)
    assert len(train) == 30 and len(val) == 6 and train.classes[3] == "c3"
    image, label = train[0]
    assert image.size == (32, 32) and 0 <= label < 10
    test_batch = root / "cifar-10-batches-py" / "test_batch"
    whole = test_batch.read_bytes()
    test_batch.write_bytes(whole[:100])  # an archive extracted in part
    with pytest.raises(UserError, match=r"^cannot read CIFAR file .*test_batch: .*; re-extract the archive$"):
        cifar(str(root), 10, train=False)
    # content of another shape: one line naming the file and what is wrong, not a traceback from the training
    entry = pickle.loads(whole)
    wrong = {"its 'data' is not rows of 3,072 bytes": {**entry, b"data": entry[b"data"][:, :3000]},
             "its 'labels' is not a list of 6 labels": {b"data": entry[b"data"]},
             "its 'labels' holds labels outside 0-9": {**entry, b"labels": [10] * 6},
             "": [entry]}
    for problem, content in wrong.items():
        test_batch.write_bytes(pickle.dumps(content))
        with pytest.raises(UserError, match=rf"^{'' if problem else 'CIFAR file '}.*test_batch "
                                            rf"{'is not a CIFAR-10 batch: ' + problem if problem else 'holds a list'}"):
            cifar(str(root), 10, train=False)
    meta = root / "cifar-10-batches-py" / "batches.meta"
    names = meta.read_bytes()
    meta.write_bytes(pickle.dumps({b"label_names": [b"c0"]}))
    with pytest.raises(UserError, match=r"batches.meta does not name CIFAR-10's 10 classes under 'label_names'"):
        cifar(str(root), 10, train=True)
    meta.write_bytes(names)
    test_batch.write_bytes(whole)
    proc = run_train(*SMALL_LION, "data=cifar10", f"data.root={root}", "epochs=1", "batch_size=8", "aug=none",
                     f"output_dir={tmp_path / 'out'}")
    assert_ok(proc)
    assert_clean_error(run_train(*SMALL_LION, "data=cifar100", f"data.root={root}", "epochs=1",
                                 f"output_dir={tmp_path / 'cifar100'}"),
                       "CIFAR-100 not found", "data.download=true")


def test_flat_val_folder_is_named(tmp_path):
    """ImageNet's validation archive unpacks flat: say so, rather than torchvision's "no class folder"."""
    from lion_vit.data.datasets import image_folder
    from lion_vit.errors import UserError
    (tmp_path / "val").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8)).save(tmp_path / "val" / f"ILSVRC2012_val_{i:08d}.JPEG")
    with pytest.raises(UserError, match=r"val holds 3 images but no class subfolders; sort them into one folder"):
        image_folder(str(tmp_path), "val")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images found under"):
        image_folder(str(tmp_path), "empty")


def test_hidden_folders_and_files_are_neither_classes_nor_images(tmp_path):
    """Jupyter's .ipynb_checkpoints (empty, or holding an image) and a .git folder beside the class folders: the
    classes and labels are the visible folders', as without them; an empty hidden folder is no error. Nor are
    hidden files and folders within a class its images (macOS's ._<name> copies beside each image)."""
    from lion_vit.data.datasets import image_folder
    root = make_image_folder(tmp_path / "imgs", classes=2, train_per_class=2, val_per_class=1)
    plain = image_folder(str(root), "train")
    (root / "train" / ".ipynb_checkpoints").mkdir()
    (root / "val" / ".git" / "objects").mkdir(parents=True)
    shutil.copy(root / "train" / "class_0" / "img_0.png", root / "val" / ".git" / "objects" / "img.png")
    for split in ("train", "val"):
        dataset = image_folder(str(root), split)
        assert dataset.classes == ["class_0", "class_1"] and dataset.class_to_idx == {"class_0": 0, "class_1": 1}
        assert all(not Path(path).parent.name.startswith(".") for path, _ in dataset.samples)
    assert image_folder(str(root), "train").samples == plain.samples
    (root / "train" / "class_1" / "._img_0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (root / "train" / "class_1" / ".cache").mkdir()
    shutil.copy(root / "train" / "class_1" / "img_0.png", root / "train" / "class_1" / ".cache" / "img_0.png")
    (root / "train" / "class_1" / "sub").mkdir()  # (a visible folder within a class holds its images, as before)
    shutil.copy(root / "train" / "class_1" / "img_0.png", root / "train" / "class_1" / "sub" / "img_9.png")
    for given in (str(root), f"{root}/", str(root / ".." / root.name)):
        samples = image_folder(given, "train").samples
        assert [Path(path).relative_to(Path(given) / "train").as_posix() for path, _ in samples] == \
            ["class_0/img_0.png", "class_0/img_1.png", "class_1/img_0.png", "class_1/img_1.png",
             "class_1/sub/img_9.png"]


def test_a_missing_split_says_what_the_root_holds(tmp_path):
    """A root that is missing, a root that is itself a split, and splits of other names each get their own fix."""
    from lion_vit.data.datasets import image_folder
    from lion_vit.errors import UserError
    root = make_image_folder(tmp_path / "imgs", classes=2, train_per_class=1, val_per_class=1)
    with pytest.raises(UserError, match=f"data.root {tmp_path / 'nowhere'} does not exist; set data.root to a folder "
                                        "with train/ and val/ class subfolders"):
        image_folder(str(tmp_path / "nowhere"), "train")
    here = Path.cwd()
    with pytest.raises(UserError, match=re.escape(f"data.root data/nowhere (from {here}: {here / 'data' / 'nowhere'}) "
                                                  "does not exist")):
        image_folder("data/nowhere", "train")  # a relative root, as the configs' defaults are, read from the cwd
    with pytest.raises(UserError, match=r"data.root .*train looks like one split: its subfolders "
                                        r"\(class_0/, class_1/\) hold images; set data.root to the folder above"):
        image_folder(str(root / "train"), "train")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    with pytest.raises(UserError, match=f"^data folder {renamed / 'train'} does not exist; set data.root to a folder "
                                        "with train/ and val/ class subfolders"):  # (a root with no folder at all)
        image_folder(str(renamed), "train")
    for split, name in (("train", "training"), ("val", "validation")):
        (root / split).rename(renamed / name)
    with pytest.raises(UserError, match=f"data folder {renamed / 'train'} does not exist; {renamed} holds training/, "
                                        r"validation/: name its splits with data.train_split=<folder> data.val_split="):
        image_folder(str(renamed), "train")
    assert len(image_folder(str(renamed), "training")) == 2


def test_cifar_download_failure_is_one_line(tmp_path, monkeypatch):
    """data.download=true without a network says so and where to fetch the archive, not a urllib traceback;
    the folders the download made (data.root and its missing parents) go, with what it wrote there."""
    import urllib.error
    import torchvision.datasets
    from lion_vit.data.datasets import cifar
    from lion_vit.errors import UserError

    def offline(dataset):  # as torchvision's: the folder first, then the archive, cut short
        Path(dataset.root).mkdir(parents=True, exist_ok=True)
        (Path(dataset.root) / dataset.filename).write_bytes(b"part of an archive")
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(torchvision.datasets.CIFAR100, "download", offline)
    for root in (tmp_path / "data" / "cifar", tmp_path):
        with pytest.raises(UserError, match=r"could not download CIFAR-100 .*Name or service not known.*"
                                            r"fetch https://\S+cifar-100-python.tar.gz by hand"):
            cifar(str(root), 100, train=True, download=True)
    assert not (tmp_path / "data").exists()
    assert tmp_path.is_dir()  # a folder that was there stays (and a part of the archive in it, which
    # torchvision's next download replaces: it checks the file's md5)


def _deit_recipe(folder, *overrides):
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("config", overrides=["experiment=deit_small_imagenet", f"data.root={folder}", "img_size=32",
                                            "batch_size=8", *overrides])


def test_the_loader_gives_the_images_of_the_path_it_replaced_normalised_on_the_device(folder):
    """train.py's loader (uint8 from the workers, normalised on the device) against timm's transform that
    normalised in the workers, as train.py had it: for the same seed the same images up to float rounding
    (DeiT's recipe without random erasing, whose draws moved: next test), and mixup mixes both alike."""
    from timm.data import Mixup, create_transform
    from timm.utils import random_seed
    from lion_vit.data import build_dataset, build_loader, build_transform, on_device
    cfg = _deit_recipe(folder, "aug.reprob=0")
    data, aug = cfg.data, cfg.aug
    old_transform = create_transform(input_size=32, is_training=True, auto_augment=aug.auto_augment, hflip=aug.hflip,
                                     color_jitter=aug.color_jitter, scale=tuple(aug.scale), re_prob=0.0,
                                     interpolation=data.interpolation, mean=tuple(data.mean), std=tuple(data.std))

    def batches(transform, wrap):
        loader = build_loader(build_dataset(data, "train", transform), train=True, batch_size=8, num_workers=0,
                              rank=0, world_size=1, seed=0, repeated_aug=aug.repeated_aug)
        loader = wrap(loader)
        loader.sampler.set_epoch(1)
        random_seed(5)
        return list(loader)

    old = batches(old_transform, lambda loader: loader)
    new = batches(build_transform(data, aug, 32, train=True), lambda loader: on_device(loader, data, aug, torch.device("cpu")))
    assert len(old) == len(new) == 3
    for (old_images, old_targets), (new_images, new_targets) in zip(old, new):
        assert new_images.dtype == torch.float32 and torch.equal(old_targets, new_targets)
        torch.testing.assert_close(new_images, old_images, rtol=0, atol=1e-5)
    mixed = []
    for images, targets in (old[0], new[0]):
        mixup = Mixup(mixup_alpha=aug.mixup, cutmix_alpha=aug.cutmix, label_smoothing=aug.smoothing, num_classes=3)
        random_seed(7)
        mixed.append(mixup(images.clone(), targets))
    torch.testing.assert_close(mixed[1][0], mixed[0][0], rtol=0, atol=1e-5)
    assert torch.equal(mixed[1][1], mixed[0][1])


def test_random_erasing_on_the_device_draws_as_it_did_in_the_workers(folder):
    """DeiT's random erasing (probability 0.25, 'pixel': normal noise over 2-33 % of an image) drawn per
    image by timm's RandomErasing, once in the workers after normalisation, now on the device's batch:
    the same share of images erased, areas and noise alike (3,000 images each)."""
    from timm.data.random_erasing import RandomErasing
    from timm.utils import random_seed
    from torch.utils.data import DataLoader
    from lion_vit.data import on_device
    cfg = _deit_recipe(folder)
    mean, std = torch.tensor(cfg.data.mean)[:, None, None], torch.tensor(cfg.data.std)[:, None, None]
    grey = torch.full((3, 24, 24), 128, dtype=torch.uint8)
    flat = (grey / 255.0 - mean) / std
    count = 3000
    random_seed(0)
    in_workers = RandomErasing(probability=cfg.aug.reprob, mode=cfg.aug.remode, max_count=cfg.aug.recount, device="cpu")
    old = torch.stack([in_workers(flat.clone()) for _ in range(count)])
    loader = DataLoader([(grey, 0)] * count, batch_size=100)
    new = torch.cat([images for images, _ in on_device(loader, cfg.data, cfg.aug, torch.device("cpu"))])
    stats = []
    for images in (old, new):
        erased = ~torch.isclose(images, flat.expand_as(images), atol=1e-6).all(1)  # [N, H, W]
        areas = erased.flatten(1).float().mean(1)
        noise = images.permute(1, 0, 2, 3)[:, erased]
        stats.append((areas.gt(0).float().mean().item(), areas[areas > 0].mean().item(), noise.mean().item(),
                      noise.std().item()))
    (old_share, old_area, _, _), (share, area, noise_mean, noise_std) = stats
    assert abs(old_share - cfg.aug.reprob) < 0.04 and abs(share - old_share) < 0.04  # 3 standard errors
    assert abs(area - old_area) < 0.2 * old_area and 0.02 <= area <= 1 / 3
    assert abs(noise_mean) < 0.05 and abs(noise_std - 1) < 0.05


def _jpeg_kinds(folder):
    """JPEGs of the kinds PIL reads, odd sizes: chroma subsampled 4:2:0, 4:2:2 and not at all, progressive, with
    restart markers, greyscale, CMYK, and one whose scan data is damaged midway (libjpeg decodes on, warning)."""
    rng = np.random.default_rng(3)
    smooth = lambda h, w, c: np.clip(np.cumsum(rng.normal(0, 12, (h, w, c)), 1) + 128, 0, 255).astype(np.uint8)
    kinds = {"420": ("RGB", {}), "422": ("RGB", {"subsampling": 1}), "444": ("RGB", {"subsampling": 0}),
             "progressive": ("RGB", {"progressive": True}), "restarts": ("RGB", {"restart_marker_rows": 1}),
             "grey": ("L", {}), "cmyk": ("CMYK", {})}
    folder.mkdir(parents=True)
    paths = []
    for k, (name, (mode, options)) in enumerate(kinds.items()):
        size = (67 - 4 * k, 53 + 6 * k)
        paths.append(folder / f"{name}.JPEG")
        Image.frombytes(mode, size, smooth(size[1], size[0], len(mode)).tobytes()).save(paths[-1], quality=90,
                                                                                         **options)
    damaged = bytearray(paths[0].read_bytes())
    damaged[len(damaged) // 2: len(damaged) // 2 + 6] = b"\x13\x37\x00\x42\xaa\x55"
    paths.append(folder / "damaged.JPEG")
    paths[-1].write_bytes(bytes(damaged))
    return paths


def test_a_training_jpeg_decoded_down_to_its_crop_gives_the_bits_of_the_whole_image_cropped(tmp_path, monkeypatch):
    """read_for_crop (the training loader where the transform crops first): the crop of a JPEG decoded only down
    to the box's last row equals ImageFolder's (the whole image decoded, converted to RGB, cropped), for every
    kind of JPEG, boxes at the image's edges and inside it; and the decoder was asked for those rows only. PIL
    decodes whole, giving the same bits again, a progressive JPEG, one with bytes after its end marker, one with a
    marker where its scan's data should run or between the scan and the end marker (which libjpeg reads past
    without an error), and one whose last wanted row ends in the colour that marks a decoder stopped early (after
    the rows were decoded once)."""
    from PIL import Image as PILImage
    from torchvision.datasets.folder import default_loader
    from lion_vit.data.jpeg import _SENTINEL, read_for_crop
    asked = []
    getdecoder = PILImage._getdecoder

    class Recorded:  # the decoder, with the rows each decoding is asked for
        def __init__(self, decoder):
            self.decoder = decoder

        def setimage(self, image, extents=None):
            asked.append(extents[3] if extents else image.size[1])
            return self.decoder.setimage(image, *([extents] if extents else []))

        def __getattr__(self, name):
            return getattr(self.decoder, name)

    monkeypatch.setattr(PILImage, "_getdecoder", lambda *args: Recorded(getdecoder(*args)))
    rng = np.random.default_rng(0)
    paths = _jpeg_kinds(tmp_path / "jpegs")
    whole_by_pil = {path: 1 for path in paths if path.stem == "progressive"}  # (decodings a crop takes)
    whole_by_pil.update({tmp_path / name: 1 for name in ("trailing.JPEG", "tables.JPEG", "application.JPEG")})
    good = paths[0].read_bytes()
    (tmp_path / "trailing.JPEG").write_bytes(good + bytes(9))
    halfway = (good.find(b"\xff\xda") + len(good)) // 2  # (within the scan's data, not after a 0xFF)
    halfway += good[halfway - 1] == 0xFF
    (tmp_path / "tables.JPEG").write_bytes(good[:halfway] + b"\xff\xc4\x00\x02" + good[halfway:])
    (tmp_path / "application.JPEG").write_bytes(good[:-2] + b"\xff\xe1\x00\x04ab" + good[-2:])
    whole_by_pil[tmp_path / "flat.JPEG"] = 2
    paths.append(tmp_path / "filled.JPEG")  # (0xFF fill bytes before the end marker: still one scan to its end)
    paths[-1].write_bytes(good[:-2] + b"\xff\xff" + good[-2:])
    Image.new("L", (21, 13), _SENTINEL["L"]).save(tmp_path / "flat.JPEG", quality=95)
    for path in paths + list(whole_by_pil):
        whole = default_loader(str(path))
        width, height = whole.size
        boxes = [(0, 0, width, height), (0, 0, width, 1), (width - 1, height - 1, width, height), (3, 5, 11, 7)]
        for _ in range(8):
            left, top = int(rng.integers(0, width)), int(rng.integers(0, height))
            boxes.append((left, top, int(rng.integers(left, width + 1)), int(rng.integers(top + 1, height + 1))))
        for box in boxes:
            asked.clear()
            crop = read_for_crop(str(path)).crop(box)
            assert crop.mode == "RGB" and crop.size == (box[2] - box[0], box[3] - box[1]), (path.name, box)
            assert np.array_equal(np.asarray(crop), np.asarray(whole.crop(box))), (path.name, box)
            if path in whole_by_pil:
                assert len(asked) == whole_by_pil[path] and asked[-1] == height, (path.name, box, asked)
            else:
                assert asked == [box[3]], (path.name, box, asked)  # one decoding, down to the box's bottom row


def test_a_training_jpeg_too_large_to_be_safe_is_refused_as_pil_refuses_it(tmp_path, monkeypatch, caplog):
    """read_for_crop checks an image's size as Image.open does: a warning past PIL's MAX_IMAGE_PIXELS, an error past
    twice that (a decompression bomb)."""
    from PIL import Image as PILImage
    from lion_vit.data.jpeg import read_for_crop
    path = tmp_path / "large.JPEG"
    Image.new("RGB", (40, 30)).save(path)
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 1000)
    with pytest.warns(PILImage.DecompressionBombWarning):
        read_for_crop(str(path))
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 500)
    with pytest.raises(PILImage.DecompressionBombError):
        read_for_crop(str(path))
    # in a dataset, by every loader, it is an unreadable file: training warns and reads the next file in its place,
    # evaluation leaves it out
    from lion_vit.data.datasets import image_folder
    from lion_vit.data.gpu import read_encoded
    folder = tmp_path / "data" / "train" / "class_0"
    folder.mkdir(parents=True)
    (folder / "0_large.JPEG").write_bytes(path.read_bytes())
    Image.new("RGB", (10, 20)).save(folder / "1_small.JPEG")
    for loader in (read_for_crop, None, read_encoded):
        with caplog.at_level("WARNING"):
            caplog.clear()
            image, label = image_folder(str(tmp_path / "data"), "train", loader=loader)[0]
        assert image.size == (10, 20) and label == 0, loader
        assert "unreadable image" in caplog.text and "0_large.JPEG (Image size (1200 pixels) exceeds" in caplog.text
        assert image_folder(str(tmp_path / "data"), "train", drop_unreadable=True, loader=loader)[0] == (None, -1)


def test_unreadable_training_files_are_skipped_as_imagefolders_loader_skips_them(tmp_path, caplog):
    """The DeiT recipe's training split (its JPEGs decoded by their crop) against the same dataset read through
    ImageFolder's loader: for the same seed the same images and labels, where the folder also holds two truncated
    JPEGs, one whose scan refers to a component the frame lacks (libjpeg stops before any row), two with a frame
    marker where the scan's data should run or after it (libjpeg fails only after the image's last row, below the
    crops' rows) and a file of garbage, and a PNG named .JPEG, which PIL reads. Each unreadable file is warned about
    and replaced by the next readable one, and its crop's draws are taken back, so the images after it are drawn
    for as ImageFolder's loader has them: timm's crop's draws (Python's random) and torchvision's (torch's)."""
    from torchvision.datasets.folder import default_loader
    from torchvision.transforms import Compose, PILToTensor, RandomResizedCrop
    from lion_vit.data import build_dataset, build_transform
    from lion_vit.data.jpeg import read_for_crop, read_rgb
    root = tmp_path / "data"
    paths = _jpeg_kinds(root / "train" / "class_0")
    good = paths[1].read_bytes()  # (not the PNG's image: a file read in place of another must show)
    bad = {"truncated": good[: len(good) * 2 // 3], "endless": good[:-30]}  # (all but the last rows' data)
    sos = good.find(b"\xff\xda")
    bad["component"] = good[: sos + 5] + b"\x09" + good[sos + 6:]
    late = len(good) - 2 - (len(good) - sos) // 8  # (in the last rows' data: few crops reach below it)
    late += good[late - 1] == 0xFF
    bad["frame"] = good[:late] + b"\xff\xc0\x00\x11" + good[late:]
    bad["frame_after"] = good[:-2] + b"\xff\xc0\x00\x11" + good[-2:]
    png = io.BytesIO()
    Image.open(paths[0]).save(png, "PNG")
    bad["png"] = png.getvalue()
    bad["garbage"] = b"\xff\xd8\xff" + bytes(range(256)) * 3
    (root / "train" / "class_1").mkdir()
    for name, data in bad.items():
        (root / "train" / "class_1" / f"{name}.JPEG").write_bytes(data)
    cfg = _deit_recipe(root, "img_size=24")
    transform = build_transform(cfg.data, cfg.aug, 24, train=True)
    new = build_dataset(cfg.data, "train", transform)
    old = build_dataset(cfg.data, "train", transform)
    old.loader = default_loader
    resized_first = build_transform(cfg.data, cfg.aug, 24, train=False)  # (evaluation's: resize, then crop)
    assert new.loader is read_for_crop and build_dataset(cfg.data, "train", resized_first).loader is read_rgb
    samples = []
    for dataset in (old, new):
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        samples.append([dataset[i] for _ in range(6) for i in range(len(dataset))])
    assert len(samples[0]) == 6 * (len(paths) + len(bad))
    for (old_image, old_target), (new_image, new_target) in zip(*samples):
        assert torch.equal(new_image, old_image) and new_target == old_target
    warned = {name for name in bad for record in caplog.records if f"{name}.JPEG" in record.getMessage()}
    assert warned == set(bad) - {"png"}  # (PIL reads a PNG whatever its name, through either loader)
    assert any("garbage.JPEG (not an image format PIL reads)" in record.getMessage() for record in caplog.records)
    torchvisions = Compose([RandomResizedCrop(24), PILToTensor()])  # (its crop draws from torch's generator)
    new.transform = old.transform = torchvisions
    assert build_dataset(cfg.data, "train", torchvisions).loader is read_for_crop
    for dataset in (old, new):
        torch.manual_seed(2)
        samples.append([dataset[i][0] for _ in range(3) for i in range(len(dataset))])
    assert all(torch.equal(new_image, old_image) for old_image, new_image in zip(*samples[2:]))

    def wrong(image):  # an error of the transform is not the file's
        raise ValueError("the transform's own error")
    new.transform = wrong
    with pytest.raises(ValueError, match="the transform's own error"):
        new[0]


def test_16_bit_greyscale_images_keep_their_top_8_bits(tmp_path):
    """PIL's convert("RGB") clips 16-bit greyscale (PNG, TIFF) at 255, so torchvision's loader turns such an image
    all but white; both loaders of an image folder (evaluation's and a training split's decoded on its crop) and
    data.decode=gpu's PIL fallback keep each value's top 8 bits, as PIL reads a 16-bit RGB PNG."""
    from lion_vit.data.datasets import image_folder
    from lion_vit.data.gpu import Decoder, read_encoded
    from lion_vit.data.jpeg import read_for_crop
    values = np.arange(0, 65536, 64, dtype=np.uint16).reshape(32, 32)
    expected = np.repeat((values >> 8).astype(np.uint8)[..., None], 3, axis=2)
    folder = tmp_path / "val" / "class_0"
    folder.mkdir(parents=True)
    Image.fromarray(values).save(folder / "deep.png")
    Image.fromarray(values).save(folder / "deep.tif")
    assert Image.open(folder / "deep.png").mode.startswith("I")  # (what PIL makes of it: no 8-bit mode)
    dataset = image_folder(str(tmp_path), "val")
    assert len(dataset) == 2
    for index in range(2):
        image, _ = dataset[index]
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), expected)
    assert np.array_equal(np.asarray(read_for_crop(str(folder / "deep.png"))), expected)
    (decoded,) = Decoder(torch.device("cpu"))([read_encoded(str(folder / "deep.png"))])
    assert np.array_equal(decoded.permute(1, 2, 0).numpy(), expected)
    # 8-bit images as before
    grey = Image.fromarray((values >> 8).astype(np.uint8))
    for image, name in ((grey, "grey.png"), (grey.convert("RGB"), "rgb.png")):
        image.save(folder / name)
        dataset = image_folder(str(tmp_path), "val")
        index = [Path(path).name for path, _ in dataset.samples].index(name)
        assert np.array_equal(np.asarray(dataset[index][0]), np.asarray(grey.convert("RGB")))


def test_a_training_split_of_no_readable_image_is_one_line_also_from_a_worker(tmp_path):
    """SafeImageFolder's UserError; raised in a DataLoader worker, torch re-raises it with the worker's traceback as
    its message, of which user_message (train.py's error line) keeps the line."""
    from lion_vit.data.datasets import image_folder
    from lion_vit.errors import UserError, user_message
    folder = tmp_path / "train" / "class_0"
    folder.mkdir(parents=True)
    for i in range(3):
        (folder / f"{i}.JPEG").write_bytes(b"not an image")
    dataset = image_folder(str(tmp_path), "train")
    line = rf"no readable image under {dataset.root}: every file failed to read \(the warnings name them\)"
    for workers in (0, 1):
        with pytest.raises(UserError) as raised:
            next(iter(torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=workers)))
        assert re.fullmatch(line, user_message(raised.value)), workers
        assert workers == 0 or "Traceback" in str(raised.value)  # (what torch makes of a worker's error)


def test_an_evaluation_batch_of_unreadable_images_only_passes_through_the_device_step(tmp_path):
    """A batch whose every image is unreadable has no rows; the device's normalisation takes it, and
    split_unreadable still names its images."""
    from omegaconf import OmegaConf
    from lion_vit.data import on_device
    from lion_vit.data.datasets import collate_dropping_unreadable, split_unreadable
    data = OmegaConf.create({"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]})
    batches = [collate_dropping_unreadable([(None, -3), (None, -8)]),
               collate_dropping_unreadable([(torch.zeros(3, 4, 4, dtype=torch.uint8), 1), (None, -6)])]
    (empty, targets), (images, more) = list(on_device(batches, data, None, torch.device("cpu")))
    _, labels, unreadable = split_unreadable(empty, targets)
    assert empty.shape[0] == 0 and labels.numel() == 0 and unreadable == [2, 7]
    images, labels, unreadable = split_unreadable(images, more)
    assert torch.equal(images, -torch.ones(1, 3, 4, 4)) and labels.tolist() == [1] and unreadable == [5]


class _Draws(torch.utils.data.Dataset):
    """Each sample: its index, a draw of Python's, NumPy's and torch's random state, and the process's id."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        import os
        return torch.tensor([index, random.random(), np.random.rand(), torch.rand(()).item(), os.getpid()],
                            dtype=torch.float64)


def test_persistent_workers_draw_as_fresh_workers_each_epoch():
    """The training loader keeps its workers across epochs and reseeds them at each epoch's first sample as
    DataLoader seeds workers it starts: its batches equal those of fresh workers each epoch (the loader before,
    and a run resumed at that epoch) in every random draw, epochs differ, and the main process's random state
    moves as it did."""
    from timm.utils import random_seed
    from lion_vit.data import build_loader

    def epochs(loader, first, count):
        batches, states = [], []
        for epoch in range(first, first + count):
            random_seed(100 + epoch)  # as the trainer does each epoch
            loader.sampler.set_epoch(epoch)
            batches.append(torch.cat(list(loader)))
            states.append(torch.rand(()).item())  # the main process's random state after the epoch
        return batches, states

    loader = build_loader(_Draws(), train=True, batch_size=4, num_workers=2, rank=0, world_size=1, seed=0)
    assert loader.persistent_workers
    kept, kept_states = epochs(loader, 0, 3)
    fresh, fresh_states = zip(*(epochs(torch.utils.data.DataLoader(
        _Draws(), batch_size=4, sampler=torch.utils.data.DistributedSampler(_Draws(), 1, 0, shuffle=True, seed=0),
        num_workers=2, drop_last=True), epoch, 1) for epoch in range(3)))
    resumed, _ = epochs(build_loader(_Draws(), train=True, batch_size=4, num_workers=2, rank=0, world_size=1,
                                     seed=0), 2, 1)
    for epoch in range(3):
        torch.testing.assert_close(kept[epoch][:, :4], fresh[epoch][0][:, :4], rtol=0, atol=0)
    torch.testing.assert_close(kept[2][:, :4], resumed[0][:, :4], rtol=0, atol=0)
    assert kept_states == [state for states in fresh_states for state in states]
    assert set(kept[0][:, 4].tolist()) == set(kept[2][:, 4].tolist())  # the same two workers
    assert not set(fresh[0][0][:, 4].tolist()) & set(fresh[2][0][:, 4].tolist())  # (fresh ones: others)
    assert not torch.equal(kept[0][:, 1:4], kept[1][:, 1:4])  # each epoch its own draws


def test_a_process_exits_with_a_loader_whose_workers_are_kept(tmp_path):
    """A persistent loader still alive at exit (a global, or a traceback's frame) does not hang the process: its
    workers ignore the SIGTERM that multiprocessing's exit ends them with, and are killed before it waits."""
    import os
    import subprocess
    import sys
    script = ("import torch\n"
              "from lion_vit.data import build_loader\n"
              "dataset = torch.utils.data.TensorDataset(torch.arange(16))\n"
              "loader = build_loader(dataset, train=True, batch_size=4, num_workers=2, rank=0, world_size=1, seed=0)\n"
              "print(len(list(loader)), 'batches')\n")
    # (TMPDIR: the killed workers' multiprocessing folders)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0 and proc.stdout == "4 batches\n", proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "killed by signal" not in proc.stderr, proc.stderr[-2000:]
