"""train.py end to end on CPU with tiny generated data: one epoch, torchrun, resume, eval, errors."""
from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runs import (ENV, ROOT, SMALL_LION, assert_clean_error, assert_ok, make_cifar10, make_image_folder,
                  read_metrics, run_train)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("imgs"))


@pytest.fixture(scope="module")
def trained(folder, tmp_path_factory):
    """A 2-epoch LION-s run shared by the evaluation tests."""
    out = tmp_path_factory.mktemp("trained")
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=2", "batch_size=4",
                        "aug=none", f"output_dir={out}", "optim.lr=2e-3", "optim.lr_base_batch=null",
                        "optim.warmup_epochs=0"))
    return out


def test_one_epoch_lion_with_deit_recipe(folder, tmp_path):
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "aug=deit", "epochs=1",
                     "batch_size=4", f"output_dir={tmp_path}", "ema.enabled=true", "optim.clip_grad=1.0")
    assert_ok(proc)
    (line,) = read_metrics(tmp_path)
    assert set(line) >= {"epoch", "train_loss", "val_loss", "val_acc1", "val_acc5", "lr", "epoch_time_s",
                         "imgs_per_s", "val_acc1_ema"}
    assert (tmp_path / "config.yaml").read_text().count("lion_s_tiny") == 1
    state = torch.load(tmp_path / "checkpoint-last.pt", weights_only=True)  # tensors and plain data only
    assert {"model", "model_ema", "optimizer", "scheduler", "scaler", "epoch", "classes", "config"} <= set(state)
    assert (tmp_path / "checkpoint-best.pt").exists()
    assert "optim.warmup_epochs=5 is not below epochs=1: the learning rate never leaves warm-up" in proc.stdout
    assert line["epoch"] == 1 and state["best_epoch"] == 1
    assert proc.stdout.strip().splitlines()[-1].endswith(  # the run's closing line
        f"done: best top-1 {line['val_acc1']:.2f} % (epoch 1), last {line['val_acc1']:.2f} %; run folder "
        f"{tmp_path}, best checkpoint {tmp_path / 'checkpoint-best.pt'}")
    assert "wandb:" not in proc.stdout + proc.stderr  # (disabled in tests; online runs keep the history in wandb)


def test_one_epoch_deit_baseline(folder, tmp_path):
    proc = run_train("model=deit", "model.name=deit_tiny_patch16_224", "model.patch_size=8", "img_size=32",
                     "+model.kwargs.depth=2", "optim=adamw", "progress=false", "data=imagefolder",
                     f"data.root={folder}", "epochs=1", "batch_size=4", "aug=none", f"output_dir={tmp_path}")
    assert_ok(proc)
    assert len(read_metrics(tmp_path)) == 1


def test_torchrun_two_processes_gloo(folder, tmp_path):
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py")
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4",
                     "aug=none", f"output_dir={tmp_path}", launcher=launcher)
    assert_ok(proc)
    (line,) = read_metrics(tmp_path)  # rank 0 writes once
    state = torch.load(tmp_path / "checkpoint-last.pt", weights_only=True)
    assert state["epoch"] == 0
    # 24 training images, 2 processes x batch 4, drop_last: 3 steps x 8 images seen per epoch
    assert line["imgs_per_s"] > 0 and 0 <= line["val_acc1"] <= 100


def test_sweep_jobs_get_their_own_output_dirs(folder, tmp_path):
    """hydra -m: one output_dir and resume=auto for the sweep, a folder per job, never shared."""
    proc = run_train("-m", *SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4",
                     "aug=none", f"output_dir={tmp_path}", "resume=auto", "seed=0,1")
    assert_ok(proc)
    first, second = (torch.load(tmp_path / str(job) / "checkpoint-last.pt") for job in (0, 1))
    assert (first["config"]["seed"], second["config"]["seed"]) == (0, 1)
    assert first["epoch"] == second["epoch"] == 0  # job 1 trained; it did not resume from job 0's checkpoint
    assert len(read_metrics(tmp_path / "1")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "multirun.yaml"]  # Hydra's sweep record
    # in wandb: one group per sweep, runs named after it and the job
    assert [(c["config"]["logger"]["wandb"]["group"], c["config"]["logger"]["wandb"]["name"]) for c in (first, second)] \
        == [(tmp_path.name, f"{tmp_path.name}/0"), (tmp_path.name, f"{tmp_path.name}/1")]


