"""Where a run reports: the console and rank 0's train.log (Python logging), and wandb."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf

from ..errors import UserError, first_line

def setup_logging(output_dir: Optional[Path], is_main: bool) -> None:
    """Console and (rank 0) train.log; "lion_vit.file" logs to train.log alone. Called again, it replaces the
    handlers (timm's setup_default_logging adds more, and rotates the log at 2 MB)."""
    handlers: list = [logging.StreamHandler(sys.stdout)]
    if output_dir is not None and is_main:
        handlers.append(logging.FileHandler(output_dir / "train.log"))
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    file_log = logging.getLogger("lion_vit.file")
    file_log.handlers = handlers[1:]
    file_log.propagate = False


class WandbLogger:
    """wandb on rank 0 only; mode=disabled makes every call a no-op. run_id: the resumed checkpoint's wandb
    run, continued so that a killed and resumed run keeps one set of curves."""

    def __init__(self, cfg: DictConfig, output_dir: Path, enabled: bool, run_id: Optional[str] = None) -> None:
        self.run = None
        if not enabled or cfg.logger.wandb.mode == "disabled":
            return
        import wandb
        wb = cfg.logger.wandb
        try:
            self.run = wandb.init(project=wb.project, entity=wb.entity, name=wb.name or output_dir.name,
                                  group=OmegaConf.select(wb, "group"),
                                  mode=wb.mode, tags=[str(tag) for tag in wb.tags], dir=str(output_dir),
                                  config=OmegaConf.to_container(cfg, resolve=True),
                                  id=run_id, resume="allow" if run_id else None,
                                  settings=wandb.Settings(quiet=True))  # the run's history stays in wandb
        except wandb.errors.Error as error:  # no API key, no network, an unknown project or entity
            if wb.mode == "offline":  # no account or server involved: a value wandb refuses (a project's name)
                raise UserError(f"wandb could not start in mode=offline ({first_line(error)}); change the "
                                f"logger.wandb setting it names") from None
            if isinstance(error, (wandb.errors.UsageError, wandb.errors.AuthenticationError)):
                fix = "run `wandb login` or set WANDB_API_KEY"
            else:  # the server out of reach (a compute node without internet) or refusing the project
                fix = "check that this machine reaches wandb's server and logger.wandb.project / entity"
            raise UserError(f"wandb could not start in mode={wb.mode} ({first_line(error)}); {fix}, or use "
                            f"logger.wandb.mode=offline (no account needed; `wandb sync` uploads the run later)"
                            ) from None

    @property
    def run_id(self) -> Optional[str]:
        return None if self.run is None else self.run.id

    def log(self, metrics: Dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
