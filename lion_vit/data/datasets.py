"""Datasets: embedded digits, CIFAR-10/100 (python-pickle archive), ImageNet / any ImageFolder.

Every dataset yields (PIL image, int label), so one set of timm transforms serves them all.
"""
from __future__ import annotations

import functools
import logging
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset, default_collate
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from ..errors import UserError
from .jpeg import PIL_ERRORS, DecodedOnCrop, UnreadableImage, read_rgb

log = logging.getLogger(__name__)


class ArrayImages(Dataset):
    """Images held in memory as a uint8 array [N, H, W] or [N, H, W, 3]."""

    def __init__(self, images: np.ndarray, labels: List[int], classes: List[str],
                 transform: Optional[Callable] = None) -> None:
        self.images, self.targets, self.classes, self.transform = images, list(labels), classes, transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> Tuple[Any, int]:
        image = Image.fromarray(self.images[index]).convert("RGB")
        return (self.transform(image) if self.transform else image), self.targets[index]


def digits(train: bool, transform: Optional[Callable] = None, val_fraction: float = 0.2) -> ArrayImages:
    """scikit-learn's 8x8 handwritten digits (1,797 images, shipped with the package).

    A fixed stratified split (seed 0) gives 1,437 training and 360 validation images.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = np.round(data.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 -> 0..255
    index = np.arange(len(images))
    train_idx, val_idx = train_test_split(index, test_size=val_fraction, random_state=0, stratify=data.target)
    chosen = train_idx if train else val_idx
    return ArrayImages(images[chosen], data.target[chosen].tolist(), [str(d) for d in range(10)], transform)


CIFAR_FOLDERS = {10: ("cifar-10-batches-py", "labels", "label_names"),
                 100: ("cifar-100-python", "fine_labels", "fine_label_names")}


def cifar(root: str, num_classes: int, train: bool, transform: Optional[Callable] = None,
          download: bool = False) -> ArrayImages:
    """CIFAR-10/100 from the standard python-pickle archive under `root` (downloaded only on request,
    by torchvision). Read here rather than by torchvision's CIFAR10/100, which md5-check every file on
    each construction and refuse any other content, such as the tests' small archives."""
    folder, label_key, names_key = CIFAR_FOLDERS[num_classes]
    base = Path(root) / folder
    if not base.is_dir() and download:
        from torchvision.datasets import CIFAR10, CIFAR100
        dataset = CIFAR10 if num_classes == 10 else CIFAR100
        missing = [folder for folder in (Path(root), *Path(root).parents) if not folder.exists()]
        try:
            dataset(root, train=train, download=True)
        except OSError as error:  # no network (URLError), a refused write, a truncated archive
            if missing:  # the folders the download made, and the part of the archive it wrote there
                shutil.rmtree(missing[-1], ignore_errors=True)
            reason = getattr(error, "reason", None) or error
            raise UserError(f"could not download CIFAR-{num_classes} into {root} ({reason}); fetch {dataset.url} "
                            f"by hand and extract it under data.root") from None
    if not base.is_dir():
        raise UserError(f"CIFAR-{num_classes} not found: expected the folder {_shown(base)} (the python version of "
                        f"the archive); set data.root to the folder holding it, or add data.download=true")
    if num_classes == 10:
        files = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        meta = "batches.meta"
    else:
        files, meta = (["train"] if train else ["test"]), "meta"
    images, labels = [], []
    for name in files:
        batch_images, batch_labels = _cifar_batch(base / name, label_key, num_classes)
        images.append(batch_images)
        labels.extend(batch_labels)
    names = _unpickle(base / meta).get(names_key)
    if not isinstance(names, list) or len(names) != num_classes:
        raise UserError(f"{base / meta} does not name CIFAR-{num_classes}'s {num_classes} classes under "
                        f"'{names_key}'; re-extract the archive")
    classes = [c.decode() if isinstance(c, bytes) else str(c) for c in names]
    return ArrayImages(np.concatenate(images), labels, classes, transform)


