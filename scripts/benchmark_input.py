#!/usr/bin/env python
r"""The training input pipeline alone, in images per second by number of DataLoader workers: train.py's
loader (uint8 images from the workers, normalised and randomly erased on the device) beside the path it
replaced (timm's transform normalising and erasing in the workers, float32 batches), in one run; and, as path
"loader", train.py's DataLoader alone: its uint8 batches as the workers hand them to a GPU, which normalises and
erases them there.

    python scripts/benchmark_input.py                          # 512 synthetic JPEGs, 0 to 2 workers
    python scripts/benchmark_input.py --images 2000 --workers 2 4 8 --batch-size 128

The images are a synthetic ImageFolder of JPEGs with ImageNet's size distribution (300-500 x 350-520 px,
quality 90, made once into --data; nothing is downloaded), read with the DeiT-S recipe of
`experiment=deit_small_imagenet` (RandomResizedCrop, RandAugment m9, random erasing 0.25, repeated
augmentation), as train.py builds it. Each configuration is timed --repeats times, round-robin over the
configurations, from its DataLoader's first batch to the last batch out (the workers' start-up left out); the
best run counts. Prints each rate and its ratio to the old path at the same number of workers, and writes
<out>/input.{csv,json}; each row names the PIL that ran (Pillow, or the drop-in Pillow-SIMD: docs/training.md).
The device here is the CPU: this process normalises and erases, its OpenMP threads waiting passively
(OMP_WAIT_POLICY=PASSIVE unless set) rather than spinning on the cores the workers need, as a GPU's work would
leave them; each row names the policy.

With --train MODEL ..., end to end instead (a GPU's measurement, as gpu_check.sh's `input` part runs it):
train.py trains each model for --epochs on the folder (plus a small val/ split) with the recipe and
num_workers=auto, eager and compiled (--compile), decoding in the workers or on the device (--decode:
data.decode=cpu or gpu), and its last epoch's images per second and share of time waiting for data are
set against the model-only rate of benchmark_train.py for the same model, batch, precision and compile,
measured in the same run; <out>/input_train.{csv,json}, written after each run. A run that fails is a row of
status error, its reason printed, the others still run, and the exit code is 1.

    python scripts/benchmark_input.py --device cuda --images 12000 --batch-size 256 \
        --train deit_small_patch16_224 lion_d_small --compile both --decode cpu gpu
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional

GIVEN_ENV = dict(os.environ)  # (--train: train.py and benchmark_train.py run with the environment as given)
if __name__ == "__main__":  # before torch loads OpenMP, which reads it once
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers (benchmarking.py)

from benchmarking import (STATUS_ERROR, STATUS_OK, HelpFormatter, device_name, failure_line,  # noqa: E402
                          markdown_table, non_negative_int, output_folder, positive_int, write_table)
from lion_vit.data import resolve_num_workers  # noqa: E402
from lion_vit.engine.allocator import keep_freed_memory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# where normalisation and erasing run: the old path (the workers), train.py's (the device, here the CPU), and
# train.py's workers alone (loader: what they deliver where the device is a GPU)
PATHS = ("workers", "device", "loader")


SYNTHETIC_FILE = re.compile(r"(train|val)/class_\d+/\d{6}\.JPEG")  # a path make_image_folder writes


def foreign_file(root: Path) -> Optional[Path]:
    """The first file under root that make_image_folder did not write (a dataset's, say), or None."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            if not SYNTHETIC_FILE.fullmatch(path.relative_to(root).as_posix()):
                return path
    return None


def make_image_folder(root: Path, count: int, classes: int = 10, val_per_class: int = 4) -> Path:
    """count JPEGs of ImageNet's sizes in root/train/<class>/, and val_per_class more per class in root/val/
    (kept: a folder already holding them is reused; one made for another count loses its other JPEGs); made by
    every core of the machine. root holds nothing else (foreign_file)."""
    classes = min(classes, count)  # every class in train/ too
    files = [root / "train" / f"class_{i % classes}" / f"{i:06d}.JPEG" for i in range(count)]
    files += [root / "val" / f"class_{c}" / f"{count + c * val_per_class + i:06d}.JPEG" for c in range(classes)
              for i in range(val_per_class)]
    present, wanted = set(root.glob("*/*/*.JPEG")), set(files)
    if present == wanted:
        return root
    for stale in present - wanted:
        stale.unlink()
    for folder in {stale.parent for stale in present - wanted}:
        if not any(folder.iterdir()):
            folder.rmdir()
    for file in files:
        file.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write_jpeg, files, chunksize=64))
    return root