def test_kill_and_resume_equals_uninterrupted(folder, tmp_path):
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=3", "batch_size=4", "aug=deit"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_ok(run_train(*args, f"output_dir={straight}"))

    proc = subprocess.Popen([sys.executable, "train.py", *args, f"output_dir={resumed}"], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    metrics = resumed / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    epochs_done = metrics.read_text().count("\n")
    assert 1 <= epochs_done < 3, "the run must be killed part-way"
    assert_ok(run_train(*args, f"output_dir={resumed}", "resume=auto"))

    a = torch.load(straight / "checkpoint-last.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint-last.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert [m["train_loss"] for m in read_metrics(straight)] == [m["train_loss"] for m in read_metrics(resumed)][-3:]


def test_ctrl_c_says_how_to_continue(folder, tmp_path):
    """Ctrl-C (SIGINT) ends the run with exit status 130 and one line saying where it stands, not a
    KeyboardInterrupt traceback; resume=auto then continues it."""
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none",
            f"output_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "epochs=50"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    deadline = time.time() + 240
    # the first epoch's checkpoint (renamed into place after its metrics line and an fsync of each)
    checkpoint = tmp_path / "checkpoint-last.pt"
    while time.time() < deadline and not checkpoint.exists():
        time.sleep(0.02)
    time.sleep(0.3)  # into the next epoch
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert f"interrupted: {tmp_path} holds the checkpoint of the last finished epoch; continue with resume=auto" \
        in stderr
    done = len(read_metrics(tmp_path))
    assert_ok(run_train(*args, f"epochs={done + 1}", "resume=auto"))
    assert [m["epoch"] for m in read_metrics(tmp_path)] == list(range(1, done + 2))  # counted from 1


def test_ctrl_c_in_a_terminal_with_loader_workers_stops_cleanly(folder, tmp_path):
    """A terminal's Ctrl-C reaches the whole process group, DataLoader workers included. The run
    stops before its next step, with exit status 130 and its one line: no worker traceback, no
    "DataLoader worker exited unexpectedly", no KeyboardInterrupt dropped in a fork callback (which
    let training go on)."""
    args = [*[a for a in SMALL_LION if a != "num_workers=0"], "num_workers=2", "data=imagefolder",
            f"data.root={folder}", "batch_size=4", "aug=none", f"output_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "epochs=50"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own process group
    deadline = time.time() + 240
    while time.time() < deadline and not (tmp_path / "checkpoint-last.pt").exists():
        time.sleep(0.02)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert not re.search(r"Traceback|Exception ignored|exited unexpectedly", stderr), stderr[-2000:]
    assert "interrupt: stopping before the next step (press Ctrl-C again to stop at once)" in stderr
    assert f"interrupted: {tmp_path} holds the checkpoint of the last finished epoch" in stderr


def test_ctrl_c_during_an_epochs_evaluation_keeps_the_epoch(folder, tmp_path):
    """A Ctrl-C while an epoch is evaluated (its model, then its EMA) lets the evaluation finish and
    the epoch's checkpoint be written, then stops before the next training step: the epoch's training
    is not thrown away for the sake of a few seconds of evaluation. train.py runs as a terminal starts
    it, with the first evaluation sending the Ctrl-C."""
    interrupt_in_first_eval = (
        "import os, runpy, signal, sys\n"
        "import lion_vit.engine.trainer as trainer\n"
        "evaluate, calls = trainer.evaluate, []\n"
        "def interrupted(*args, **kwargs):\n"
        "    if not calls:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    calls.append(1)\n"
        "    print('evaluation', len(calls), file=sys.stderr)\n"
        "    return evaluate(*args, **kwargs)\n"
        "trainer.evaluate = interrupted\n"
        "sys.argv = ['train.py', *sys.argv[1:]]\n"
        "runpy.run_path('train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", interrupt_in_first_eval, *SMALL_LION, "data=imagefolder",
                           f"data.root={folder}", "batch_size=4", "aug=none", "ema.enabled=true", "epochs=5",
                           f"output_dir={tmp_path}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "evaluation 2" in proc.stderr and "evaluation 3" not in proc.stderr  # model and EMA, then stopped
    assert f"interrupted: {tmp_path} holds the checkpoint of the last finished epoch" in proc.stderr
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [1]  # counted from 1 (the checkpoint's epoch index stays 0-based, as DeiT's)
    assert torch.load(tmp_path / "checkpoint-last.pt")["epoch"] == 0


def test_first_ctrl_c_stops_before_the_next_step_and_a_second_at_once():
    """While training, a Ctrl-C raised wherever the main thread is can be lost or turned into another
    error; the first one is only noted, and the loop stops before its next step."""
    from lion_vit.engine import interrupts
    from lion_vit.engine.loop import Precision, evaluate
    calls = []

    class InterruptedInItsFirstStep(torch.nn.Module):
        def forward(self, x):
            if not calls:
                os.kill(os.getpid(), signal.SIGINT)
            calls.append(len(x))  # (Python's default handler raises before this line)
            return torch.zeros(len(x), 3)

    batches = [(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))] * 3
    with interrupts.stop_between_steps(announce=False):
        with pytest.raises(KeyboardInterrupt):
            evaluate(InterruptedInItsFirstStep(), batches, torch.device("cpu"), Precision(torch.device("cpu")),
                     show_progress=False)
        assert calls == [2] and interrupts.requested()  # the first step finished; the second did not start
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: at once, for a step that hangs
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert interrupts.requested()  # for train.py, which reports an error after a Ctrl-C as the interrupt
    evaluate(InterruptedInItsFirstStep(), batches, torch.device("cpu"), Precision(torch.device("cpu")),
             show_progress=False)  # outside the block, a Ctrl-C noted earlier stops nothing
    assert calls == [2, 2, 2, 2]
    with interrupts.stop_between_steps(announce=False):
        assert not interrupts.requested()  # each run starts afresh
        interrupts.raise_if_requested()


def _count_steps_until_stopped(rank: int, port: int, out: Path) -> None:
    """One rank of a two-process gloo group taking up to 5 steps; only rank 1 sees a Ctrl-C, in step 2."""
    import torch.distributed as dist
    from lion_vit.engine import interrupts
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    steps = 0
    try:
        with interrupts.stop_between_steps(announce=False):
            for step in range(5):
                interrupts.raise_if_requested(agree_on=torch.device("cpu"))
                if rank == 1 and step == 2:
                    os.kill(os.getpid(), signal.SIGINT)
                steps += 1
    except KeyboardInterrupt:
        (out / f"rank{rank}").write_text(str(steps))
    dist.destroy_process_group()


def test_distributed_ranks_stop_before_the_same_step(tmp_path):
    """A rank that stopped alone would leave its peers waiting in the next collective (DDP's gradient
    all-reduce) for good: the ranks agree, so one rank's Ctrl-C stops every rank before the same step."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    mp.spawn(_count_steps_until_stopped, args=(port, tmp_path), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["3", "3"]


def test_deferred_ctrl_c_goes_to_the_handler_it_was_meant_for():
    from lion_vit.engine import interrupts
    with interrupts.stop_between_steps(announce=False):
        with interrupts.deferred(), interrupts.deferred():  # nested: passed outwards, then noted
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert not interrupts.requested()
        assert interrupts.requested()
    with pytest.raises(KeyboardInterrupt):  # under Python's default handler: raised when the block ends
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            finished = True
    assert finished


def test_eval_only_same_accuracy_in_every_form(trained, folder, tmp_path):
    """One Hydra sweep (-m, as the README shows) over the forms: each job writes <output_dir>/<job>/eval.json."""
    forms = ["attention", "rnn", "chunk"]
    assert_ok(run_train("-m", *SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true",
                        f"checkpoint={trained / 'checkpoint-last.pt'}", f"model.attn_form={','.join(forms)}",
                        "model.chunk_size=3", f"output_dir={tmp_path}"))
    results = {}
    for job in range(len(forms)):
        result = json.loads((tmp_path / str(job) / "eval.json").read_text())
        assert set(result) >= {"acc1", "acc5", "loss", "attn_form", "chunk_size", "img_size", "num_images",
                               "model", "checkpoint", "weights"}
        assert result["num_images"] == 12
        results[result["attn_form"]] = result
    assert sorted(results) == sorted(forms)
    assert [results[form]["chunk_size"] for form in forms] == [None, None, 3]  # only the chunk form has one
    assert results["attention"]["acc1"] == results["rnn"]["acc1"] == results["chunk"]["acc1"]
    assert abs(results["attention"]["loss"] - results["rnn"]["loss"]) < 1e-4
    assert abs(results["attention"]["loss"] - results["chunk"]["loss"]) < 1e-4
    final_val = read_metrics(trained)[-1]
    assert abs(results["attention"]["acc1"] - final_val["val_acc1"]) < 1e-6


def test_eval_only_at_higher_resolution(trained, folder, tmp_path):
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true", "img_size=64",
                     f"checkpoint={trained / 'checkpoint-best.pt'}", "model.attn_form=chunk",
                     "model.chunk_size=16", f"output_dir={tmp_path}")
    assert_ok(proc)
    assert proc.stdout.strip().splitlines()[-1].endswith(f"wrote {tmp_path / 'eval.json'}")
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["img_size"] == 64 and result["chunk_size"] == 16


def test_eval_only_takes_the_architecture_from_the_checkpoint(trained, folder, tmp_path):
    """The README's eval command names no architecture: here the default model group (digits), whose
    kwargs (embed_dim 64, depth 4, ...) differ from the checkpoint's (lion_s_tiny, depth 2)."""
    assert_ok(run_train("data=imagefolder", f"data.root={folder}", "eval_only=true", "img_size=32", "progress=false",
                        f"checkpoint={trained / 'checkpoint-best.pt'}", f"output_dir={tmp_path}"))
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["model"] == "lion_s_tiny" and result["num_images"] == 12
    trained_acc1 = max(m["val_acc1"] for m in read_metrics(trained))  # checkpoint-best
    assert result["acc1"] == pytest.approx(trained_acc1)


def test_val_classes_must_match(trained, folder, tmp_path):
    """A class folder missing from val would shift every later label silently: training and eval_only refuse."""
    import shutil
    partial = shutil.copytree(folder, tmp_path / "partial")
    shutil.rmtree(partial / "val" / "class_1")
    assert_clean_error(run_train(*SMALL_LION, "data=imagefolder", f"data.root={partial}", "epochs=1",
                                 f"output_dir={tmp_path / 'fit'}"),
                       "validation split has 2 classes, not the 3 expected", "missing ['class_1']")
    assert_clean_error(run_train(*SMALL_LION, "data=imagefolder", f"data.root={partial}", "eval_only=true",
                                 f"checkpoint={trained / 'checkpoint-best.pt'}", f"output_dir={tmp_path / 'eval'}"),
                       "has 2 classes, not the 3 expected", "classes the checkpoint was trained on")
    assert torch.load(trained / "checkpoint-best.pt")["classes"] == \
        ["class_0", "class_1", "class_2"]


def test_bad_inputs_give_one_clear_line(folder, tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"this is not a checkpoint")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cases = [
        (("data=imagefolder", f"data.root={tmp_path / 'nowhere'}", "epochs=1"), ("does not exist", "data.root")),
        (("model.name=lion_x_huge", "epochs=1"), ("unknown model",)),
        (("img_size=30", "epochs=1"), ("not divisible",)),
        (("model.attn_form=softmax", "epochs=1"), ("attn_form",)),
        (("eval_only=true", f"checkpoint={corrupt}"), ("corrupt",)),
        (("eval_only=true", f"checkpoint={tmp_path / 'missing.pt'}"), ("does not exist",)),
        (("batch_size=0",), ("batch_size=0", "positive integer")),
        (("optim.lr=-1",), ("optim.lr=-1", "positive number")),
        (("model.name=resnet18",), ("cannot build model resnet18", "unexpected keyword argument 'depth'",
                                    "start from model=lion or model=deit")),
        (("data=imagefolder", "data.root=null", "epochs=1"), ("data=imagefolder needs data.root",)),
        ((f"output_dir={a_file}",), ("cannot create output_dir", "File exists")),
    ]
    # independent processes, mostly Python start-up and imports: run side by side
    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = list(pool.map(lambda case: run_train(*SMALL_LION, *case[0]), cases))
    for (overrides, needles), proc in zip(cases, procs):
        assert_clean_error(proc, *needles)


@pytest.mark.parametrize("override, needle", [
    ("epochs=0", "epochs"), ("epochs=2.5", "epochs"), ("img_size=abc", "img_size"), ("num_workers=-1", "num_workers"),
    ("optim.clip_grad=0", "optim.clip_grad"), ("optim.clip_grad=abc", "optim.clip_grad"),
    ("optim.warmup_epochs=-1", "optim.warmup_epochs"), ("ema.decay=1.5", "ema.decay"),
    ("logger.wandb.mode=onlin", "logger.wandb.mode"), ("compile=ture", "compile"), ("ema.enabled=yes", "ema.enabled"),
    ("seed=abc", "seed"), ("seed=-1", "seed"), ("amp_dtype=float8", "amp_dtype"), ("optim.opt=lamb2", "optim.opt"),
    ("optim.sched=cosin", "optim.sched"), ("optim.sched=plateau", "optim.sched"), ("model.name=null", "model.name"),
    ("data.crop_pct=0", "data.crop_pct"), ("optim.weight_decay=abc", "optim.weight_decay"),
    ("optim.betas=[0.9]", "optim.betas"), ("optim.eps=0", "optim.eps"), ("optim.min_lr=-1", "optim.min_lr"),
    ("aug.mixup=-1", "aug.mixup"), ("aug.mixup_prob=2", "aug.mixup_prob"), ("aug.mixup_mode=elements", "aug.mixup_mode"),
    ("aug.smoothing=1.5", "aug.smoothing"), ("aug.reprob=2", "aug.reprob"), ("aug.scale=[1.0]", "aug.scale"),
    ("aug.scale=[0.9,0.1]", "aug.scale"), ("aug.repeated_aug=-1", "aug.repeated_aug"),
    # timm asserts on an unknown policy or option, and skips an option without a number
    ("aug.auto_augment=xyz", "aug.auto_augment"), ("aug.auto_augment=rand-m9-foo7", "aug.auto_augment"),
    ("aug.auto_augment=rand-mfoo", "aug.auto_augment"), ("aug.auto_augment=augmix-m5-z2", "aug.auto_augment"),
])
def test_settings_out_of_range_are_named(override, needle):
    """Checked before anything is built: timm, torch and the DataLoader would fail deep inside instead."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.trainer import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        check_settings(compose("config", overrides=["ema.enabled=true"]))  # the defaults pass
        check_settings(compose("config", overrides=["optim.opt=AdamW"]))  # timm's spellings pass
        check_settings(compose("config", overrides=["optim.opt=lookahead_lamb"]))
        cfg = compose("config", overrides=["ema.enabled=true", override])
    with pytest.raises(UserError, match=f"^{re.escape(override.split('=')[0])}=.* is not allowed; set {needle} to"):
        check_settings(cfg)


def test_timm_auto_augment_policies_pass_the_setting_checks():
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.trainer import check_settings
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for policy in ("rand-m9-mstd0.5-inc1", "rand-m9-n3-mstd1-tweights", "augmix-m5-w3-d2", "original-mstd0.5", "3a",
                       "null"):
            check_settings(compose("config", overrides=["aug=deit", f"aug.auto_augment={policy}"]))


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml")))
def test_every_experiment_passes_the_setting_checks(experiment):
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.trainer import check_settings
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for model in ("lion", "deit"):
            check_settings(compose("config", overrides=[f"experiment={experiment}", f"model={model}"]))


def test_slurm_launcher_config_fits_the_plugin_schema():
    """hydra/launcher=slurm holds only deltas to hydra-submitit-launcher's own config (a full copy of it
    broke when the plugin's schema changed). Runs where the plugin (the [slurm] extra) is installed."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node, launcher.max_num_timeout) == (2, 8, 8, 3)


def test_odd_batch_with_mixup_is_named():
    """timm's Mixup pairs each image with its mirror in the batch and asserts on an odd batch in the first step."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.trainer import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        check_settings(compose("config", overrides=["batch_size=33"]))  # digits: no mixup, any batch
        check_settings(compose("config", overrides=["aug=deit", "batch_size=34"]))
        check_settings(compose("config", overrides=["aug=deit", "batch_size=33", "aug.mixup=0", "aug.cutmix=0"]))
        odd = compose("config", overrides=["aug=deit", "batch_size=33"])
    with pytest.raises(UserError, match=r"^batch_size=33 is not allowed; set batch_size to an even number .*aug.mixup=0"):
        check_settings(odd)


def test_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    """logger.wandb.mode=online without an account names the fixes instead of wandb's traceback."""
    import wandb
    from omegaconf import OmegaConf
    from lion_vit.engine.trainer import WandbLogger
    from lion_vit.errors import UserError

    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    cfg = OmegaConf.create({"logger": {"wandb": {"mode": "online", "project": "p", "entity": None, "name": None,
                                                 "tags": []}}})
    with pytest.raises(UserError, match=r"wandb could not start in mode=online \(No API key configured.*\); "
                                        r"run `wandb login`.*logger.wandb.mode=offline"):
        WandbLogger(cfg, tmp_path, enabled=True)


def test_resumed_run_continues_its_wandb_run(folder, tmp_path):
    """Offline wandb (no account, no network): the resumed run logs to the run id of the first part."""
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none",
            f"output_dir={tmp_path}", "logger.wandb.mode=offline"]
    assert_ok(run_train(*args, "epochs=1"))
    first_id = torch.load(tmp_path / "checkpoint-last.pt")["wandb_run_id"]
    assert_ok(run_train(*args, "epochs=2", "resume=auto"))
    assert torch.load(tmp_path / "checkpoint-last.pt")["wandb_run_id"] == first_id
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith(f"-{first_id}") for run in runs), runs


def test_configure_cuda_sets_the_timm_defaults():
    from lion_vit.engine.trainer import configure_cuda
    saved = (torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        for tf32 in (True, False):
            configure_cuda(tf32)
            assert torch.backends.cudnn.benchmark
            assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_out_of_memory_becomes_one_line():
    """An allocation failure (CPU allocator or CUDA) is reported with its size and what to lower."""
    from omegaconf import OmegaConf
    from lion_vit.engine.trainer import _out_of_memory
    cfg = OmegaConf.create({"img_size": 230, "batch_size": 64})
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 179098240000 bytes. Error code 12 (Cannot allocate memory)")
    message = str(_out_of_memory(cpu, cfg))
    assert message.startswith("out of memory at img_size 230, batch_size 64") and "179.1 GB requested" in message
    assert "lower batch_size or img_size" in message and "\n" not in message
    cuda = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has ...")
    assert "(20.00 GiB requested)" in str(_out_of_memory(cuda, cfg))
    assert _out_of_memory(RuntimeError("shape mismatch"), cfg) is None


def test_existing_run_is_not_overwritten(trained):
    before = (trained / "checkpoint-last.pt").read_bytes()
    proc = run_train(*SMALL_LION, "epochs=1", f"output_dir={trained}")
    assert_clean_error(proc, "resume=auto")
    assert (trained / "checkpoint-last.pt").read_bytes() == before


def test_resume_of_a_finished_run_says_so(trained, folder, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=2", "batch_size=4",
                     "aug=none", f"output_dir={run}", "resume=auto")
    assert_ok(proc)
    assert "finished all 2 epochs of epochs=2: nothing left to train" in proc.stdout + proc.stderr
    assert read_metrics(run) == read_metrics(trained)


def test_ema_turned_on_at_resume_starts_from_the_trained_weights_and_eval_ema_reads_it(trained, folder, tmp_path):
    """Not from the fresh model's random initialisation, which the EMA was built from."""
    import shutil
    run = shutil.copytree(trained, tmp_path / "run")
    resumed = torch.load(run / "checkpoint-last.pt")["model"]
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=3", "batch_size=4",
                        "aug=none", f"output_dir={run}", "resume=auto", "ema.enabled=true"))
    ema = torch.load(run / "checkpoint-last.pt")["model_ema"]
    assert ema.keys() == resumed.keys()
    # 6 updates at decay 0.99996 move the EMA by < 3e-4 of the way to the new weights
    worst = max((ema[name].float() - resumed[name].float()).abs().max().item() for name in resumed)
    assert worst < 1e-4, worst
    assert read_metrics(run)[-1]["epoch"] == 3 and "val_acc1_ema" in read_metrics(run)[-1]

    evaluate = ("eval_only=true", "ema.eval_ema=true", "data=imagefolder", f"data.root={folder}", "aug=none")
    assert_ok(run_train(*SMALL_LION, *evaluate, f"checkpoint={run / 'checkpoint-last.pt'}",
                        f"output_dir={tmp_path / 'eval_ema'}"))
    result = json.loads((tmp_path / "eval_ema" / "eval.json").read_text())
    assert result["weights"] == "ema" and result["acc1"] == read_metrics(run)[-1]["val_acc1_ema"]
    assert_clean_error(run_train(*SMALL_LION, *evaluate, f"checkpoint={trained / 'checkpoint-last.pt'}",
                                 f"output_dir={tmp_path / 'no_ema'}"), "holds no EMA weights", "drop ema.eval_ema")

    # stored under DeiT's name "model_ema", which timm's loaders prefer by default (use_ema=True)
    import timm
    import lion_vit  # noqa: F401
    model = timm.create_model("lion_s_tiny", num_classes=3, patch_size=8, img_size=32, depth=2)
    timm.models.load_checkpoint(model, run / "checkpoint-last.pt")
    assert all(torch.equal(model.state_dict()[name], ema[name]) for name in ema)
    timm.models.load_checkpoint(model, run / "checkpoint-last.pt", use_ema=False)
    final = torch.load(run / "checkpoint-last.pt")["model"]
    assert all(torch.equal(model.state_dict()[name], final[name]) for name in final)

    # checkpoints of earlier versions kept it under "ema"
    legacy = torch.load(run / "checkpoint-last.pt")
    legacy["ema"] = legacy.pop("model_ema")
    torch.save(legacy, tmp_path / "legacy.pt")
    assert_ok(run_train(*SMALL_LION, *evaluate, f"checkpoint={tmp_path / 'legacy.pt'}",
                        f"output_dir={tmp_path / 'eval_legacy'}"))
    assert json.loads((tmp_path / "eval_legacy" / "eval.json").read_text()) == {**result, "checkpoint": str(tmp_path / "legacy.pt")}