def _cifar_batch(path: Path, label_key: str, num_classes: int) -> Tuple[np.ndarray, List[int]]:
    """A batch file's images [N, 32, 32, 3] and labels; content of another shape is one line naming the file
    (else a reshape, a missing key or a label out of range fails later with a traceback)."""
    entry = _unpickle(path)
    data, labels = np.asarray(entry.get("data")), entry.get(label_key)
    problem = None
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        problem = "its 'data' is not rows of 3,072 bytes (uint8 [N, 3072])"
    elif not isinstance(labels, list) or len(labels) != len(data):
        problem = f"its '{label_key}' is not a list of {len(data)} labels, one per image"
    elif not all(isinstance(t, (int, np.integer)) and 0 <= t < num_classes for t in labels):
        problem = f"its '{label_key}' holds labels outside 0-{num_classes - 1}"
    if problem:
        raise UserError(f"{path} is not a CIFAR-{num_classes} batch: {problem}; re-extract the archive")
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), [int(t) for t in labels]


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        raise UserError(f"cannot read CIFAR file {path}: {error}; re-extract the archive") from None
    if not isinstance(entry, dict):
        raise UserError(f"CIFAR file {path} holds a {type(entry).__name__}, not a dict; re-extract the archive")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}


class SafeImageFolder(ImageFolder):
    """ImageFolder that does not crash on unreadable images.

    drop_unreadable=False (training): a bad file is replaced by the next readable one, deterministically,
    so that every batch keeps its size and every rank of a distributed run its step count (a resumed run
    matches too); each bad file is warned once per process. True (evaluation): a bad file yields
    (None, -(index + 1)), which collate_dropping_unreadable leaves out of the batch, so that it is never
    part of an accuracy and the caller can name it.
    """

    def __init__(self, root: str, transform: Optional[Callable] = None, drop_unreadable: bool = False,
                 loader: Optional[Callable[[str], Any]] = None) -> None:
        visible = functools.partial(_visible_image, len(os.path.join(os.path.expanduser(root), "")))
        super().__init__(root, transform=transform, is_valid_file=visible, loader=loader or read_rgb)
        self.drop_unreadable = drop_unreadable
        self._warned: set = set()

    def find_classes(self, directory: str) -> Tuple[List[str], Dict[str, int]]:
        """ImageFolder's classes, hidden folders left out: Jupyter's .ipynb_checkpoints, .git or a sync tool's
        folder is never a class, and as one it would shift every label and fail the check against val's classes
        (hidden files and folders within a class: _visible_image)."""
        classes, _ = super().find_classes(directory)
        classes = [name for name in classes if not _hidden(name)]
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: index for index, name in enumerate(classes)}

    def __getitem__(self, index: int) -> Tuple[Any, int]:
        for offset in range(len(self.samples)):
            path, target = self.samples[(index + offset) % len(self.samples)]
            try:
                return self._read(path), target
            except UnreadableImage as error:
                if self.drop_unreadable:
                    return None, -(index + 1)
                if path not in self._warned:
                    self._warned.add(path)
                    log.warning("unreadable image %s (%s): training on the next readable one in its place",
                                path, error)
        raise UserError(f"no readable image under {self.root}: every file failed to read (the warnings name them)")

    def _read(self, path: str) -> Any:
        """The file's image, transformed. Unreadable are the files the loader cannot read and those that an image
        decoded by its crop (jpeg.py) cannot; any other error of the transform is the transform's. The crop's
        draws of an unreadable file are taken back: the next file is drawn for as if read in its place."""
        try:
            image = self.loader(path)
        except PIL_ERRORS as error:
            raise UnreadableImage(str(error)) from error
        if self.transform is None:
            return image
        # (timm's crop draws from Python's random, torchvision's from torch's)
        draws = (random.getstate(), torch.get_rng_state()) if isinstance(image, DecodedOnCrop) else None
        try:
            return self.transform(image)
        except UnreadableImage:
            if draws is not None:
                random.setstate(draws[0])
                torch.set_rng_state(draws[1])
            raise


