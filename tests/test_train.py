"""train.py end to end on CPU with tiny generated data: one epoch, torchrun, sweeps, resume, evaluation."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import yaml

from runs import (SMALL_LION, assert_clean_error, assert_ok, free_port, kill_after_first_epoch, read_metrics,
                  run_train)


def test_step_schedules_decay_at_the_epochs_set(tmp_path):
    """optim.decay_epochs and optim.decay_rate reach timm's step schedule (the lr logged is after each epoch);
    its default, a decay every 90 epochs, leaves a short run at one lr, which a warning says. So does a min_lr
    above the lr, which timm's cosine schedule rises to (step schedules never read it)."""
    quiet = ["progress=false", "optim.warmup_epochs=0", "epochs=2"]
    proc = run_train(*quiet, "optim.sched=step", "optim.decay_epochs=1", "optim.decay_rate=0.5",
                     f"output_dir={tmp_path / 'step'}")
    assert_ok(proc)
    assert [line["lr"] for line in read_metrics(tmp_path / "step")] == pytest.approx([1e-3, 5e-4])
    assert "WARNING" not in proc.stdout
    proc = run_train(*quiet, "optim.sched=multistep", f"output_dir={tmp_path / 'multistep'}")
    assert_ok(proc)
    assert [line["lr"] for line in read_metrics(tmp_path / "multistep")] == pytest.approx([2e-3, 2e-3])
    assert "optim.sched=multistep first decays the learning rate at epoch 90, not before epochs=2: it stays " \
           "2.00e-03; set optim.decay_milestones for this run's length" in proc.stdout
    proc = run_train(*quiet, "optim.min_lr=4e-3", f"output_dir={tmp_path / 'cosine'}")
    assert_ok(proc)
    assert [line["lr"] for line in read_metrics(tmp_path / "cosine")] == pytest.approx([3e-3, 4e-3])
    assert "optim.min_lr=0.004 is above this run's lr 2.00e-03: the cosine schedule raises the learning rate to " \
           "it instead of lowering it; set optim.min_lr below the lr" in proc.stdout


def test_one_epoch_lion_with_deit_recipe(folder, tmp_path):
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "aug=deit", "epochs=1",
                     "batch_size=4", f"output_dir={tmp_path}", "ema.enabled=true", "optim.clip_grad=1.0",
                     "distill.teacher=resnet18")  # named, but distill.type stays none: a warning, not built
    assert_ok(proc)
    (line,) = read_metrics(tmp_path)
    assert set(line) >= {"epoch", "train_loss", "val_loss", "val_acc1", "val_acc5", "lr", "epoch_time_s",
                         "imgs_per_s", "data_wait_share", "val_acc1_ema"}
    assert 0 <= line["data_wait_share"] < 1
    assert (tmp_path / "config.yaml").read_text().count("lion_s_tiny") == 1
    state = torch.load(tmp_path / "checkpoint-last.pt", weights_only=True)  # tensors and plain data only
    assert {"model", "model_ema", "optimizer", "scheduler", "scaler", "epoch", "classes", "config"} <= set(state)
    assert (tmp_path / "checkpoint-best.pt").exists()
    assert "optim.warmup_epochs=5 is not below epochs=1: the learning rate never leaves warm-up" in proc.stdout
    assert "lr 3.91e-06 (optim.lr 5.00e-04 per 512 images), global batch 4," in proc.stdout  # DeiT's lr scaling
    assert "distillation is off (distill.type=none): the teacher resnet18 is not used; distill=soft or " \
           "distill=hard distils from it" in proc.stdout
    assert line["epoch"] == 1 and state["best_epoch"] == 1
    assert proc.stdout.strip().splitlines()[-1].endswith(  # the run's closing line
        f"done: best top-1 {line['val_acc1']:.2f} % (epoch 1), last {line['val_acc1']:.2f} %; run folder "
        f"{tmp_path}, best checkpoint {tmp_path / 'checkpoint-best.pt'}")
    assert "wandb:" not in proc.stdout + proc.stderr  # (disabled in tests; online runs keep the history in wandb)


def test_a_table_1_family_trains_with_the_lion_settings(folder, tmp_path):
    """model.name picks a Table 1 family like any LION model: the form settings apply to it."""
    proc = run_train(*SMALL_LION, "model.name=lion_xlstm_natural_tiny", "model.attn_form=chunk", "model.chunk_size=4",
                     "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4", "aug=none",
                     f"output_dir={tmp_path}")
    assert_ok(proc)
    assert "chunk form" in proc.stdout and len(read_metrics(tmp_path)) == 1