def test_resume_with_another_global_batch_follows_the_new_schedule(folder, tmp_path):
    """Fewer processes or another batch_size at resume change the updates per epoch; the learning rate
    then follows the schedule of this command's settings (a loaded scheduler state would count
    warm-up and cosine in the old run's updates and reach optim.min_lr epochs early)."""
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "aug=none", "optim.warmup_epochs=1",
            "optim.lr=2e-3", "optim.lr_base_batch=null"]
    first, straight = tmp_path / "first", tmp_path / "straight"
    assert_ok(run_train(*args, "epochs=1", "batch_size=4", f"output_dir={first}"))
    assert_ok(run_train(*args, "epochs=3", "batch_size=2", f"output_dir={first}", "resume=auto"))
    assert_ok(run_train(*args, "epochs=3", "batch_size=2", f"output_dir={straight}"))
    resumed_lrs = [m["lr"] for m in read_metrics(first)][1:]
    straight_lrs = [m["lr"] for m in read_metrics(straight)][1:]
    assert resumed_lrs == pytest.approx(straight_lrs, rel=1e-9)
    assert straight_lrs[0] > 2 * straight_lrs[1]  # the cosine has not ended before the last epoch


def test_layer_decay_scales_the_learning_rate_per_block(folder, tmp_path):
    """optim.layer_decay (timm's layer-wise decay through the model's group_matcher): the head keeps the
    scheduled lr, each block below it a further factor, the patch embedding the smallest."""
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4", "aug=none",
                        "optim.layer_decay=0.5", f"output_dir={tmp_path}"))
    state = torch.load(tmp_path / "checkpoint-last.pt")
    groups = state["optimizer"]["param_groups"]
    scales = sorted({g["lr_scale"] for g in groups})
    assert scales == pytest.approx([0.5 ** k for k in range(3, -1, -1)])  # embedding, 2 blocks, head
    lr = read_metrics(tmp_path)[-1]["lr"]  # the schedule's, i.e. the head's
    assert lr == max(group["lr"] for group in groups)
    for group in groups:
        assert group["lr"] == pytest.approx(lr * group["lr_scale"])


