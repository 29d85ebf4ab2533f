"""Build datasets, timm transforms and (distributed / repeated-augmentation) loaders from config."""
from __future__ import annotations

import atexit
import multiprocessing
import os
import random
import signal
from typing import Any, Callable, Iterator, Optional, Tuple, Union

import numpy as np
import torch
from omegaconf import DictConfig
from timm.data import create_transform
from timm.data.loader import PrefetchLoader
from timm.data.distributed_sampler import RepeatAugSampler
from timm.data.transforms import RandomResizedCropAndInterpolation
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info
from torchvision.transforms import Compose, RandomResizedCrop

from ..errors import UserError
from .compat import patch_timm_posterize
from .datasets import cifar, collate_dropping_unreadable, digits, image_folder
from .gpu import DeviceDecodeLoader, DrawAugmentation, collate_samples, read_encoded
from .jpeg import read_for_crop

patch_timm_posterize()  # RandAugment on Pillow >= 13 (see compat.py)

KINDS = ("digits", "imagefolder", "imagenet", "cifar10", "cifar100")
DECODES = ("cpu", "gpu")  # data.decode: where training images are decoded and augmented (see gpu.py)


def decodes_on_device(data: DictConfig, train: bool) -> bool:
    """data.decode=gpu: the training split's JPEGs are decoded and augmented on the device (lion_vit.data.gpu);
    evaluation keeps the CPU path (a few percent of an epoch's images, and no random draws)."""
    return train and data.get("decode", "cpu") == "gpu"


def build_transform(data: DictConfig, aug: DictConfig, img_size: Union[int, Tuple[int, int]], train: bool) -> Callable:
    """timm's DeiT transforms for training with aug=deit, plain resize and crop otherwise, as timm builds them
    for its prefetching loader: they end in uint8 [3, H, W] tensors, a quarter of float32's bytes through
    the workers' shared memory, pinned memory and the copy to the device; `on_device` normalises there and
    draws the random erasing."""
    common = dict(input_size=img_size, interpolation=data.interpolation, mean=tuple(data.mean), std=tuple(data.std),
                  use_prefetcher=True)
    if train and aug.enabled:
        return create_transform(is_training=True, auto_augment=aug.auto_augment or None,
                                color_jitter=aug.color_jitter, hflip=aug.hflip, scale=tuple(aug.scale), **common)
    return create_transform(is_training=False, crop_pct=data.crop_pct, **common)


def on_device(loader: DataLoader, data: DictConfig, aug: Optional[DictConfig], device: torch.device
              ) -> Union[PrefetchLoader, DeviceDecodeLoader]:
    """timm's PrefetchLoader over a loader of build_transform's uint8 images: on the device it normalises them
    (data.mean / std) and, for training (aug given and enabled), draws DeiT's random erasing per image; on
    CUDA it copies the next batch on a side stream while the current one trains. With data.decode=gpu the
    training loader's files are decoded and augmented there first (DeviceDecodeLoader)."""
    erasing = dict(re_prob=aug.reprob, re_mode=aug.remode, re_count=aug.recount) if aug is not None and aug.enabled \
        else {}
    if decodes_on_device(data, aug is not None):
        return DeviceDecodeLoader(loader, device, mean=tuple(data.mean), std=tuple(data.std), **erasing)
    return PrefetchLoader(loader, mean=tuple(data.mean), std=tuple(data.std), device=device, **erasing)