def test_validating_on_the_training_split_warns(folder, tmp_path):
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "data.val_split=train", "epochs=1",
                     "batch_size=4", "aug=none", f"output_dir={tmp_path}")
    assert_ok(proc)
    assert "data.val_split=train is the training split: every epoch's validation accuracy is on the training " \
           "images" in proc.stdout


def test_one_epoch_deit_baseline(folder, tmp_path):
    proc = run_train("model=deit", "model.name=deit_tiny_patch16_224", "model.patch_size=8", "img_size=32",
                     "+model.kwargs.depth=2", "optim=adamw", "progress=false", "data=imagefolder",
                     f"data.root={folder}", "epochs=1", "batch_size=4", "aug=none", f"output_dir={tmp_path}")
    assert_ok(proc)
    assert len(read_metrics(tmp_path)) == 1


@pytest.mark.slow
def test_torchrun_two_processes_gloo(folder, tmp_path):
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py")
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4",
                     "aug=none", f"output_dir={tmp_path}", launcher=launcher)
    assert_ok(proc)
    (line,) = read_metrics(tmp_path)  # rank 0 writes once
    state = torch.load(tmp_path / "checkpoint-last.pt", weights_only=True)
    assert state["epoch"] == 1  # epochs finished, as the console counts them
    # 24 training images, 2 processes x batch 4, drop_last: 3 steps x 8 images seen per epoch
    assert line["imgs_per_s"] > 0 and 0 <= line["val_acc1"] <= 100


def test_a_torchrun_sweep_stops_at_a_refused_job(folder, tmp_path):
    """Each process of a torchrun runs the sweep (-m); a refusal that one process alone met (a file only its shard
    holds) must not send it on to the next job while the others wait in this one, so the sweep stops there."""
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py")
    proc = run_train("-m", *SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4",
                     "aug=none", f"output_dir={tmp_path}", "img_size=36,32", launcher=launcher)
    assert proc.returncode != 0 and "error: cannot build model lion_s_tiny: img_size=36 is not divisible" in proc.stderr
    assert "#1 :" not in proc.stdout + proc.stderr and not (tmp_path / "1").exists()


@pytest.mark.slow
def test_two_slurm_tasks_train_as_one_group(folder, tmp_path):
    """One process a SLURM task (as submitit starts them, no torchrun): SLURM's ranks make the group."""
    import subprocess
    from runs import ENV, ROOT
    port = free_port()
    argv = [sys.executable, str(ROOT / "train.py"), *SMALL_LION, "data=imagefolder", f"data.root={folder}",
            "epochs=1", "batch_size=4", "aug=none", f"output_dir={tmp_path / 'run'}"]
    tasks = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(
        ENV, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2", SLURM_JOB_ID="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for rank in (0, 1)]
    outputs = [task.communicate(timeout=300)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    assert "global batch 8, 2 process(es)" in outputs[0]
    assert len(read_metrics(tmp_path / "run")) == 1


def test_a_process_takes_its_local_ranks_gpu_or_the_one_it_sees(monkeypatch):
    """cuda:<local rank> where the process sees every GPU of its node (torchrun, submitit's --gpus-per-node);
    cuda:0 where SLURM gave the task one GPU of its own (--gpus-per-task, --gpu-bind); one clear error where
    more processes than GPUs would share them (torchrun's processes see the same GPUs)."""
    import torch.distributed as dist
    from lion_vit.engine.distributed import init_distributed
    from lion_vit.errors import UserError
    joined, chosen = [], []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.append((backend, kwargs)))
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):  # (set, so that the ones init_distributed sets are undone)
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "11")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    for visible, device in ((8, "cuda:3"), (1, "cuda:0")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        info, got = init_distributed(torch.device("cuda"))
        assert (str(got), info.rank, info.world_size, info.local_rank) == (device, 11, 16, 3)
        assert str(chosen[-1]) == device and joined[-1] == ("nccl", dict(init_method="env://", world_size=16, rank=11))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match=r"the process of local rank 3 sees 2 GPU\(s\): launch at most 2 "
                                        r"process\(es\) a node"):
        init_distributed(torch.device("cuda"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node=4 where one GPU is visible
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"the process of local rank 3 sees 1 GPU\(s\): launch at most 1 "
                                        r"process\(es\) a node"):
        init_distributed(torch.device("cuda"))
    assert len(joined) == 2
    monkeypatch.undo()
    assert "RANK" not in os.environ and "SLURM_PROCID" not in os.environ


def test_sweep_jobs_get_their_own_output_dirs(folder, tmp_path):
    """hydra -m: one output_dir and resume=auto for the sweep, a folder per job, never shared."""
    proc = run_train("-m", *SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4",
                     "aug=none", f"output_dir={tmp_path}", "resume=auto", "seed=0,1")
    assert_ok(proc)
    first, second = (torch.load(tmp_path / str(job) / "checkpoint-last.pt") for job in (0, 1))
    assert (first["config"]["seed"], second["config"]["seed"]) == (0, 1)
    assert first["epoch"] == second["epoch"] == 1  # job 1 trained; it did not resume from job 0's checkpoint
    assert len(read_metrics(tmp_path / "1")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "multirun.yaml"]  # Hydra's sweep record
    # in wandb: one group per sweep, runs named after it and the job
    assert [(c["config"]["logger"]["wandb"]["group"], c["config"]["logger"]["wandb"]["name"]) for c in (first, second)] \
        == [(tmp_path.name, f"{tmp_path.name}/0"), (tmp_path.name, f"{tmp_path.name}/1")]
    # a single run (the sweep's command without -m) pointed at the sweep's folder would mix a run in beside its jobs
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=2", "batch_size=4", "aug=none",
                     f"output_dir={tmp_path}", "resume=auto")
    assert_clean_error(proc, f"{tmp_path} is the folder of a sweep (-m: multirun.yaml, jobs 0, 1)",
                       f"output_dir={tmp_path}/<job number> resume=auto")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "multirun.yaml"]