def _write_jpeg(path: Path) -> None:
    """One JPEG of ImageNet's sizes (300-500 x 350-520 px, quality 90), seeded by its file name."""
    from PIL import Image
    rng = np.random.default_rng(int(path.stem))
    height, width = int(rng.integers(300, 501)), int(rng.integers(350, 521))
    # smooth colour fields with grain: JPEGs of a photo's size (about 30-60 KB), not of noise or of flat colour
    coarse = rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    image = np.clip(image + rng.integers(-12, 13, image.shape), 0, 255).astype(np.uint8)
    Image.fromarray(image).save(path, quality=90)


def recipe(data_root: Path, img_size: int, batch_size: int):
    """train.py's settings for the DeiT-S recipe on data_root (Hydra, as train.py composes them)."""
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("config", overrides=["experiment=deit_small_imagenet", f"data.root={data_root}",
                                            f"img_size={img_size}", f"batch_size={batch_size}"])


def workers_transform(cfg) -> Callable:
    """The path train.py took before: timm's DeiT transform normalising and erasing in the workers."""
    from timm.data import create_transform
    data, aug = cfg.data, cfg.aug
    return create_transform(input_size=cfg.img_size, is_training=True, auto_augment=aug.auto_augment or None,
                            color_jitter=aug.color_jitter, re_prob=aug.reprob, re_mode=aug.remode,
                            re_count=aug.recount, hflip=aug.hflip, scale=tuple(aug.scale),
                            interpolation=data.interpolation, mean=tuple(data.mean), std=tuple(data.std))


class FirstBatchClock:
    """A DataLoader noting when its first batch comes out. Both paths are timed from there: timm's
    PrefetchLoader hands out batch k only once k + 1 is loaded, and timed from the first batch it hands out,
    the device path would be credited with a batch made before the clock started."""

    def __init__(self, loader):
        self.loader, self.start = loader, None

    def __iter__(self):
        self.start = None
        for batch in self.loader:
            if self.start is None:
                self.start = time.perf_counter()
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


def loader(cfg, path: str, workers: int):
    """The training loader of one path, as train.py builds it (its sampler, repeated augmentation included),
    and the clock of its DataLoader."""
    from torchvision.datasets.folder import default_loader
    from lion_vit.data import build_dataset, build_loader, build_transform, on_device
    transform = workers_transform(cfg) if path == "workers" else build_transform(cfg.data, cfg.aug, cfg.img_size,
                                                                                 train=True)
    dataset = build_dataset(cfg.data, "train", transform)
    if path == "workers":  # (and ImageFolder's loader: PIL decodes each whole image, then the crop is taken)
        dataset.loader = default_loader
    clock = FirstBatchClock(build_loader(dataset, train=True, batch_size=cfg.batch_size, num_workers=workers,
                                         rank=0, world_size=1, seed=0, repeated_aug=cfg.aug.repeated_aug,
                                         prefetch_factor=cfg.prefetch_factor))
    return (on_device(clock, cfg.data, cfg.aug, torch.device("cpu")) if path == "device" else clock), clock


def images_per_second(batches, clock: FirstBatchClock, epoch: int) -> float:
    """One epoch of a loader: the images after the first batch per second after the DataLoader made it."""
    batches.sampler.set_epoch(epoch)
    torch.manual_seed(epoch)
    batches = iter(batches)
    next(batches, None)  # the first batch: the clock started as the DataLoader made it
    count = sum(images.shape[0] for images, _ in batches)
    return count / (time.perf_counter() - clock.start) if count else 0.0


def pillow() -> str:
    """The PIL that decodes and augments, as its distribution names it ("pillow-simd 12.1.1.post0"): a row's
    rate depends on it, and the drop-in fork installs under Pillow's module name."""
    import PIL
    from importlib.metadata import packages_distributions, version
    names = [name for name in packages_distributions().get("PIL", []) if version(name) == PIL.__version__]
    return f"{names[0] if names else 'pillow'} {PIL.__version__}"


