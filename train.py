#!/usr/bin/env python
r"""Train or evaluate LION-ViT (or any timm model) with the DeiT recipe, configured by Hydra.

    python train.py                                            # quickstart: digits, CPU, 1-2 min
    python train.py experiment=cifar100 data.root=data/cifar
    torchrun --nproc_per_node=8 train.py experiment=deit_small_imagenet data.root=/datasets/imagenet \
        model.name=lion_d_natural_small
    python train.py eval_only=true checkpoint=outputs/run/checkpoint-best.pt model.attn_form=rnn img_size=448

Every setting is in configs/ (start at configs/config.yaml); bad input ends with one line on stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, NoReturn, Optional

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from timm.utils.distributed import is_distributed_env
from torch.distributed.elastic.multiprocessing.errors import record

from lion_vit.engine import interrupts, rundir
from lion_vit.engine.build import check_model_group, digits_groups_warning
from lion_vit.engine.checkpoint import LAST
from lion_vit.engine.config import check_setting, check_settings, composition_error
from lion_vit.engine.trainer import train
from lion_vit.errors import UserError, user_message


@dataclass
class LocalSweep:
    """The jobs of a sweep (-m) that Hydra's basic launcher runs one after another in this process."""
    jobs: int = 0
    refused: List[int] = field(default_factory=list)  # the numbers of the jobs that ended at an error line

    def summary(self) -> str:
        numbers = ", ".join(map(str, self.refused))
        if len(self.refused) == self.jobs:
            return "every job of the sweep ended at an error (the error lines above say why)"
        return (f"{self.jobs - len(self.refused)} of the sweep's {self.jobs} jobs ran to the end; "
                f"{'job' if len(self.refused) == 1 else 'jobs'} {numbers} ended at an error (the error lines above "
                f"say why)")


LOCAL_SWEEP = LocalSweep()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    job_dir = None  # a sweep job's folder, made by Hydra for this job just now
    # a local sweep goes on past a job refused for bad input, as Hydra's goes on past a failing job (and a SLURM
    # sweep's jobs fail alone); it exits 2 at the end. Not where every process of a torchrun runs the sweep: a
    # process that went on alone would wait for the others' next job, which they never reach
    multirun, launcher = hydra_cfg.mode == RunMode.MULTIRUN, str(hydra_cfg.launcher.get("_target_", ""))
    in_process = multirun and not is_distributed_env() and "BasicLauncher" in launcher
    LOCAL_SWEEP.jobs += in_process
    if multirun:
        output_dir = Path(hydra_cfg.runtime.output_dir)
        job_dir = output_dir if output_dir.is_dir() and not any(output_dir.iterdir()) else None
    signal.signal(signal.SIGTERM, interrupts.raise_terminated)  # SIGTERM stops the run as Ctrl-C does
    try:
        check_settings(cfg)  # (first: a ${...} that cannot be resolved is its one line, not this function's traceback)
        if multirun:
            # each job of a sweep (-m) in its own folder, Hydra's <sweep.dir = output_dir>/<job number>: jobs
            # running side by side (SLURM) must not overwrite, or resume=auto from, each other's checkpoints
            cfg.output_dir = hydra_cfg.runtime.output_dir
            # and in wandb, one group per sweep, a run per job named after both (unless set)
            wandb_cfg, sweep = cfg.logger.wandb, Path(hydra_cfg.sweep.dir).name
            wandb_cfg.group = wandb_cfg.group or sweep
            wandb_cfg.name = wandb_cfg.name or f"{sweep}/{hydra_cfg.job.num}"
            if "submitit" in launcher and cfg.resume is None:
                cfg.resume = "auto"  # SLURM requeues a preempted or timed-out job with the same command: continue it
        choices = hydra_cfg.runtime.choices
        check_model_group(choices.get("model"), cfg.model.name)
        task = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)  # (as typed: "a=${...}" unresolved)
        chosen = [arg.lstrip("+~").partition("=")[0] for arg in task]
        warning = digits_groups_warning(choices, chosen, cfg)
        metrics = train(cfg, [warning] if warning else [])
    except (KeyboardInterrupt, Exception) as error:
        # Ctrl-C or SIGTERM: say where the run stands instead of a traceback, also when a second signal,
        # raised at once wherever the run was, came out as another error (inside torch's C++ code, a
        # DataLoader worker); exit 128 + the signal's number, as the shell reports a signal
        if isinstance(error, KeyboardInterrupt) or interrupts.requested():
            terminated = isinstance(error, interrupts.Terminated) or interrupts.requested() == signal.SIGTERM
            if os.environ.get("RANK", "0") == "0":
                sweep_dir = Path(hydra_cfg.sweep.dir) if in_process else None
                print(_interrupted(cfg, "terminated" if terminated else "interrupted", sweep_dir), file=sys.stderr)
            sys.exit(128 + (signal.SIGTERM if terminated else signal.SIGINT))
        if isinstance(error, UserError):
            if job_dir is not None:  # a job failing before its first epoch leaves no folder, as a single run
                rundir.remove_if_unused(job_dir, up_to=job_dir)
            if not in_process:
                _exit_with_error(user_message(error))
            print(f"error: job {hydra_cfg.job.num}: {user_message(error)}", file=sys.stderr)
            LOCAL_SWEEP.refused.append(hydra_cfg.job.num)
            return float("nan")  # (what a Hydra sweeper that optimises takes for a failed trial)
        raise
    return metrics.get("val_acc1", metrics.get("acc1", 0.0))  # the value Hydra sweepers optimise