def test_kill_and_resume_equals_uninterrupted(folder, tmp_path):
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=deit"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_ok(run_train(*args, "epochs=3", f"output_dir={straight}"))

    kill_after_first_epoch(*args, output_dir=resumed, epochs=3)
    proc = run_train(*args, "epochs=3", f"output_dir={resumed}", "resume=auto")
    assert_ok(proc)
    assert "worker(s) a process" not in proc.stdout  # (the same loader workers: the same draws)

    a = torch.load(straight / "checkpoint-last.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint-last.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 3
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert [m["train_loss"] for m in read_metrics(straight)] == [m["train_loss"] for m in read_metrics(resumed)][-3:]


def test_eval_only_same_accuracy_in_every_form(trained, folder, tmp_path):
    """One Hydra sweep (-m, as the README shows) over the forms: each job writes <output_dir>/<job>/eval.json.
    At 96 px (144 tokens) the chunk form runs chunks; at the trained 32 px one product would cost less."""
    forms = ["attention", "rnn", "chunk"]
    assert_ok(run_train("-m", *SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true", "img_size=96",
                        f"checkpoint={trained / 'checkpoint-last.pt'}", f"model.attn_form={','.join(forms)}",
                        "model.chunk_size=8", f"output_dir={tmp_path}"))
    results = {}
    for job in range(len(forms)):
        result = json.loads((tmp_path / str(job) / "eval.json").read_text())
        assert set(result) >= {"acc1", "acc5", "loss", "attn_form", "chunk_size", "attn_plan", "img_size",
                               "num_images", "model", "checkpoint", "weights", "batch_size", "eval_time_s",
                               "imgs_per_s", "peak_gpu_mem_mb"}
        assert result["num_images"] == 12 and result["peak_gpu_mem_mb"] is None  # (a CPU)
        assert result["imgs_per_s"] == pytest.approx(12 / result["eval_time_s"]) and result["eval_time_s"] > 0
        results[result["attn_form"]] = result
    assert sorted(results) == sorted(forms)
    assert [results[form]["chunk_size"] for form in forms] == [None, None, 8]  # only the chunk form has one
    assert results["chunk"]["attn_plan"] == "chunk form, cpu backend: 18 chunks in groups of rows"
    assert results["attention"]["acc1"] == results["rnn"]["acc1"] == results["chunk"]["acc1"]
    assert abs(results["attention"]["loss"] - results["rnn"]["loss"]) < 1e-4
    assert abs(results["attention"]["loss"] - results["chunk"]["loss"]) < 1e-4


def test_eval_only_says_what_ran_and_keeps_an_earlier_evaluation(trained, folder, tmp_path):
    """The log names the model and its plan; eval.json the form and chunks that ran (attn_form=auto
    resolved; a chunk size only where chunks ran); a second evaluation into the folder is refused."""
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true", "model.attn_form=auto",
            "model.chunk_size=64", f"checkpoint={trained / 'checkpoint-best.pt'}", f"output_dir={tmp_path}"]
    proc = run_train(*args)
    assert_ok(proc)
    assert "model lion_s_tiny changed by model.patch_size=8, model.kwargs.depth=2 (0.93M params) at 32 px, 12 val " \
           "images, the model weights of" in proc.stdout
    assert "attention: attention form, torch backend: one masked product" in proc.stdout
    before = (tmp_path / "eval.json").read_text()
    result = json.loads(before)
    assert (result["attn_form"], result["chunk_size"], result["attn_plan"]) == \
        ("attention", None, "attention form, torch backend: one masked product")
    proc = run_train(*args[:-2], "model.attn_form=chunk", f"checkpoint={trained / 'checkpoint-best.pt'}",
                     f"output_dir={tmp_path}")
    assert proc.returncode == 2
    assert_clean_error(proc, f"{tmp_path} already holds an evaluation (eval.json); choose a new output_dir")
    assert (tmp_path / "eval.json").read_text() == before