def _hidden(name: str) -> bool:
    """A hidden file or folder's name (.git, .ipynb_checkpoints, macOS's ._<name>): never a class or an image."""
    return name.startswith(".")


def _visible_image(start: int, path: str) -> bool:
    """ImageFolder's test of a file (an image extension), hidden files and folders left out: macOS's ._<name>
    copies of each image beside it are no images, and a hidden folder inside a class holds none of the class's.
    start: where the path below the split's folder begins (ImageFolder joins it to the folder as given)."""
    return has_file_allowed_extension(path, IMG_EXTENSIONS) and \
        not any(_hidden(part) for part in path[start:].split(os.sep))


def _shown(path: Path) -> str:
    """A path for an error line; a relative one (the configs' default roots) with where it was looked for."""
    return str(path) if path.is_absolute() else f"{path} (from {Path.cwd()}: {path.resolve()})"


def _missing_split(root: Path, path: Path) -> str:
    """Why root/<split> is not there, and the fix: a root that is missing, that is itself a split (its
    subfolders hold images), or whose splits have other names."""
    fix = "set data.root to a folder with train/ and val/ class subfolders (see data/README.md)"
    if not root.is_dir():
        return f"data.root {_shown(root)} does not exist; {fix}"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not _hidden(p.name))
    listed = ", ".join(f"{name}/" for name in folders[:6]) + (", ..." if len(folders) > 6 else "")
    if any(f.suffix.lower() in IMG_EXTENSIONS for name in folders[:3] for f in (root / name).iterdir() if f.is_file()):
        return (f"data.root {root} looks like one split: its subfolders ({listed}) hold images; set data.root to "
                f"the folder above, which holds train/ and val/ (see data/README.md)")
    if folders:
        return (f"data folder {path} does not exist; {root} holds {listed}: name its splits with "
                f"data.train_split=<folder> data.val_split=<folder>, or {fix}")
    return f"data folder {path} does not exist; {fix}"


def collate_dropping_unreadable(batch: List[Tuple[Any, int]]) -> Tuple[Tensor, Tensor]:
    """default_collate of the readable samples; the unreadable ones' -(index + 1) targets follow the
    readable targets (targets has more entries than images has rows: split_unreadable separates them)."""
    readable = [sample for sample in batch if sample[0] is not None]
    unreadable = [target for image, target in batch if image is None]
    if not readable:  # no rows, in the shape that a normalisation over 3 channels broadcasts over
        return torch.empty(0, 3, 1, 1, dtype=torch.uint8), torch.tensor(unreadable, dtype=torch.long)
    images, targets = default_collate(readable)
    return images, torch.cat([targets, torch.tensor(unreadable, dtype=targets.dtype)])


def split_unreadable(images: Tensor, targets: Tensor) -> Tuple[Tensor, Tensor, List[int]]:
    """A collate_dropping_unreadable batch -> images, their targets, and the unreadable samples' indices."""
    count = images.shape[0] if images.dim() > 1 else 0
    return images, targets[:count], [-int(t) - 1 for t in targets[count:]]


def image_folder(root: str, split: str, transform: Optional[Callable] = None,
                 drop_unreadable: bool = False, loader: Optional[Callable[[str], Any]] = None) -> SafeImageFolder:
    """`root/<split>/<class>/<image>` (ImageNet's standard layout); drop_unreadable: see SafeImageFolder;
    loader: a file's path to what the transform takes (default: jpeg.read_rgb, ImageFolder's with 16-bit
    greyscale read right)."""
    path = Path(root) / split
    if not path.is_dir():
        raise UserError(_missing_split(Path(root), path))
    try:
        return SafeImageFolder(str(path), transform=transform, drop_unreadable=drop_unreadable, loader=loader)
    except FileNotFoundError as error:
        flat = sum(1 for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMG_EXTENSIONS)
        if flat:  # ImageNet's validation archive unpacks flat
            raise UserError(f"{path} holds {flat} images but no class subfolders; sort them into one folder per "
                            f"class, as in train/ (see data/README.md)") from None
        raise UserError(f"no images found under {path}: {error}") from None