def end_to_end(args, model: str, compile: bool, decode: str, model_only: Optional[float], out: Path) -> dict:
    """train.py on the folder (its last epoch, data.decode=decode) in a subprocess, against `model_only`,
    benchmark_train.py's images per second for the same model and compile (model_only_rate; None: it failed).
    A run that fails is a row of status error, its reason printed."""
    what = f"{model}{' compiled' if compile else ''}, decode {decode}"
    run = out / f"train_{model}{'_compiled' if compile else ''}_decode_{decode}"
    shutil.rmtree(run, ignore_errors=True)  # this script's run of an earlier call: train.py refuses a used folder
    recipe_args = [f"img_size={args.img_size}", f"batch_size={args.batch_size}", f"compile={str(compile).lower()}"]
    command = [sys.executable, str(ROOT / "train.py"), "experiment=deit_small_imagenet", f"data.root={args.data}",
               f"model.name={model}", f"epochs={args.epochs}", "num_workers=auto", "progress=false",
               f"data.decode={decode}", f"device={args.device}", f"output_dir={run}", "logger.wandb.mode=disabled",
               *recipe_args]
    row = dict(model=model, compile=compile, decode=decode, device=args.device, batch_size=args.batch_size,
               img_size=args.img_size, workers=resolve_num_workers("auto"), status=STATUS_OK)
    trained = subprocess.run(command, capture_output=True, text=True, env=GIVEN_ENV)
    if trained.returncode:
        print(f"{what}: train.py failed: {failure_line(trained)}", flush=True)
        return dict(row, status=STATUS_ERROR)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for checkpoint in run.glob("*.pt"):  # (only the metrics are read; a model's checkpoints take hundreds of MB)
        checkpoint.unlink()
    row.update(jpeg_decoder=jpeg_decoder_name(run), imgs_per_s=last["imgs_per_s"], model_only_imgs_per_s=model_only,
               x_model_only=last["imgs_per_s"] / model_only if model_only else None,
               data_wait_share=last["data_wait_share"])
    against = f"{model_only:.0f} model only (x{row['x_model_only']:.2f})" if model_only else "no model-only rate"
    print(f"{what}: {row['imgs_per_s']:.0f} images/s end to end, {against}, {100 * row['data_wait_share']:.0f} % "
          f"waiting for data", flush=True)
    return row


def jpeg_decoder_name(run: Path) -> Optional[str]:
    """The library whose JPEG decoder the train.py run in folder `run` decoded with (data.decode=gpu, its log says;
    None for data.decode=cpu)."""
    log = run / "train.log"
    said = re.search(r"decoded on \S+ by (\w+)'s decoder", log.read_text() if log.exists() else "")
    return said.group(1) if said else None


def model_only_rate(args, model: str, compile: bool, out: Path) -> Optional[float]:
    """benchmark_train.py's images per second for the model alone (same batch, size, precision and compile);
    None, its reason printed, where it fails."""
    only = out / f"model_only_{model}{'_compiled' if compile else ''}"
    command = [sys.executable, str(ROOT / "scripts" / "benchmark_train.py"), "--models", model, "--device",
               args.device, "--dtype", "bfloat16" if args.device == "cuda" else "float32", "--batch-size",
               str(args.batch_size), "--img-size", str(args.img_size), "--steps", str(args.steps), "--out", str(only)]
    measured = subprocess.run(command + ["--compile"] * compile, capture_output=True, text=True, env=GIVEN_ENV)
    if measured.returncode:
        print(f"{model}{' compiled' if compile else ''}: benchmark_train.py failed: {failure_line(measured)}",
              flush=True)
        return None
    with open(only / "train.csv") as f:
        return float(next(csv.DictReader(f))["imgs_per_s"])