def test_eval_only_at_higher_resolution(trained, folder, tmp_path):
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true", "img_size=128",
                     f"checkpoint={trained / 'checkpoint-best.pt'}", "model.attn_form=chunk",
                     "model.chunk_size=16", f"output_dir={tmp_path}")
    assert_ok(proc)
    assert proc.stdout.strip().splitlines()[-1].endswith(f"wrote {tmp_path / 'eval.json'}")
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["img_size"] == 128 and result["chunk_size"] == 16


def test_a_run_at_height_by_width_trains_and_evaluates_at_any_size(folder, tmp_path):
    """img_size=[height,width]: timm's transforms crop to it and the model's grid follows. Evaluated at the trained
    size the checkpoint scores what its run's validation did; at another, LION-lit's positional embeddings are
    resampled from the trained grid (2x3 here), which timm's filter would take for a square of its tokens' root."""
    lit = ["model=lion", "model.name=lion_lit_tiny", "model.patch_size=8", "+model.kwargs.depth=1", "optim=adamw",
           "progress=false", "data=imagefolder", f"data.root={folder}", "batch_size=4"]
    run = tmp_path / "run"
    proc = run_train(*lit, "aug=deit", "epochs=1", "img_size=[16,24]", f"output_dir={run}")
    assert_ok(proc)
    assert "(0.48M params) at 16x24 px" in proc.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["img_size"] == [16, 24]
    (trained,) = read_metrics(run)
    sizes = {"same": "[16,24]", "tall": "[24,16]", "square": "[16,16]"}
    for name, size in sizes.items():
        proc = run_train(*lit, "eval_only=true", f"checkpoint={run / 'checkpoint-last.pt'}", f"img_size={size}",
                         f"output_dir={tmp_path / name}")
        assert_ok(proc)
        if name == "tall":  # (timm's line; 6 tokens either way, which its filter would load as they are)
            assert "Resized position embedding: (2, 3) to (3, 2)." in proc.stdout
    results = {name: json.loads((tmp_path / name / "eval.json").read_text()) for name in sizes}
    assert [results[name]["img_size"] for name in sizes] == [[16, 24], [24, 16], 16]  # (a square: one integer)
    assert results["same"]["acc1"] == trained["val_acc1"]
    assert results["same"]["loss"] == pytest.approx(trained["val_loss"], abs=1e-5)


def test_eval_only_takes_the_architecture_from_the_checkpoint(trained, folder, tmp_path):
    """The README's eval command names no architecture: here the default model group (digits), whose
    kwargs (embed_dim 64, depth 4, ...) differ from the checkpoint's (lion_s_tiny, depth 2)."""
    assert_ok(run_train("data=imagefolder", f"data.root={folder}", "eval_only=true", "img_size=32", "progress=false",
                        f"checkpoint={trained / 'checkpoint-best.pt'}", f"output_dir={tmp_path}"))
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["model"] == "lion_s_tiny" and result["num_images"] == 12
    trained_acc1 = max(m["val_acc1"] for m in read_metrics(trained))  # checkpoint-best
    assert result["acc1"] == pytest.approx(trained_acc1)