def test_resume_with_another_optimizer_is_named(trained, folder, tmp_path):
    """Another optim.opt or optim.layer_decay cannot take the checkpoint's optimizer state (parameter
    groups, buffers): one line naming the setting, nothing changed; an older checkpoint without the
    settings in its config gets one line from the optimizer's own refusal."""
    import shutil
    run = shutil.copytree(trained, tmp_path / "run")
    before = (run / "checkpoint-last.pt").read_bytes()
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=3", "batch_size=4", "aug=none",
            f"output_dir={run}", "resume=auto"]
    assert_clean_error(run_train(*args, "optim.opt=sgd"), "trained with optim.opt=adamw, this run has optim.opt=sgd")
    assert_clean_error(run_train(*args, "optim.layer_decay=0.5"),
                       "trained with optim.layer_decay=null, this run has optim.layer_decay=0.5")
    assert (run / "checkpoint-last.pt").read_bytes() == before
    state = torch.load(run / "checkpoint-last.pt")
    del state["config"]["optim"]["layer_decay"]  # as written before optim.layer_decay existed
    torch.save(state, run / "checkpoint-last.pt")
    assert_clean_error(run_train(*args, "optim.layer_decay=0.5"), "optimizer state does not fit",
                       "resume with the same optimizer")


def test_gradient_accumulation_equals_the_larger_batch(folder, tmp_path):
    """batch_size=4 grad_accum_steps=2 takes the optimizer steps of batch_size=8 (same images per step,
    same lr scaling and schedule), up to float rounding; an epoch whose batches do not divide evenly ends
    with a smaller step, and the schedule still ends on its last update."""
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "aug=none", "epochs=2",
            "model.drop_path_rate=0", "optim.warmup_epochs=1"]
    sgd = ["optim.opt=momentum", "optim.lr=0.5", "optim.lr_base_batch=null"]  # unlike Adam, sees the gradient's scale
    assert_ok(run_train(*args, *sgd, "batch_size=8", f"output_dir={tmp_path / 'big'}"))
    assert_ok(run_train(*args, *sgd, "batch_size=4", "grad_accum_steps=2", f"output_dir={tmp_path / 'accum'}"))
    big, accum = (torch.load(tmp_path / run / "checkpoint-last.pt")["model"] for run in ("big", "accum"))
    for name in big:
        torch.testing.assert_close(accum[name], big[name], rtol=1e-4, atol=1e-5, msg=name)
    assert [m["lr"] for m in read_metrics(tmp_path / "accum")] == \
        pytest.approx([m["lr"] for m in read_metrics(tmp_path / "big")])
    assert [m["train_loss"] for m in read_metrics(tmp_path / "accum")] == \
        pytest.approx([m["train_loss"] for m in read_metrics(tmp_path / "big")], rel=1e-4)

    # 24 images = 6 batches of 4 = steps of 4 + 2 batches per epoch; the cosine reaches min_lr at the last
    assert_ok(run_train(*args, "batch_size=4", "grad_accum_steps=4", f"output_dir={tmp_path / 'uneven'}"))
    assert read_metrics(tmp_path / "uneven")[-1]["lr"] == pytest.approx(1e-5)  # optim.min_lr
    optimizer = torch.load(tmp_path / "uneven" / "checkpoint-last.pt")["optimizer"]
    assert {s["step"].item() for s in optimizer["state"].values()} == {4}  # 2 steps x 2 epochs