def _check_hydra_arguments(argv: list) -> None:
    """Before Hydra runs. hydra/launcher=slurm submits through SLURM's srun: without it, submitit's error would be
    a traceback from inside Hydra's sweep, before main() runs (and a multirun.yaml left in output_dir).
    hydra.run.dir, where Hydra apps usually write, would be made empty while the run went to output_dir."""
    launchers = [arg.split("=", 1)[1] for arg in argv if arg.lstrip("+~").startswith("hydra/launcher=")]
    if any("slurm" in launcher for launcher in launchers) and shutil.which("srun") is None:
        _exit_with_error("hydra/launcher=slurm submits jobs through SLURM, but srun is not on this machine's PATH; "
                         "run it on a SLURM login node, or without hydra/launcher=slurm (python train.py or torchrun)")
    if any(arg.lstrip("+~").startswith("hydra.run.dir=") for arg in argv):
        _exit_with_error("hydra.run.dir is not where train.py writes a run; pass output_dir=<folder> instead (with -m, "
                         "job k of the sweep writes to <output_dir>/k)")
    if {"-m", "--multirun"} & set(argv):  # output_dir is the sweep's folder, made and written before any job runs
        for arg in argv:
            if arg.lstrip("+").startswith("output_dir="):
                try:
                    check_setting("output_dir", arg.split("=", 1)[1])
                except UserError as error:
                    _exit_with_error(str(error))


def _exit_with_error(message: str) -> NoReturn:
    """Bad input: one `error:` line on stderr, exit status 2. Under torchrun the line also goes to the process's
    error file, which torchrun's report of the failed processes then shows as the root cause (without it, that
    report names only a link to its docs). Written by hand: torch's ErrorHandler.record_exception would put a
    traceback there."""
    line = f"error: {message}"
    print(line, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        except OSError:
            pass  # (the line is on stderr all the same)
    sys.exit(2)


def _interrupted(cfg: DictConfig, what: str, sweep_dir: Optional[Path] = None) -> str:
    """Where a run stands; in a local sweep (sweep_dir) also how to continue the jobs after this one."""
    if cfg.eval_only:
        return f"{what}: nothing was written"
    output_dir = Path(cfg.output_dir)
    again = (f"; the sweep's command with resume=auto output_dir={sweep_dir} continues the sweep (each job in its "
             f"folder, <job number>; a finished job trains nothing)") if sweep_dir is not None else ""
    if not (output_dir / LAST).exists():
        return f"{what} before the first epoch's checkpoint; nothing to resume in {output_dir}{again}"
    how = again or f"; continue with resume=auto output_dir={output_dir}"
    return f"{what}: {output_dir} holds the checkpoint of the last finished epoch{how}"


@record  # under torchrun a crash's traceback goes to the error file that torchrun's report shows
def _run_main() -> None:
    """main(), with Hydra's errors while it reads its flags or composes the config (a mistyped setting or config
    name, an override it cannot parse) as one line and exit 2, as for any bad setting; HYDRA_FULL_ERROR=1 shows
    Hydra's own report. Hydra raises them to its caller only under HYDRA_FULL_ERROR=1; errors of the run itself
    then end in a whole traceback, instead of one without Hydra's frames."""
    report = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException, yaml.YAMLError, ValueError) as error:  # (YAML: a file's syntax)
        composing = isinstance(error, (HydraException, OmegaConfBaseException, yaml.YAMLError))
        if report or _raised_in_the_run(error) or not (composing or _of_hydras_flags(error)):
            raise
        _exit_with_error(composition_error(error))
    if LOCAL_SWEEP.refused:
        print(LOCAL_SWEEP.summary(), file=sys.stderr)
        sys.exit(2)


def _of_hydras_flags(error: ValueError) -> bool:
    """Whether Hydra raised error itself, as it read its own flags (-m with --cfg, --resolve without --cfg, a file
    of --experimental-rerun that is not there), not main's body nor a callback of ours."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    return bool(frames) and frames[-1].f_globals.get("__name__", "").startswith("hydra.")


def _raised_in_the_run(error: BaseException) -> bool:
    """Whether the error came from main's body (a bug: its traceback is wanted), not from composing the config."""
    frames = traceback.walk_tb(error.__traceback__)
    return any(frame.f_code is main.__wrapped__.__code__ for frame, _ in frames)


if __name__ == "__main__":
    _check_hydra_arguments(sys.argv[1:])
    _run_main()