def test_eval_only_reads_weights_alone_with_the_commands_architecture(trained, folder, tmp_path):
    """A state dict (.safetensors, .pth) or timm's checkpoint (state_dict, state_dict_ema) holds no config: the
    command's model settings build the architecture; the weights give the training checkpoint's accuracy."""
    from safetensors.torch import save_file
    state = torch.load(trained / "checkpoint-best.pt", weights_only=True)
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file(state["model"], str(weights / "model.safetensors"))
    torch.save({"state_dict": state["model"], "state_dict_ema": state["model"], "epoch": 2}, weights / "timm.pth.tar")
    evaluate = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true"]
    accuracy = max(m["val_acc1"] for m in read_metrics(trained))
    for name, more in (("model.safetensors", []), ("timm.pth.tar", ["ema.eval_ema=true"])):
        out = tmp_path / name
        assert_ok(run_train(*evaluate, f"checkpoint={weights / name}", *more, f"output_dir={out}"))
        result = json.loads((out / "eval.json").read_text())
        assert result["acc1"] == pytest.approx(accuracy) and result["model"] == "lion_s_tiny"
    assert_clean_error(run_train(*SMALL_LION, "resume=" + str(weights / "timm.pth.tar"), "data=imagefolder",
                                 f"data.root={folder}", f"output_dir={tmp_path / 'resumed'}"),
                       "holds no 'model' weights; expected a lion-vit training checkpoint")


def test_eval_only_of_a_checkpoint_at_a_url(trained, folder, tmp_path):
    """checkpoint=<URL>, as DeiT's `--eval --resume https://...`: downloaded (here from a file:// URL) and
    evaluated; eval.json names the URL. resume= takes a run's own file, not a URL."""
    url = (trained / "checkpoint-best.pt").as_uri()
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true", f"checkpoint={url}",
                        f"output_dir={tmp_path / 'eval'}"))
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["acc1"] == pytest.approx(max(m["val_acc1"] for m in read_metrics(trained)))
    assert result["checkpoint"] == url
    assert_clean_error(run_train(*SMALL_LION, f"resume={url}", f"output_dir={tmp_path / 'resumed'}"),
                       f"resume={url} is not allowed", "nor a URL: download it first")


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
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=3", "batch_size=4",
                     "aug=none", f"output_dir={run}", "resume=auto", "ema.enabled=true")
    assert_ok(proc)
    ema_acc1 = read_metrics(run)[-1]["val_acc1_ema"]
    assert f"acc5 {read_metrics(run)[-1]['val_acc5']:.2f}  ema acc1 {ema_acc1:.2f}  lr " in proc.stdout + proc.stderr
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


def test_resume_with_another_global_batch_follows_the_new_schedule(folder, tmp_path):
    """Fewer processes or another batch_size at resume change the updates per epoch; the learning rate
    then follows the schedule of this command's settings (a loaded scheduler state would count
    warm-up and cosine in the old run's updates and reach optim.min_lr epochs early). Another number of loader
    workers is a warning."""
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "aug=none", "optim.warmup_epochs=1",
            "optim.lr=2e-3", "optim.lr_base_batch=null"]
    first, straight = tmp_path / "first", tmp_path / "straight"
    assert_ok(run_train(*args, "epochs=1", "batch_size=4", "num_workers=1", f"output_dir={first}"))
    resumed = run_train(*args, "epochs=3", "batch_size=2", f"output_dir={first}", "resume=auto")
    assert_ok(resumed)
    # (another worker count draws other augmentations: said, as num_workers=auto on a node of other cores would)
    assert "WARNING this run loads its training data with 0 worker(s) a process, the checkpoint's run with 1: its " \
           "augmentations are drawn otherwise from here on" in resumed.stdout
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


