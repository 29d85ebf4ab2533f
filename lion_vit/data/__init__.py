"""Datasets, transforms and samplers for training and evaluation."""
from .build import (build_dataset, build_loader, build_transform, decodes_on_device, num_classes_of, on_device,
                    resolve_num_workers)

__all__ = ["build_dataset", "build_loader", "build_transform", "decodes_on_device", "num_classes_of", "on_device",
           "resolve_num_workers"]
