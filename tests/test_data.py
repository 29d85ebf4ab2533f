"""Datasets and transforms: image folders, CIFAR pickles, augmentation, classes that must match."""
from __future__ import annotations

import random

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
    root = make_cifar10(tmp_path)
    train, val = cifar(str(root), 10, train=True), cifar(str(root), 10, train=False)
    assert len(train) == 30 and len(val) == 6 and train.classes[3] == "c3"
    image, label = train[0]
    assert image.size == (32, 32) and 0 <= label < 10
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


def test_cifar_download_failure_is_one_line(tmp_path, monkeypatch):
    """data.download=true without a network says so and where to fetch the archive, not a urllib traceback."""
    import urllib.error
    import torchvision.datasets
    from lion_vit.data.datasets import cifar
    from lion_vit.errors import UserError

    def offline(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(torchvision.datasets.CIFAR100, "download", offline)
    with pytest.raises(UserError, match=r"could not download CIFAR-100 .*Name or service not known.*"
                                        r"fetch https://\S+cifar-100-python.tar.gz by hand"):
        cifar(str(tmp_path), 100, train=True, download=True)