def end_to_end_rows(args) -> List[dict]:
    """--train: every model, compile and decoding end to end, the table written after each (a run cut short
    keeps what finished); the script exits 1 at the end where any failed."""
    compiled = {"no": [False], "yes": [True], "both": [False, True]}[args.compile]
    model_only = {(model, compile): model_only_rate(args, model, compile, args.out)
                  for model in args.train for compile in compiled}  # once, whichever the decoding
    rows = []
    for decode in args.decode:
        for model in args.train:
            for compile in compiled:
                rows.append(end_to_end(args, model, compile, decode, model_only[model, compile], args.out))
                write_table(rows, args.out, "input_train")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--images", type=positive_int, default=512, help="synthetic JPEGs to make and read")
    parser.add_argument("--workers", type=non_negative_int, nargs="+", default=[0, 1, 2],
                        help="DataLoader workers (0: the main process)")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--img-size", type=positive_int, default=224)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed epochs per configuration")
    parser.add_argument("--data", type=output_folder, default="bench_out/input_images",
                        help="where the synthetic ImageFolder is made (kept for the next run); a folder of "
                             "other files (a dataset) is refused")
    parser.add_argument("--out", type=output_folder, default="bench_out", help="folder for the CSV and JSON")
    parser.add_argument("--train", nargs="+", metavar="MODEL", help="end to end: train.py on the folder against "
                        "benchmark_train.py, for these models (see above)")
    parser.add_argument("--compile", choices=["no", "yes", "both"], default="no", help="with --train")
    parser.add_argument("--decode", nargs="+", choices=["cpu", "gpu"], default=["cpu"],
                        help="with --train: data.decode, where the JPEGs are decoded and augmented")
    parser.add_argument("--epochs", type=positive_int, default=2, help="with --train: the last one is measured")
    parser.add_argument("--steps", type=positive_int, default=10, help="with --train: benchmark_train.py's steps")
    parser.add_argument("--device", default="cpu", type=device_name, help="with --train: cpu or cuda")
    args = parser.parse_args()
    if args.images < 2 * args.batch_size:
        parser.error(f"--images {args.images} makes fewer than two batches of --batch-size {args.batch_size}; "
                     f"time needs a batch after the first")

    stray = foreign_file(args.data)
    if stray is not None:
        parser.error(f"--data {args.data} holds {stray.relative_to(args.data)}, which this script did not make: it "
                     f"writes its synthetic JPEGs there (a dataset would gain their class folders); choose a new or "
                     f"empty folder")
    keep_freed_memory()  # as train.py on a CPU (cpu_keep_freed_memory): no page faults for each batch's tensors
    started = time.perf_counter()
    make_image_folder(args.data, args.images)
    print(f"{args.images} JPEGs in {args.data} ({time.perf_counter() - started:.1f} s)", flush=True)
    if args.train:
        args.data = args.data.resolve()
        rows = end_to_end_rows(args)
        print(markdown_table(rows, ["model", "compile", "decode", "jpeg_decoder", "workers", "status", "imgs_per_s",
                                    "model_only_imgs_per_s", "x_model_only", "data_wait_share"]))
        if any(row["status"] != STATUS_OK or row["model_only_imgs_per_s"] is None for row in rows):
            sys.exit("benchmark_input.py: some runs failed (above); the table holds what was measured")
        return
    cfg = recipe(args.data.resolve(), args.img_size, args.batch_size)
    pil, wait_policy = pillow(), os.environ.get("OMP_WAIT_POLICY", "")
    print(f"decoded and augmented by {pil}; OpenMP threads here wait: {wait_policy or 'as OpenMP does'}", flush=True)
    configs = [(path, workers) for workers in args.workers for path in PATHS]
    rates: Dict[tuple, List[float]] = {config: [] for config in configs}
    for repeat in range(args.repeats):  # round-robin: machine noise hits every configuration alike
        for path, workers in configs:
            rates[path, workers].append(images_per_second(*loader(cfg, path, workers), repeat))
            print(f"{path:8s} {workers} workers: {rates[path, workers][-1]:7.1f} images/s", flush=True)
    rows = []
    for path, workers in configs:
        best, old = max(rates[path, workers]), max(rates["workers", workers])
        rows.append(dict(path=path, workers=workers, batch_size=args.batch_size, img_size=args.img_size,
                         images=args.images, pillow=pil, omp_wait_policy=wait_policy, imgs_per_s=best,
                         x_workers_path=best / old if old else None))
    write_table(rows, args.out, "input")
    print(markdown_table(rows, ["path", "workers", "imgs_per_s", "x_workers_path"]))


if __name__ == "__main__":
    main()
