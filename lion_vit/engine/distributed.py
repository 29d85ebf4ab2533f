"""torch.distributed from torchrun's or SLURM's environment (timm's init_distributed_device_so)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from timm.utils.distributed import init_distributed_device_so, is_distributed_env
from torch import Tensor

from ..data.gpu import host_to_device


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: torch.device) -> Tuple[DistInfo, torch.device]:
    """Join the process group when launched by torchrun or SLURM (NCCL on CUDA, gloo on CPU); returns this
    process's place in it and its device (the GPU of its local rank)."""
    if is_distributed_env() and "SLURM_PROCID" in os.environ and "MASTER_ADDR" not in os.environ:
        # one SLURM task per GPU (e.g. submitit): timm reads the ranks, but env:// also needs the first node
        hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()
        os.environ["MASTER_ADDR"] = hosts[0]
        os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))
    info = init_distributed_device_so(device.type)
    return DistInfo(info["global_rank"], info["world_size"], info["local_rank"]), torch.device(info["device"])


def queued_sum(values: List[float], device: torch.device) -> Optional[Tensor]:
    """A list of numbers summed over all ranks, float64 on `device` (the process group's), the all-reduce queued
    and not awaited: the host waits only where the sums are read; None when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    tensor = host_to_device(torch.tensor(values, dtype=torch.float64), device)
    dist.all_reduce(tensor)
    return tensor


def all_reduce_sum(values: List[float], device: torch.device) -> List[float]:
    """Sum a list of numbers over all ranks (identity when not distributed)."""
    summed = queued_sum(values, device)
    return list(values) if summed is None else summed.tolist()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's value of `obj` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