def test_resume_drops_metrics_logged_after_the_checkpoint(trained, folder, tmp_path):
    """A run killed after logging an epoch but before writing its checkpoint trains that epoch again:
    metrics.jsonl keeps one line per epoch."""
    import shutil
    run = shutil.copytree(trained, tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 3, "train_loss": -1.0}) + "\n" + '{"epoch": 4, "train_lo')
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=3", "batch_size=4",
                        "aug=none", f"output_dir={run}", "resume=auto", "optim.lr=2e-3", "optim.lr_base_batch=null",
                        "optim.warmup_epochs=0"))
    metrics = read_metrics(run)
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert metrics[:2] == read_metrics(trained) and metrics[2]["train_loss"] > 0


def test_resume_with_another_model_is_named(trained, folder, tmp_path):
    """resume=auto with a different model.name says which setting differs, and changes nothing."""
    import shutil
    run = shutil.copytree(trained, tmp_path / "run")
    before = (run / "checkpoint-last.pt").read_bytes()
    proc = run_train(*SMALL_LION, "model.name=lion_d_tiny", "data=imagefolder", f"data.root={folder}", "epochs=3",
                     "batch_size=4", "aug=none", f"output_dir={run}", "resume=auto")
    assert_clean_error(proc, "model.name=lion_s_tiny", "model.name=lion_d_tiny", "same model settings")
    assert (run / "checkpoint-last.pt").read_bytes() == before


