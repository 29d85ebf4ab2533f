"""torch.distributed setup from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or SLURM (SLURM_PROCID, ...)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist


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


def _slurm_env() -> None:
    """Translate SLURM's task variables into torchrun's (one task per GPU, e.g. via submitit)."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()
        os.environ["MASTER_ADDR"] = hosts[0]
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group when launched by torchrun / SLURM; NCCL on CUDA, gloo on CPU."""
    _slurm_env()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info


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