def test_resume_starts_an_ema_or_refuses_to_drop_one(trained, folder, tmp_path):
    """ema.enabled=true on a resume of a run without an EMA starts one from the resumed weights, and says so;
    a resume without it of a run that keeps one would drop its EMA weights: one line, nothing changed."""
    import shutil
    run = shutil.copytree(trained, tmp_path / "run")
    args = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none", f"output_dir={run}",
            "resume=auto"]
    proc = run_train(*args, "epochs=3", "ema.enabled=true")
    assert_ok(proc)
    assert "the EMA starts from the resumed weights" in proc.stdout
    before = (run / "checkpoint-last.pt").read_bytes()
    assert torch.load(run / "checkpoint-last.pt")["model_ema"] is not None
    assert_clean_error(run_train(*args, "epochs=4"), "holds its run's EMA weights",
                       "this run has ema.enabled=false", "resume with ema.enabled=true")
    assert (run / "checkpoint-last.pt").read_bytes() == before


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


def test_grad_checkpointing_trains_the_same_weights(trained, folder, tmp_path):
    """grad_checkpointing=true recomputes each block in backward: the `trained` run's command with it ends on
    the same bits; a timm model without gradient checkpointing is one line."""
    proc = run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=2", "batch_size=4", "aug=none",
                     f"output_dir={tmp_path / 'run'}", "optim.lr=2e-3", "optim.lr_base_batch=null",
                     "optim.warmup_epochs=0", "grad_checkpointing=true")
    assert_ok(proc)
    ours, theirs = (torch.load(run / "checkpoint-last.pt")["model"] for run in (tmp_path / "run", trained))
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    proc = run_train("model=deit", "model.name=dla46_c", "model.patch_size=null", "model.drop_path_rate=0",
                     "img_size=32", "data=imagefolder", f"data.root={folder}", "epochs=1", "batch_size=4", "aug=none",
                     "progress=false", f"output_dir={tmp_path / 'dla'}", "grad_checkpointing=true")
    assert_clean_error(proc, "grad_checkpointing=true: dla46_c has no gradient checkpointing in timm (gradient "
                             "checkpointing not supported); set grad_checkpointing=false")
    assert proc.returncode == 2 and not (tmp_path / "dla").exists()


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


def test_quickstart_short(tmp_path):
    """The no-argument command, shortened to 3 epochs for CI (the full run is in the README)."""
    proc = run_train("epochs=3", f"output_dir={tmp_path}", "progress=false")
    assert_ok(proc)
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 3 and metrics[-1]["val_acc1"] > 30  # well above 10% chance already


def test_the_epochs_wait_for_data_counts_the_loaders_time_not_the_steps():
    """data_wait_share's clock: the time spent in the loader's next(), not in the step that uses the batch."""
    import time
    from lion_vit.engine.loop import WaitedFor

    def slow_loader():
        for item in range(3):
            time.sleep(0.02)
            yield item

    batches = WaitedFor(slow_loader())
    for _ in batches:
        time.sleep(0.1)  # the step
    assert 0.06 <= batches.waited < 0.3 and 0.02 <= batches.first < 0.1  # (the first: what the advice leaves out)


def test_evaluation_counts_hits_exactly_and_reads_the_device_once(monkeypatch):
    """evaluate's accuracies are hits over images exactly (in batches of 3, whose percentages in float32 are not),
    its loss the mean cross-entropy, and it reads its sums from the device once, at the end: each read waits for
    the device, so per batch it would hold the next batch's launches back on a GPU."""
    from lion_vit.engine.loop import Precision, evaluate
    torch.manual_seed(0)
    logits, targets = torch.randn(21, 7), torch.randint(0, 7, (21,))

    class Table(torch.nn.Module):  # image i's logits are row i
        def forward(self, x):
            return logits[x[:, 0].long()]

    batches = [(torch.arange(i, i + 3, dtype=torch.float32)[:, None], targets[i:i + 3]) for i in range(0, 21, 3)]
    reads = []
    for name in ("item", "tolist"):
        read = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *args, _read=read: reads.append(1) or _read(self, *args))
    cpu = torch.device("cpu")
    stats = evaluate(Table(), batches, cpu, Precision(cpu), show_progress=False)
    monkeypatch.undo()
    top = logits.topk(5, dim=-1).indices
    assert stats["acc1"] == 100.0 * int((top[:, 0] == targets).sum()) / 21
    assert stats["acc5"] == 100.0 * int((top == targets[:, None]).any(-1).sum()) / 21
    assert stats["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, targets)), rel=1e-6)
    assert stats["num_images"] == 21 and len(reads) == 1