def test_checkpoint_loads_into_timm_create_model(trained):
    """A researcher's own code: timm's checkpoint_path (a weights_only load of the 'model' entry)."""
    import timm
    import lion_vit  # noqa: F401
    path = trained / "checkpoint-best.pt"
    weights = torch.load(path)["model"]  # torch's default load (weights_only=True) accepts it
    model = timm.create_model("lion_s_tiny", checkpoint_path=str(path), img_size=32, patch_size=8, depth=2,
                              num_classes=3)
    assert model.state_dict().keys() == weights.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_fine_tune_from_a_checkpoint_with_timm_pretrained(trained, folder, tmp_path):
    """The README's fine-tuning overrides: the backbone starts from the checkpoint, the classifier anew;
    the run's own checkpoints then resume and evaluate without the initial file."""
    initial = tmp_path / "initial.pt"
    initial.write_bytes((trained / "checkpoint-best.pt").read_bytes())
    run = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none",
           f"output_dir={tmp_path / 'run'}", "optim.lr=1e-12", "optim.lr_base_batch=null", "optim.warmup_epochs=0",
           "optim.min_lr=0",
           "+model.kwargs.pretrained=true"]
    assert_clean_error(run_train(*run, "epochs=1", f"+model.kwargs.pretrained_cfg_overlay.file={tmp_path / 'no.pt'}"),
                       "cannot load the initial weights of lion_s_tiny",
                       f"model.kwargs.pretrained_cfg_overlay.file={tmp_path / 'no.pt'}")
    run.append(f"+model.kwargs.pretrained_cfg_overlay.file={initial}")
    assert_ok(run_train(*run, "epochs=1"))
    pretrained = torch.load(initial)["model"]
    tuned = torch.load(tmp_path / "run" / "checkpoint-last.pt")["model"]
    backbone = [key for key in pretrained if not key.startswith("head.")]
    assert backbone and all(torch.allclose(tuned[k], pretrained[k], atol=1e-6) for k in backbone)
    assert not torch.allclose(tuned["head.weight"], pretrained["head.weight"], atol=1e-3)

    initial.unlink()  # weights now come from the run's checkpoints
    assert_ok(run_train(*run, "epochs=2", "resume=auto"))
    assert [m["epoch"] for m in read_metrics(tmp_path / "run")] == [1, 2]
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true",
                        f"checkpoint={tmp_path / 'run' / 'checkpoint-last.pt'}", f"output_dir={tmp_path / 'eval'}"))
    assert (tmp_path / "eval" / "eval.json").exists()


