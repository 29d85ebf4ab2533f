"""torch.distributed setup from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or SLURM (SLURM_PROCID, ...)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist
from timm.utils import world_info_from_env


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


def _slurm_master() -> None:
    """MASTER_ADDR / MASTER_PORT of a SLURM job launched one task per GPU (e.g. via submitit): timm's
    world_info_from_env reads the ranks from SLURM's variables, but env:// also needs the first node."""
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()
        os.environ["MASTER_ADDR"] = hosts[0]
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group when launched by torchrun or SLURM (several tasks); NCCL on CUDA, gloo on CPU."""
    local_rank, rank, world_size = world_info_from_env()
    if world_size < 2:
        return DistInfo()
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        _slurm_master()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                rank=rank, world_size=world_size)
    return DistInfo(rank, world_size, local_rank)


def all_reduce_sum(values: List[float], device: torch.device) -> List[float]:
    """Sum a list of numbers over all ranks (identity when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


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
