"""torch.distributed from torchrun's or SLURM's environment (timm's init_distributed_device_so, DeiT's GPU choice)."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from timm.utils.distributed import is_distributed_env, world_info_from_env
from torch import Tensor

from ..data.gpu import host_to_device
from ..errors import UserError


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
    process's place in it and its device: the GPU of its local rank, or the one GPU a SLURM task bound to its
    own sees. (timm's init_distributed_device_so, which this follows, takes cuda:<local rank> even there.)"""
    if not is_distributed_env():
        return DistInfo(), torch.device(device.type)
    local_rank, rank, world_size = world_info_from_env()
    if "SLURM_PROCID" in os.environ:  # one SLURM task a GPU (e.g. submitit), as torchrun's variables
        os.environ.update(LOCAL_RANK=str(local_rank), RANK=str(rank), WORLD_SIZE=str(world_size))
        if "MASTER_ADDR" not in os.environ:  # env:// also needs the first node
            hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                                   capture_output=True, text=True, check=True).stdout.split()
            os.environ["MASTER_ADDR"] = hosts[0]
            os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))
    if device.type == "cuda":
        device = torch.device("cuda", _gpu_index(local_rank))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                            world_size=world_size, rank=rank)
    return DistInfo(rank, world_size, local_rank), device


def _gpu_index(local_rank: int) -> int:
    """The GPU of this process: its local rank's, or the only one a SLURM task sees (--gpus-per-task or --gpu-bind
    give each its own, as cuda:0). torchrun's processes all see the GPUs torchrun sees."""
    visible = torch.cuda.device_count()
    if local_rank < visible:
        return local_rank
    if visible == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        return 0
    raise UserError(f"the process of local rank {local_rank} sees {visible} GPU(s): launch at most {visible} "
                    f"process(es) a node (torchrun --nproc_per_node, the SLURM launcher's tasks_per_node), one a GPU")


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


def gather_to_main(items: List[Any]) -> Optional[List[Any]]:
    """On rank 0, every rank's list of (picklable) items in rank order; None on the others. Every rank must call
    it. Not distributed: the list itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(items)
    main = dist.get_rank() == 0
    lists: Optional[List[Any]] = [None] * dist.get_world_size() if main else None
    dist.gather_object(list(items), lists, dst=0)
    return [item for part in lists for item in part] if lists is not None else None


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