def test_checkpoint_with_foreign_objects_is_refused_not_run(tmp_path):
    from lion_vit.engine.checkpoint import load_checkpoint
    from lion_vit.errors import UserError
    marker = tmp_path / "ran"
    torch.save({"model": {}, "payload": _WritesFileWhenUnpickled(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(UserError, match=r"holds a Python object \(\S+\) that torch's safe "
                                        r"load \(weights_only\) will not unpickle"):
        load_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()


class _WritesFileWhenUnpickled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def test_checkpoint_of_earlier_versions_with_numpy_rng_state_loads(tmp_path):
    """Checkpoints written before the RNG states were dropped hold numpy arrays: still readable."""
    from lion_vit.engine.checkpoint import load_checkpoint
    weights = {"head.weight": torch.randn(3, 4)}
    torch.save({"model": weights, "epoch": 4, "rng": {"numpy": np.random.get_state()}}, tmp_path / "old.pt")
    state = load_checkpoint(tmp_path / "old.pt")
    assert state["epoch"] == 4 and torch.equal(state["model"]["head.weight"], weights["head.weight"])
    assert state["rng"]["numpy"][0] == "MT19937"


def test_weights_that_do_not_fit_name_the_first_problem():
    import timm
    from lion_vit.engine.trainer import load_weights
    from lion_vit.errors import UserError
    model = timm.create_model("lion_d_tiny", img_size=32, patch_size=8, depth=1, num_classes=3)
    weights = model.state_dict()
    del weights["head.bias"]
    with pytest.raises(UserError, match=r"does not fit model LionViT: Missing key\(s\) in state_dict: \"head.bias\""):
        load_weights(model, weights)


def test_full_disk_while_saving_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import errno
    from lion_vit.engine import checkpoint as ckpt
    from lion_vit.errors import UserError
    last = tmp_path / ckpt.LAST
    ckpt.save_atomic({"model": {"w": torch.ones(3)}, "epoch": 0}, last)
    before = last.read_bytes()

    def save_until_full(state, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(ckpt.torch, "save", save_until_full)
    with pytest.raises(UserError, match=r"^could not write checkpoint .*checkpoint-last.pt \(no space left on the device\); "
                                        r"the checkpoint already there is kept; .*resume=auto"):
        ckpt.save_atomic({"model": {}, "epoch": 1}, last, keep_previous=tmp_path / ckpt.PREVIOUS)
    assert last.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.LAST]  # no partial .tmp left behind


def test_ctrl_c_while_saving_finishes_the_checkpoint_then_interrupts(tmp_path, monkeypatch):
    """A Ctrl-C that lands inside torch.save (which would turn it into a RuntimeError and lose the
    write) is held until the checkpoint is complete and renamed into place, then raised."""
    from lion_vit.engine import checkpoint as ckpt
    last = tmp_path / ckpt.LAST
    ckpt.save_atomic({"epoch": 0}, last)
    real_save = torch.save

    def save_interrupted(state, f):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the write starts
        real_save(state, f)
    monkeypatch.setattr(ckpt.torch, "save", save_interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_atomic({"epoch": 1, "w": torch.arange(10_000)}, last, keep_previous=tmp_path / ckpt.PREVIOUS)
    assert torch.load(last)["epoch"] == 1 and torch.load(tmp_path / ckpt.PREVIOUS)["epoch"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.LAST, ckpt.PREVIOUS]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards


def test_checkpoint_file_and_its_directory_are_fsynced_after_the_rename(tmp_path, monkeypatch):
    """A rename is durable only once the directory is fsynced (else a power loss can bring back the
    old entry, or none): the file's data first, then the directory after both renames."""
    import stat
    from lion_vit.engine import checkpoint as ckpt
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(dst).name))
        real_replace(src, dst)
    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    last = tmp_path / ckpt.LAST
    ckpt.save_atomic({"epoch": 0}, last)
    events.clear()
    ckpt.save_atomic({"epoch": 1}, last, keep_previous=tmp_path / ckpt.PREVIOUS)
    assert events == [("fsync", "file"), ("replace", ckpt.PREVIOUS), ("replace", ckpt.LAST), ("fsync", "dir")]
    assert torch.load(last)["epoch"] == 1 and torch.load(tmp_path / ckpt.PREVIOUS)["epoch"] == 0


def test_resume_auto_skips_a_corrupt_last_checkpoint(folder, tmp_path):
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none",
            f"output_dir={tmp_path}"]
    assert_ok(run_train(*args, "epochs=2"))
    (tmp_path / "checkpoint-last.pt").write_bytes(b"truncated")  # a crash mid-copy, say
    proc = run_train(*args, "epochs=3", "resume=auto")
    assert_ok(proc)
    assert "skips" in proc.stdout + proc.stderr
    metrics = read_metrics(tmp_path)  # redid epoch 2 from prev: its first line was dropped
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert "resumed after epoch 1" in proc.stdout + proc.stderr


def test_corrupt_image_is_skipped_with_warning(tmp_path):
    root = make_image_folder(tmp_path / "imgs", classes=2, train_per_class=4, val_per_class=2)
    bad = root / "train" / "class_0" / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={root}", "epochs=1", "batch_size=2",
                     "aug=none", f"output_dir={tmp_path / 'out'}")
    assert_ok(proc)
    assert "broken.png" in proc.stdout + proc.stderr


def test_randaugment_posterize_to_zero_bits_is_a_black_image():
    """Pillow >= 13 refuses to keep 0 bits, which RandAugment asks for at its top magnitude; Pillow < 13
    (and DeiT's training) gave a black image."""
    from PIL import ImageOps
    from timm.data.auto_augment import AugmentOp
    import lion_vit.data.build  # noqa: F401  (applies the fix before transforms are built)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (9, 7, 3), dtype=np.uint8))
    zero_bits = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)  # keeps 4 - 4 = 0 bits
    out = zero_bits(image)
    assert out.mode == image.mode and out.size == image.size and not np.asarray(out).any()
    four_bits = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=0)
    assert np.array_equal(np.asarray(four_bits(image)), np.asarray(ImageOps.posterize(image, 4)))