def resolve_num_workers(num_workers: Union[int, str]) -> int:
    """num_workers=auto: the cores this process may run on. torchrun's LOCAL_WORLD_SIZE processes share the cores
    of the launcher's; a SLURM task has its own SLURM_CPUS_PER_TASK, which srun's binding often makes its whole
    affinity (dividing those by the node's tasks would leave one worker a GPU); without it, the node's tasks share."""
    if num_workers != "auto":
        return int(num_workers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not os.environ.get("LOCAL_WORLD_SIZE") and os.environ.get("SLURM_CPUS_PER_TASK"):
        return max(1, min(cores, int(os.environ["SLURM_CPUS_PER_TASK"])))
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    return max(1, cores // max(1, int(local)))


def build_dataset(data: DictConfig, split: str, transform: Optional[Callable]) -> Dataset:
    """split: "train" or "val"; with data.decode=gpu the training split yields each file's bytes and drawn
    augmentation (lion_vit.data.gpu) in place of an image."""
    kind, train = data.name, split == "train"
    encoded = decodes_on_device(data, train)
    if encoded:
        if kind not in ("imagefolder", "imagenet"):
            raise UserError(f"data.decode=gpu decodes JPEG files: it needs data=imagefolder or data=imagenet, not "
                            f"{kind}; set data.decode=cpu")
        transform = DrawAugmentation(transform)
    if kind == "digits":
        return digits(train, transform)
    if kind in KINDS and not data.root:
        raise UserError(f"data={kind} needs data.root, the folder that holds the dataset (see data/README.md)")
    if kind in ("cifar10", "cifar100"):
        return cifar(data.root, 10 if kind == "cifar10" else 100, train, transform, download=data.download)
    if kind in ("imagefolder", "imagenet"):
        loader = read_encoded if encoded else read_for_crop if train and crops_first(transform) else None
        return image_folder(data.root, data.train_split if train else data.val_split, transform,
                            drop_unreadable=not train, loader=loader)
    raise UserError(f"unknown data.name {kind!r}; choose one of {KINDS}")


def crops_first(transform: Optional[Callable]) -> bool:
    """Whether `transform` starts with a random resized crop (DeiT's training transform): then the training
    JPEGs are decoded only down to their crop's last row (jpeg.py)."""
    first = transform.transforms[0] if isinstance(transform, Compose) and transform.transforms else transform
    return isinstance(first, (RandomResizedCropAndInterpolation, RandomResizedCrop))


def num_classes_of(dataset: Dataset) -> int:
    return len(dataset.classes)


class ShardSampler(Sampler):
    """Evaluation sampler: rank r takes indices r, r + world, ... (no padding, no duplicates)."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, len(dataset), world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def build_loader(dataset: Dataset, *, train: bool, batch_size: int, num_workers: int, rank: int,
                 world_size: int, seed: int, repeated_aug: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 2, encoded: bool = False) -> DataLoader:
    """Training: shuffled per (seed, epoch) via `sampler.set_epoch`; repeated augmentation when asked.
    prefetch_factor: batches each worker prepares ahead (with workers); encoded: the dataset yields
    data.decode=gpu's samples (files and draws), batched as lists."""
    sampler: Any
    if not train:
        sampler = ShardSampler(dataset, rank, world_size)
    elif repeated_aug > 1:
        # timm keeps a multiple of 256 samples per epoch, which would be none of a tiny dataset
        round_to = 256 if len(dataset) >= 256 * world_size else 0
        sampler = SeededRepeatAugSampler(dataset, num_replicas=world_size, rank=rank, num_repeats=repeated_aug,
                                         selected_round=round_to, seed=seed)
    else:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    dropping = getattr(dataset, "drop_unreadable", False)  # an evaluation ImageFolder: see SafeImageFolder
    if train and num_workers:  # workers kept across epochs, reseeded at each epoch's first sample
        sampler, dataset = SeedPerEpoch(sampler), ReseededPerEpoch(dataset)
    if num_workers:
        _kill_workers_at_exit()
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, drop_last=train, persistent_workers=num_workers > 0,
                      prefetch_factor=prefetch_factor if num_workers else None,
                      collate_fn=collate_samples if encoded else collate_dropping_unreadable if dropping else None,
                      worker_init_fn=_leave_signals_to_the_main_process,
                      # (its own draw of the workers' seeds, made once for persistent workers, from a generator of
                      # its own: the main process's random stream stays that of fresh workers each epoch)
                      generator=torch.Generator() if num_workers else None)


class SeedPerEpoch(Sampler):
    """A training sampler whose indices carry the epoch's seed for the workers, drawn from the main process's
    random state as each epoch's iteration starts, as DataLoader draws it for workers it starts: persistent workers
    then augment as fresh ones would, and a resumed run (the main process reseeded per epoch) as an uninterrupted
    one. set_epoch and len reach the sampler it wraps."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Tuple[int, int]]:
        seed = torch.empty((), dtype=torch.int64).random_().item()  # (DataLoader's draw of a base seed)
        return ((seed, index) for index in self.sampler)


class ReseededPerEpoch(Dataset):
    """A training dataset read through SeedPerEpoch's (seed, index) keys: a worker reseeds Python's, NumPy's and
    torch's random state at the first sample of each epoch's seed, as DataLoader seeds a worker it starts."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.seeded: Optional[int] = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # (classes, samples, ...: the dataset's)
        if name in ("dataset", "seeded"):  # (not set yet while unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: Tuple[int, int]) -> Any:
        seed, index = key
        worker = get_worker_info()
        if worker is not None and seed != self.seeded:
            random.seed(seed + worker.id)
            torch.manual_seed(seed + worker.id)
            np.random.seed(_numpy_seed(seed, worker.id))
            self.seeded = seed
        return self.dataset[index]


def _numpy_seed(seed: int, worker_id: int) -> Any:
    """NumPy's seed of a worker, as DataLoader makes it (a private helper of torch's since 1.9)."""
    try:
        from torch.utils.data._utils.worker import _generate_state
    except ImportError:  # (a torch that moved it: a seed of the same inputs)
        return (seed + worker_id) % 2**32
    return _generate_state(seed, worker_id)


def _leave_signals_to_the_main_process(worker_id: int) -> None:
    """A terminal's Ctrl-C reaches the workers too, and so does a SIGTERM sent to the whole job (SLURM);
    a worker that exits on one makes the loader raise "DataLoader worker exited unexpectedly" in place of
    the main process's clean stop. The main process stops, and then shuts its workers down
    (_kill_workers_at_exit: those of a loader still alive at exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _kill_workers_at_exit() -> None:
    """Registers _kill_workers, once (any earlier registration is dropped), for the main process's exit.
    multiprocessing's own exit terminates the workers of loaders still alive then (a persistent loader held by a
    global or a traceback) with the SIGTERM they ignore, then waits for them forever; registered after it,
    _kill_workers runs before it."""
    atexit.unregister(_kill_workers)
    atexit.register(_kill_workers)


def _kill_workers() -> None:
    """Kill the daemonic children (the loaders' workers), as multiprocessing's exit would end them, without the
    DataLoader's SIGCHLD handler reporting them killed."""
    if hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


class SeededRepeatAugSampler(RepeatAugSampler):
    """timm's repeated-augmentation sampler (DeiT), with the order depending on seed and epoch."""

    def __init__(self, dataset: Dataset, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(self.seed * 100_003 + epoch)