def test_deit_augmentation_runs_through_many_images():
    """The DeiT transform (RandAugment m9, mstd 0.5) over 2,000 draws: about 1 in 400 kept 0 bits."""
    from hydra import compose, initialize_config_dir
    from lion_vit.data.build import build_transform
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["data=imagefolder", "aug=deit"])
    transform = build_transform(cfg.data, cfg.aug, 32, train=True)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    torch.manual_seed(0)
    random.seed(0)
    shapes = {tuple(transform(image).shape) for _ in range(2000)}
    assert shapes == {(3, 32, 32)}


def test_cifar_format_loading(tmp_path):
    from lion_vit.data.datasets import cifar
    root = make_cifar10(tmp_path)
    train, val = cifar(str(root), 10, train=True), cifar(str(root), 10, train=False)
    assert len(train) == 30 and len(val) == 6 and train.classes[3] == "c3"
    image, label = train[0]
    assert image.size == (32, 32) and 0 <= label < 10
    proc = run_train(*SMALL_LION, "data=cifar10", f"data.root={root}", "epochs=1", "batch_size=8", "aug=none",
                     f"output_dir={tmp_path / 'out'}")
    assert_ok(proc)
    assert_clean_error(run_train(*SMALL_LION, "data=cifar100", f"data.root={root}", "epochs=1"),
                       "CIFAR-100 not found", "data.download=true")


def test_flat_val_folder_is_named(tmp_path):
    """ImageNet's validation archive unpacks flat: say so, rather than torchvision's "no class folder"."""
    from lion_vit.data.datasets import image_folder
    from lion_vit.errors import UserError
    (tmp_path / "val").mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8)).save(tmp_path / "val" / f"ILSVRC2012_val_{i:08d}.JPEG")
    with pytest.raises(UserError, match=r"val holds 3 images but no class subfolders; sort them into one folder"):
        image_folder(str(tmp_path), "val")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images found under"):
        image_folder(str(tmp_path), "empty")


def test_cifar_download_failure_is_one_line(tmp_path, monkeypatch):
    """data.download=true without a network says so and where to fetch the archive, not a urllib traceback."""
    import urllib.error
    import torchvision.datasets
    from lion_vit.data.datasets import cifar
    from lion_vit.errors import UserError

    def offline(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(torchvision.datasets.CIFAR100, "download", offline)
    with pytest.raises(UserError, match=r"could not download CIFAR-100 .*Name or service not known.*"
                                        r"fetch https://\S+cifar-100-python.tar.gz by hand"):
        cifar(str(tmp_path), 100, train=True, download=True)


def test_quickstart_short(tmp_path):
    """The no-argument command, shortened to 3 epochs for CI (the full run is in the README)."""
    proc = run_train("epochs=3", f"output_dir={tmp_path}", "progress=false")
    assert_ok(proc)
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 3 and metrics[-1]["val_acc1"] > 30  # well above 10% chance already


def test_progress_off_a_terminal_is_a_log_line_every_log_interval_steps(tmp_path):
    """Under SLURM or a pipe (stderr not a terminal) tqdm's redraws would pile up in the log file: progress is
    instead a line every log_interval steps, on stdout and in train.log, and the epoch's line ends the epoch."""
    proc = run_train("epochs=1", f"output_dir={tmp_path}", "log_interval=5")  # digits: 22 steps per epoch
    assert_ok(proc)
    steps = re.findall(r"INFO train 1 \[\s*(\d+)/22\]  loss \d\.\d{4}  lr \S+  \d+\.\d{3} s/step  \S+ left\n",
                       proc.stdout)
    assert steps == ["5", "10", "15", "20"], proc.stdout[-2000:]
    assert re.search(r"INFO eval \[5/6\]", proc.stdout) and "INFO epoch 1/1" in proc.stdout
    assert "\r" not in proc.stdout + proc.stderr and "it/s" not in proc.stderr
    assert (tmp_path / "train.log").read_text().count(" INFO train 1 [") == 4


def test_progress_on_a_terminal_is_a_tqdm_bar(monkeypatch, caplog):
    from lion_vit.engine.loop import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    with caplog.at_level(logging.INFO, logger="lion_vit"):
        progress = Progress(range(12), "train 3", show=True, log_interval=5)
        postfixes = []
        for step, _ in enumerate(progress):
            progress.report(step, loss="0.1234")
            postfixes.append(progress.bar.postfix)  # drawn at tqdm's next refresh
        assert "train 3:   0%|" in sys.stderr.getvalue() and postfixes[-1] == "loss=0.1234"
        assert not caplog.records, "a terminal gets the bar, not log lines"
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
        progress = Progress(range(12), "eval", show=True, log_interval=5)
        for step, _ in enumerate(progress):
            progress.report(step)
        for show, interval in ((False, 5), (True, 0)):  # progress=false; log_interval=0
            quiet = Progress(range(12), "eval", show=show, log_interval=interval)
            for step, _ in enumerate(quiet):
                quiet.report(step)
    assert [r.getMessage()[:11] for r in caplog.records] == ["eval [ 5/12", "eval [10/12"]
    assert sys.stderr.getvalue() == ""


def test_nonfinite_loss_stops_training():
    from lion_vit.engine.loop import NonFiniteLoss, Precision, train_one_epoch

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x.flatten(1)[:, :2] * self.w * float("inf")

    model = Exploding()
    loader = [(torch.randn(2, 3, 2, 2), torch.tensor([0, 1]))]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteLoss, match="epoch 5, step 1"):  # counted from 1, as the log's "epoch 5/300"
        train_one_epoch(model, loader, optimizer, torch.nn.CrossEntropyLoss(), None, 4, torch.device("cpu"),
                        Precision(torch.device("cpu")), show_progress=False)
    assert torch.equal(model.w.detach(), torch.ones(1)), "no step is taken on a non-finite loss"


_FAULTS_SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from lion_vit.engine.allocator import keep_freed_memory
    assert keep_freed_memory()
faults = []
for _ in range(6):  # a step's worth of large activations, allocated, written and freed again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16, 2**20)  # 64 MiB
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[3:]))  # after warm-up (the heap grows over the first two)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_keep_freed_memory_stops_page_faulting_large_tensors_again():
    """glibc default: every 64 MiB tensor is a fresh mmap (16k page faults); kept: the heap is reused."""
    def repeat_faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])
    assert repeat_faults("default") > 3 * 10_000
    assert repeat_faults("keep") < 1_000
