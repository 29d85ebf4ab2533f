"""Every bad setting is one error line before anything is built; device and wandb set-up."""
from __future__ import annotations

import copy
import faulthandler
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from runs import ROOT, SMALL_LION, assert_clean_error, run_python, run_train


@pytest.mark.slow
def test_bad_inputs_give_one_clear_line(folder, tmp_path):
    """train.py: one `error:` line, exit status 2, no folder left behind (a few kinds of failure; the
    others raise the same UserError, checked in-process below and in the other test files)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cases = [
        (("data=imagefolder", f"data.root={tmp_path / 'nowhere'}", "epochs=1"), ("does not exist", "data.root")),
        (("batch_size=0",), ("batch_size=0", "positive integer")),
        (("model.name=resnet18",), ("cannot build model resnet18", "unexpected keyword argument 'depth'",
                                    "start from model=lion or model=deit")),
        ((f"output_dir={a_file}",), ("cannot create output_dir", "File exists")),
        (("batch_size=2000",), ("1437 training images are fewer than one batch of 2000 per process; lower "
                                 "batch_size",)),  # (the digits' training split; the loader drops a last short batch)
        (("eval_only=true",), ("eval_only=true needs checkpoint=<path to a checkpoint-*.pt>",)),
        (("model.patch_size=3",), ("img_size=32 is not divisible by its patch size 3; pass img_size=<a multiple "
                                   "of 3> or model.patch_size=<a divisor of 32>",)),
        # Hydra's errors while it composes the config, which it reports over several lines with exit status 1
        (("epoch=5",), ("epoch is not a setting of train.py; did you mean epochs?",)),
        (("optim.lrr=1",), ("optim.lrr is not a setting of train.py; did you mean optim.lr",)),
        (("model.kwargs.foo=1",), ("model.kwargs.foo is not in the config yet; add it with "
                                   "+model.kwargs.foo=<value>",)),
        (("model=lionn",), ("there is no config model=lionn; the choices for model are deit, digits, lion",)),
        (("+data=imagefolder",), ("+data=imagefolder appends a config group that the config already has; choose it "
                                  "without the +: data=imagefolder",)),
        (("+model=deit",), ("the config group model is chosen twice; choose it once, without a +",)),  # (model=lion)
        (("img_size=[32",), ("cannot read the override img_size=[32",)),
        (("output_dir=~/runs/a",), ("cannot read the override output_dir=~/runs/a", "write $HOME/..., which the "
                                                                                     "shell expands")),
        (("img_size=32,64",), ("Ambiguous value for argument 'img_size=32,64'", "add --multirun")),
        (("seed=0,1", f"output_dir={tmp_path / 'run_cfg'}", "-m", "--cfg", "job"),  # (Hydra's own flags)
         ("Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified: choose one of -m "
          "(a sweep), --cfg",)),
        (("data.root=${nope}",), ("data.root cannot be resolved (Interpolation key 'nope' not found)",)),
        (("model.name=${nope}",), ("model.name cannot be resolved (Interpolation key 'nope' not found)",)),
        ((f"hydra.run.dir={tmp_path / 'run_hydra'}",), ("hydra.run.dir is not where train.py writes a run; pass "
                                                         "output_dir=<folder> instead",)),
        # a sweep's empty output_dir (an unset shell variable): its folder would be the current one, from which
        # Hydra's multirun.yaml and the jobs' folders were written (here into the test's folder, were it not refused)
        (("-m", "output_dir=", f"hydra.sweep.dir={tmp_path / 'run_sweep'}", "seed=0,1"),
         ("output_dir= is not allowed; set output_dir to a folder (empty, as an unset shell variable",)),
    ]
    if not torch.cuda.is_available():
        cases.append((("device=cuda",), ("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto",)))
    # independent processes, mostly Python start-up and imports: run side by side, each with its own
    # output_dir in the test's folder (the last case sets its own), which the failed run leaves out
    runs = [overrides if any(o.startswith("output_dir=") for o in overrides) else
            (*overrides, f"output_dir={tmp_path / f'run{i}'}") for i, (overrides, _) in enumerate(cases)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda overrides: run_train(*SMALL_LION, *overrides), runs))
    for (overrides, needles), proc in zip(cases, procs):
        assert proc.returncode == 2
        assert_clean_error(proc, *needles)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("run")]  # no folder left behind


def test_bad_models_checkpoints_and_data_are_user_errors(tmp_path):
    from omegaconf import OmegaConf
    from lion_vit.data import build_dataset
    from lion_vit.engine.build import build_model
    from lion_vit.engine.checkpoint import load_checkpoint
    from lion_vit.errors import UserError
    model = OmegaConf.create({"name": "lion_s_tiny", "attn_form": "auto", "attn_backend": "auto", "chunk_size": None,
                              "patch_size": 8, "drop_path_rate": 0.0, "kwargs": {"depth": 2}})
    with pytest.raises(UserError, match="^unknown model 'lion_x_huge'; LION models: "):
        build_model(OmegaConf.merge(model, {"name": "lion_x_huge"}), 3, 32)
    with pytest.raises(UserError, match="^cannot build model lion_s_tiny: img_size=30 is not divisible by its patch "
                                        "size 8; pass img_size=<a multiple of 8>"):
        build_model(model, 3, 30)
    with pytest.raises(UserError, match=r"^cannot build model lion_s_tiny: img_size=\[32,30\] is not divisible by its "
                                        r"patch size 8; pass img_size=<a multiple of 8> for each side or "
                                        r"model.patch_size=<a divisor of 32 and 30>$"):
        build_model(model, 3, (32, 30))
    with pytest.raises(UserError, match="^model.attn_form / model.chunk_size / model.attn_backend apply to LION models "
                                        "only, not deit_tiny_patch16_224$"):
        build_model(OmegaConf.merge(model, {"name": "deit_tiny_patch16_224", "attn_form": "chunk"}), 3, 32)
    # timm's constructors check arguments with assert, with or without a message
    deit = OmegaConf.merge(model, {"name": "deit_tiny_patch16_224"})
    with pytest.raises(UserError, match=r"^cannot build model deit_tiny_patch16_224: timm refused its arguments "
                                        r"\(model.kwargs=\{'depth': 2, 'global_pool': 'mean'\} among them\): Only avg"):
        build_model(OmegaConf.merge(deit, {"kwargs": {"global_pool": "mean"}}), 3, 32)
    with pytest.raises(UserError, match=r"\): assert pos_embed in \('', 'none', 'learn'\) \(vision_transformer.py, "
                                        r"line \d+\)$"):
        build_model(OmegaConf.merge(deit, {"kwargs": {"pos_embed": "rope"}}), 3, 32)
    # a timm argument that a setting of its own passes: it would clash with it (a TypeError), or lose to it silently
    with pytest.raises(UserError, match=r"^model.kwargs.num_classes: train.py sets it from the data \(3 classes "):
        build_model(OmegaConf.merge(model, {"kwargs": {"num_classes": 5}}), 3, 32)
    with pytest.raises(UserError, match="^model.kwargs.attn_form is the setting model.attn_form; pass "
                                        "model.attn_form=<value> instead"):
        build_model(OmegaConf.merge(model, {"kwargs": {"attn_form": "rnn"}}), 3, 32)
    # the data are RGB: another number of channels is named before the run starts, not by its first batch
    for name in (model.name, "deit_tiny_patch16_224"):
        with pytest.raises(UserError, match=r"^model.kwargs.in_chans=1: train.py's data are RGB images, grey ones "
                                            r"converted \(3 channels\); drop it$"):
            build_model(OmegaConf.merge(model, {"name": name, "kwargs": {"in_chans": 1}}), 3, 32)
    assert build_model(OmegaConf.merge(model, {"kwargs": {"in_chans": 3}}), 3, 32)(torch.randn(1, 3, 32, 32)).shape \
        == (1, 3)
    # a timm model without stochastic depth takes no drop_path_rate: built without it at 0, else named
    cnn = OmegaConf.create({**OmegaConf.to_container(model), "name": "dla46_c", "patch_size": None, "kwargs": {}})
    assert build_model(OmegaConf.merge(cnn, {"drop_path_rate": 0.0}), 3, 32)(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    with pytest.raises(UserError, match=r"^model.drop_path_rate=0.1: dla46_c has no stochastic depth \(timm builds it "
                                        r"without drop_path_rate\); set model.drop_path_rate=0$"):
        build_model(OmegaConf.merge(cnn, {"drop_path_rate": 0.1}), 3, 32)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"this is not a checkpoint")
    with pytest.raises(UserError, match="is corrupt or not a torch checkpoint"):
        load_checkpoint(corrupt)
    with pytest.raises(UserError, match="missing.pt does not exist; check the path$"):  # (not a previous checkpoint)
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(UserError, match="^data=imagefolder needs data.root"):
        build_dataset(OmegaConf.create({"name": "imagefolder", "root": None}), "train", None)


@pytest.mark.parametrize("override, needle", [
    ("epochs=0", "epochs"), ("epochs=2.5", "epochs"), ("img_size=abc", "img_size"), ("img_size=[32]", "img_size"),
    ("img_size=[32,0]", "img_size"), ("img_size=[32,32,32]", "img_size"), ("num_workers=-1", "num_workers"),
    ("num_workers=many", "num_workers"), ("prefetch_factor=0", "prefetch_factor"),
    ("optim.clip_grad=0", "optim.clip_grad"), ("optim.clip_grad=abc", "optim.clip_grad"),
    ("optim.warmup_epochs=-1", "optim.warmup_epochs"), ("ema.decay=1.5", "ema.decay"),
    ("logger.wandb.mode=onlin", "logger.wandb.mode"), ("compile=ture", "compile"), ("ema.enabled=yes", "ema.enabled"),
    ("seed=abc", "seed"), ("seed=-1", "seed"), ("amp_dtype=float8", "amp_dtype"), ("optim.opt=lamb2", "optim.opt"),
    ("optim.sched=cosin", "optim.sched"), ("optim.sched=plateau", "optim.sched"), ("model.name=null", "model.name"),
    ("data.crop_pct=0", "data.crop_pct"), ("resume=", "resume"), ("checkpoint=", "checkpoint"),
    ("data.train_split=", "data.train_split"), ("data.interpolation=cubic", "data.interpolation"),
    ("data.std=[0.2,0,0.2]", "data.std"), ("data.mean=[]", "data.mean"), ("data.mean=[0.5,0.5]", "data.mean"),
    ("data.std=[0.5]", "data.std"), ("optim.weight_decay=abc", "optim.weight_decay"),
    ("optim.decay_epochs=0", "optim.decay_epochs"), ("optim.decay_milestones=[60,30]", "optim.decay_milestones"),
    ("optim.decay_milestones=[]", "optim.decay_milestones"), ("optim.decay_rate=0", "optim.decay_rate"),
    ("optim.betas=[0.9]", "optim.betas"), ("optim.eps=0", "optim.eps"), ("optim.min_lr=-1", "optim.min_lr"),
    ("aug.mixup=-1", "aug.mixup"), ("aug.mixup_prob=2", "aug.mixup_prob"), ("aug.mixup_mode=elements", "aug.mixup_mode"),
    ("aug.smoothing=1.5", "aug.smoothing"), ("aug.reprob=2", "aug.reprob"), ("aug.scale=[1.0]", "aug.scale"),
    ("aug.scale=[0.9,0.1]", "aug.scale"), ("aug.remode=foo", "aug.remode"),
    ("aug.recount=0", "aug.recount"), ("aug.repeated_aug=-1", "aug.repeated_aug"),
    # timm asserts on an unknown policy or option, and skips an option without a number
    ("aug.auto_augment=xyz", "aug.auto_augment"), ("aug.auto_augment=rand-m9-foo7", "aug.auto_augment"),
    ("aug.auto_augment=rand-mfoo", "aug.auto_augment"), ("aug.auto_augment=augmix-m5-z2", "aug.auto_augment"),
    ("distill.type=medium", "distill.type"), ("distill.alpha=1.5", "distill.alpha"), ("distill.tau=0", "distill.tau"),
    ("device=gpu", "device"), ("output_dir=", "output_dir"), ("output_dir= ", "output_dir"), ("model.attn_form=softmax", "model.attn_form"), ("model.attn_backend=cuda", "model.attn_backend"), ("data.name=svhn", "data.name"),
])
def test_settings_out_of_range_are_named(override, needle):
    """Checked before anything is built: timm, torch and the DataLoader would fail deep inside instead."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["ema.enabled=true", override])
    with pytest.raises(UserError, match=f"^{re.escape(override.split('=')[0])}=.* is not allowed; set {needle} to"):
        check_settings(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the triton backend runs on this machine's GPU")
def test_the_triton_backend_without_a_gpu_is_one_line(tmp_path):
    """model.attn_backend=triton on a CPU (Triton's interpreter off, as for a user; the tests' processes run it):
    one line naming the setting and the fix, no folder left, instead of Triton's traceback."""
    proc = run_train("model.attn_backend=triton", "epochs=1", f"output_dir={tmp_path / 'run'}",
                     launcher=["env", "-u", "TRITON_INTERPRET", sys.executable, str(ROOT / "train.py")])
    assert proc.returncode == 2
    assert_clean_error(proc, "model.attn_backend: the triton backend runs Triton kernels, which need a CUDA GPU, "
                             "and this call is on cpu; choose the backend auto")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_compile_on_a_machine_that_cannot_build_kernels_is_one_line(tmp_path):
    """compile=true without a working C++ compiler (inductor's on a CPU; Triton's on CUDA wants one too): one line
    before any folder is made, not inductor's traceback at the first step, and a run with one compiles and trains."""
    short = ["epochs=1", "model.kwargs.depth=1", "compile=true", "progress=false"]
    proc = run_train(*short, f"output_dir={tmp_path / 'none'}", launcher=[
        "env", "CXX=/nonexistent/g++", sys.executable, str(ROOT / "train.py")])
    assert_clean_error(proc, "compile=true, but torch.compile cannot build kernels on this machine (",
                       "/nonexistent/g++", "or set compile=false")
    assert proc.returncode == 2 and not (tmp_path / "none").exists()
    proc = run_train(*short, f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoint-last.pt").exists()


def test_a_data_root_that_the_digits_do_not_read_is_refused():
    """data.root without data=imagefolder (or another tree) would train on the digits, which read no folder."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        runs = [compose("config", overrides=["data.root=/datasets/imagenet", *more]) for more in ([], ["eval_only=true"])]
        check_settings(compose("config", overrides=["data.root=/datasets/imagenet", "data=imagenet"]))
    for cfg in runs:
        with pytest.raises(UserError, match=r"^data.root=/datasets/imagenet is not read by data=digits, which "
                                            r"scikit-learn ships; to read that folder add data=imagefolder"):
            check_settings(cfg)


def test_help_says_what_train_py_does_and_where_the_settings_are_described():
    proc = run_train("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("train.py: train or evaluate LION-ViT (or any timm model) with the DeiT recipe.")
    assert "docs/training.md" in proc.stdout and "model: deit, digits, lion" in proc.stdout  # (and Hydra's groups)


def test_a_checkpoint_is_read_by_evaluation_only():
    """checkpoint= in a training run would be ignored (fresh weights): refused, naming what trains from a file."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        training = compose("config", overrides=["checkpoint=runs/a/checkpoint-best.pt"])
        check_settings(compose("config", overrides=["checkpoint=runs/a/checkpoint-best.pt", "eval_only=true"]))
    with pytest.raises(UserError, match=r"^checkpoint=runs/a/checkpoint-best.pt is read only with eval_only=true; "
                                        r"to train from its weights pass model.init_from=<path>, to continue its run "
                                        r"resume=<path>$"):
        check_settings(training)


@pytest.mark.parametrize("override, needle", [
    ("tuning.group_share=-1", "group_share must be a number >= 0"),
    ("tuning.chunk_backward_fallback=cpu", "unknown chunk_backward_fallback 'cpu'; choose one of"),
    ("tuning.chunk_backward_fallback=[rnn]", "unknown chunk_backward_fallback ['rnn']; choose one of"),
    ("tuning.chunk_backward_fails=maybe", "chunk_backward_fails must be None (detect), True or False"),
    ("tuning.recurrent_group_programs=0", "recurrent_group_programs must be a positive integer"),
    ("tuning.bidirectional_forward=[64,48,4]", "bidirectional_forward must be (own tile, loop tile, warps)"),
    ("tuning.bidirectional_backward=64", "bidirectional_backward must be (own tile, loop tile, warps)"),
    ("tuning.bidirectional_keys_first=1", "bidirectional_keys_first must be True or False"),
    ("tuning.bidirectional_forward_blocks=-1", "bidirectional_forward_blocks must be a positive integer, or 0"),
    ("tuning.bidirectional_factored_masks=0", "bidirectional_factored_masks must be True or False"),
    ("tuning.normaliser_launch=[8,16,4]", "normaliser_launch must be (tokens per chunk, chunk sums per carry tile, "
     "warps): powers of two, tokens per chunk at least 16"),
    ("tuning.auto_chunk_min_tokens={train: 2048}", "auto_chunk_min_tokens must map training and / or inference"),
    ("tuning.auto_chunk_min_tokens={training: 0}", "auto_chunk_min_tokens must map training and / or inference"),
    ("tuning.auto_chunk_min_tokens=2048", "auto_chunk_min_tokens must map training and / or inference"),
    ("tuning.cpu_auto_chunk_min_tokens={inference: -1}",
     "cpu_auto_chunk_min_tokens must map training and / or inference"),
    ("tuning.default_chunk_size=0", "default_chunk_size must be a positive integer"),
])
def test_tuning_settings_are_checked_as_the_ops_check_them(override, needle):
    """Each tuning.* setting is one of lion_vit.ops.Tuning's knobs, refused in one line with Tuning's reason."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[override])
    with pytest.raises(UserError, match=f"^{re.escape(override.split('=')[0])}=.* is not allowed: {re.escape(needle)}"):
        check_settings(cfg)


def test_tuning_settings_set_the_ops_knobs_for_the_run(tmp_path):
    """configs/config.yaml names every knob of lion_vit.ops.Tuning, null for the code's default; the ones set
    are in effect while train.py runs (its log names them, and the plans they give) and only then, form auto's
    thresholds for one and two scans alike."""
    import dataclasses
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import tuning_changes
    from lion_vit.ops import Tuning, tuned, tuning
    overrides = ["tuning.group_share=0.5", "tuning.auto_chunk_min_tokens={training: 2048}",
                 "tuning.cpu_auto_chunk_min_tokens={inference: 16}", "tuning.default_chunk_size=4",
                 "tuning.bidirectional_backward=[64,64,8]"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        assert tuning_changes(compose("config").tuning) == {}
        cfg = compose("config", overrides=overrides)
    assert list(cfg.tuning) == [f.name for f in dataclasses.fields(Tuning)]
    thresholds = {**Tuning().auto_chunk_min_tokens, (True, 1): 2048, (True, 2): 2048}
    cpu_thresholds = {**Tuning().cpu_auto_chunk_min_tokens, (False, 1): 16, (False, 2): 16}
    with tuned(**tuning_changes(cfg.tuning)) as knobs:
        assert knobs.changes() == {"group_share": 0.5, "bidirectional_backward": (64, 64, 8),
                                   "auto_chunk_min_tokens": thresholds, "cpu_auto_chunk_min_tokens": cpu_thresholds,
                                   "default_chunk_size": 4}
    assert tuning().changes() == {}
    proc = run_train(*overrides, "epochs=1", "progress=false", f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"tuning: auto_chunk_min_tokens={thresholds}, cpu_auto_chunk_min_tokens={cpu_thresholds}, " \
           "default_chunk_size=4, group_share=0.5, bidirectional_backward=(64, 64, 8) (the other knobs at their " \
           "defaults)" in proc.stdout
    # the digits' 16 tokens: trained in the attention form, evaluated in the chunk form (the CPU's knobs above; its
    # one product over the 16 tokens, which costs less than 4 chunks of 4)
    assert "attention: attention form, torch backend: one masked product; in evaluation, chunk form, torch " \
           "backend: one masked product\n" in proc.stdout


def test_the_defaults_and_timms_optimizer_spellings_pass_the_setting_checks():
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for overrides in (["ema.enabled=true"], ["optim.opt=AdamW"], ["optim.opt=lookahead_lamb"]):
            check_settings(compose("config", overrides=overrides))


@pytest.mark.slow
def test_every_schedule_the_setting_checks_pass_is_built_by_timm():
    """A schedule's settings that timm refuses (wsd's decay longer than the run, rsqrt without warm-up) are
    refused before the data are read; every other one builds, and the schedules are all of timm's."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import SCHEDULES, check_settings
    from lion_vit.engine.trainer import build_scheduler
    from lion_vit.errors import UserError
    import timm.scheduler
    assert len(SCHEDULES) == (8 if hasattr(timm.scheduler, "WSDLRScheduler") else 5)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    refused = set()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for sched in SCHEDULES:
            composed = compose("config", overrides=[f"optim.sched={sched}", "epochs=3"])
            for warmup in (0, 1, 2.5, 3):
                for decay in ("null", 0.5, 1, 2, 5):
                    # (one compose a schedule: the schema checks the two numbers as it would the command's)
                    overrides = [f"optim.warmup_epochs={warmup}", f"optim.decay_epochs={decay}"]
                    cfg = copy.deepcopy(composed)
                    cfg.merge_with_dotlist(overrides)
                    try:
                        check_settings(cfg)
                    except UserError as error:
                        refused.add((sched, warmup, decay, str(error).split(" ")[0]))
                        continue
                    assert build_scheduler(cfg, optimizer, updates=7) is not None, overrides
    if "wsd" in SCHEDULES:
        assert ("wsd", 0, 5, "optim.decay_epochs=5") in refused and ("wsd", 0, 2, "optim.decay_epochs=2") not in refused
        assert ("rsqrt", 0, "null", "optim.sched=rsqrt") in refused and ("wsd", 3, "null", "optim.sched=wsd") in refused
        assert {sched for sched, *_ in refused} == {"wsd", "rsqrt"}


@pytest.mark.filterwarnings("ignore:It is highly recommended to have 'opt_einsum'")  # (timm's kron)
def test_every_timm_optimizer_the_setting_checks_pass_is_built_with_its_betas():
    """optim.betas null (the default) leaves each optimizer its own; a list must have as many numbers as the
    optimizer takes (adan three, where timm would fail inside it), and none where it takes none (timm would drop
    them without a word)."""
    from hydra import compose, initialize_config_dir
    from timm.optim import get_optimizer_info, list_optimizers
    from lion_vit.engine.config import check_settings
    from lion_vit.engine.trainer import build_optimizer
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        composed = compose("config", overrides=["optim=adamw"])

    def settings(name, betas):
        cfg = copy.deepcopy(composed)
        cfg.optim.opt, cfg.optim.betas = name, betas
        return cfg
    kinds = {}  # the rule, once for each kind of optimizer (each check_settings call checks every setting)
    for name in list_optimizers():
        info = get_optimizer_info(name)
        kinds.setdefault((info.has_betas, info.num_betas), name)
    assert set(kinds) == {(False, 2), (True, 2), (True, 3)}
    for (takes, count), name in kinds.items():
        for betas in (None, [0.8, 0.9], [0.8, 0.9, 0.95]):
            if betas is None or (takes and len(betas) == count):
                check_settings(settings(name, betas))
            else:
                with pytest.raises(UserError, match=r"^optim.betas=\[0.8, 0.9.*(is not read by|is not allowed)"):
                    check_settings(settings(name, betas))
    model, built = torch.nn.Linear(3, 2), set()
    for name in list_optimizers():  # what the rule lets through, timm builds
        info = get_optimizer_info(name)
        for betas in (None, [0.8, 0.9, 0.95][:info.num_betas] if info.has_betas else None):
            try:
                group = build_optimizer(settings(name, betas), model, lr=0.1).param_groups[0]
            except (ImportError, AssertionError):  # (bitsandbytes' and APEX's need CUDA)
                continue
            if betas is not None:  # (Adafactor keeps the first as beta1)
                assert list(group["betas"]) == betas if "betas" in group else group["beta1"] == betas[0], name
            built.add((name, betas is None))
    assert {("adamw", True), ("adan", True), ("adan", False), ("sgd", True), ("lion", False)} <= built


def test_a_second_order_optimizer_is_refused_in_one_line():
    """timm's AdaHessian steps on gradients of gradients, which train.py's backward does not keep (it failed with
    a traceback at the first step)."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for name in ("adahessian", "lookahead_adahessian"):
            with pytest.raises(UserError, match=f"^optim.opt={name} is a second-order optimizer, which train.py does "
                                                "not run"):
                check_settings(compose("config", overrides=[f"optim.opt={name}"]))


def test_timm_auto_augment_policies_pass_the_setting_checks():
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for policy in ("rand-m9-mstd0.5-inc1", "rand-m9-n3-mstd1-tweights", "augmix-m5-w3-d2", "original-mstd0.5", "3a",
                       "null"):
            check_settings(compose("config", overrides=["aug=deit", f"aug.auto_augment={policy}"]))


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml")))
def test_every_experiment_passes_the_setting_checks(experiment):
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
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
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        check_settings(compose("config", overrides=["batch_size=33"]))  # digits: no mixup, any batch
        check_settings(compose("config", overrides=["aug=deit", "batch_size=34"]))
        check_settings(compose("config", overrides=["aug=deit", "batch_size=33", "aug.mixup=0", "aug.cutmix=0"]))
        odd = compose("config", overrides=["aug=deit", "batch_size=33"])
    with pytest.raises(UserError, match=r"^batch_size=33 is not allowed; set batch_size to an even number .*aug.mixup=0"):
        check_settings(odd)


def test_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    """logger.wandb.mode=online without an account, or where wandb's server is out of reach, names the fixes
    instead of wandb's traceback (each its own: a key does not help a machine without internet)."""
    import wandb
    from omegaconf import OmegaConf
    from lion_vit.engine.logs import WandbLogger
    from lion_vit.errors import UserError

    def fails(error):
        def init(**kwargs):
            raise error
        return init

    cfg = OmegaConf.create({"logger": {"wandb": {"mode": "online", "project": "p", "entity": None, "name": None,
                                                 "tags": []}}})
    monkeypatch.setattr(wandb, "init", fails(wandb.errors.UsageError("No API key configured. Use `wandb login`.")))
    with pytest.raises(UserError, match=r"wandb could not start in mode=online \(No API key configured.*\); "
                                        r"run `wandb login` or set WANDB_API_KEY, or use logger.wandb.mode=offline"):
        WandbLogger(cfg, tmp_path, enabled=True)
    monkeypatch.setattr(wandb, "init", fails(wandb.errors.CommError("Timed out while retrying: dial tcp: no host")))
    with pytest.raises(UserError, match=r"wandb could not start in mode=online \(Timed out while retrying.*\); check "
                                        r"that this machine reaches wandb's server and logger.wandb.project / entity, "
                                        r"or use logger.wandb.mode=offline \(no account needed; `wandb sync`"):
        WandbLogger(cfg, tmp_path, enabled=True)
    # offline, no account or server is involved: what wandb refuses is a setting's value, and tags are labels
    monkeypatch.setattr(wandb, "init", fails(wandb.errors.UsageError("Invalid project name 'a/b': cannot contain "
                                                                      "characters '/'")))
    cfg.logger.wandb.mode = "offline"
    with pytest.raises(UserError, match=r"^wandb could not start in mode=offline \(Invalid project name 'a/b'.*\); "
                                        r"change the logger.wandb setting it names$"):
        WandbLogger(cfg, tmp_path, enabled=True)
    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.update(kwargs))
    cfg.logger.wandb.tags = [2026, "lion"]
    WandbLogger(cfg, tmp_path, enabled=True)
    assert seen["tags"] == ["2026", "lion"]  # (wandb's settings refuse numbers)


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
    """An allocation failure (CPU allocator or CUDA) is reported with its size and what to lower; in training, how to
    keep the global batch, and gradient checkpointing where it is off."""
    from omegaconf import OmegaConf
    from lion_vit.engine.trainer import _out_of_resources
    cfg = OmegaConf.create({"img_size": 230, "batch_size": 64, "eval_only": True, "grad_checkpointing": False})
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 179098240000 bytes. Error code 12 (Cannot allocate memory)")
    message = str(_out_of_resources(cpu, cfg))
    assert message.startswith("out of memory at img_size 230, batch_size 64") and "179.1 GB requested" in message
    assert "lower batch_size or img_size (the attention form" in message and "\n" not in message
    training = str(_out_of_resources(cpu, OmegaConf.merge(cfg, {"eval_only": False})))
    assert "; lower batch_size (grad_accum_steps=<k> keeps the global batch) or img_size, or set " \
           "grad_checkpointing=true (each block's" in training
    checkpointed = str(_out_of_resources(cpu, OmegaConf.merge(cfg, {"eval_only": False, "grad_checkpointing": True})))
    assert "grad_checkpointing" not in checkpointed and "keeps the global batch) or img_size (the" in checkpointed
    cuda = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has ...")
    assert "(20.00 GiB requested)" in str(_out_of_resources(cuda, cfg))
    assert _out_of_resources(RuntimeError("shape mismatch"), cfg) is None


def test_a_dataloader_worker_killed_for_memory_becomes_one_line():
    """DataLoader's "exited unexpectedly", caused by a worker killed by SIGBUS (out of shared memory: Docker's 64 MB
    /dev/shm) or SIGKILL (the out-of-memory killer): what ran out and what to lower; any other death is left as is."""
    from omegaconf import OmegaConf
    from lion_vit.engine.trainer import _out_of_resources
    cfg = OmegaConf.create({"img_size": 224, "batch_size": 256, "num_workers": 8, "eval_only": False,
                            "grad_checkpointing": False})

    def died(signal_name: str) -> RuntimeError:
        error = RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly")
        error.__cause__ = RuntimeError(f"DataLoader worker (pid 123) is killed by signal: {signal_name}. ")
        return error
    shm = str(_out_of_resources(died("Bus error"), cfg))
    assert shm.startswith("a DataLoader worker ran out of shared memory: batches pass through /dev/shm")
    assert "give it more (docker run --shm-size=16g or --ipc=host) (num_workers=8, batch_size 256, img_size 224); " \
           "lower num_workers or batch_size" in shm
    assert str(_out_of_resources(died("Killed"), cfg)).startswith(
        "a DataLoader worker was killed, most likely by the kernel's out-of-memory killer (num_workers=8,")
    assert _out_of_resources(died("Segmentation fault"), cfg) is None

    def die(number: int) -> None:
        faulthandler.disable()  # (pytest's, inherited: it would print the dying process's stack)
        os.kill(os.getpid(), number)

    def dead_worker(number: int):  # (how it started does not matter: its exit code is -number)
        worker = multiprocessing.get_context("fork").Process(target=die, args=(number,))
        worker.start()
        worker.join()
        return worker

    def check_failed(failed_workers):  # what DataLoader's check raises where the workers are not this process's
        try:  # children (a fork server's or spawned: Python 3.14's default), naming no signal
            raise queue.Empty
        except queue.Empty as empty:
            pids = ", ".join(str(w.pid) for w in failed_workers)
            raise RuntimeError(f"DataLoader worker (pid(s) {pids}) exited unexpectedly") from empty

    for number, line in [(signal.SIGBUS, "a DataLoader worker ran out of shared memory"),
                         (signal.SIGKILL, "a DataLoader worker was killed"), (signal.SIGSEGV, None)]:
        with pytest.raises(RuntimeError) as raised:
            check_failed([dead_worker(number)])
        found = _out_of_resources(raised.value, cfg)
        assert (found is None) if line is None else str(found).startswith(line), (number, found)


def test_nonfinite_loss_stops_training():
    from lion_vit.engine.loop import NonFiniteLoss, Precision, Training, classification_loss, train_one_epoch

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
        train_one_epoch(Training(model, optimizer, classification_loss(torch.nn.CrossEntropyLoss()), None,
                                 Precision(torch.device("cpu"))), loader, 4, show_progress=False)
    assert torch.equal(model.w.detach(), torch.ones(1)), "no step is taken on a non-finite loss"


def test_a_setting_that_does_not_exist_or_has_the_wrong_type_is_named():
    """The schema (lion_vit/engine/config.py) knows every setting and its type: Hydra's `+key=value`
    can add a key to a group, which the checks name instead of ignoring it."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        unknown = compose("config", overrides=["+data.foo=1"])
        listed = compose("config", overrides=["data.root=[1,2]"])
        check_settings(compose("config", overrides=["+model.kwargs.qkv_bias=false"]))  # any timm argument
    with pytest.raises(UserError, match=r"^data.foo is not a setting of train.py"):
        check_settings(unknown)
    with pytest.raises(UserError, match=r"^data.root=\[1, 2\] is not allowed; set data.root to null or a string$"):
        check_settings(listed)


def test_every_default_is_in_the_yaml_once_and_passes_the_schema():
    """One source per default: the schema (lion_vit/engine/config.py) holds none; every group option and
    experiment, composed, sets every setting of the schema and nothing else, and every value passes
    its rule. A default changed in a YAML to a value the schema refuses fails here."""
    import dataclasses
    from hydra import compose, initialize_config_dir
    from omegaconf import MISSING, OmegaConf
    from lion_vit.engine import config
    from lion_vit.engine.config import RunConfig, check_settings

    names = [name for name, *_ in config._fields(RunConfig)]
    assert all(f.default is MISSING and f.default_factory is dataclasses.MISSING
               for _, f, _ in config._fields(RunConfig)), "a schema field has a default: put it in configs/ instead"
    overrides = [[]] + [[f"{group.name}={option.stem}"] for group in sorted((ROOT / "configs").iterdir())
                        if group.is_dir() and group.name != "hydra" for option in sorted(group.glob("*.yaml"))]
    overrides += [["distill=soft", "distill.teacher=resnet18"]]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for override in overrides:
            if override and override[0].startswith("distill=") and len(override) == 1 and override[0] != "distill=none":
                override = override + ["distill.teacher=resnet18"]  # a distillation needs a teacher
            cfg = compose("config", overrides=override)
            missing = [name for name in names if OmegaConf.select(cfg, name, default=MISSING) is MISSING]
            assert not missing, f"{override}: no value for {missing}"
            check_settings(cfg)  # every value passes its rule, no key unknown to the schema


def test_a_model_name_says_what_changed_it(tmp_path):
    """The default (digits) model group sizes any name for 8 px digits: the log line names every setting
    by which the model is not the one its name builds; model=lion on those 8 px says what to set."""
    proc = run_train("model.name=lion_s_tiny", "epochs=1", "progress=false", f"output_dir={tmp_path / 'digits'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model lion_s_tiny changed by model.patch_size=2, model.kwargs.embed_dim=64, model.kwargs.depth=4, " \
           "model.kwargs.num_heads=4 (0.20M params) at 8 px" in proc.stdout
    assert "the quickstart's default" not in proc.stdout + proc.stderr  # (the data its groups are for)
    proc = run_train("model=lion", "epochs=1", f"output_dir={tmp_path / 'lion'}")
    assert_clean_error(proc, "img_size=8 is not divisible by its patch size 16; pass img_size=<a multiple of 16>")


def test_the_digits_groups_on_other_data_are_named_unless_chosen(folder, tmp_path):
    """The first hour's `data=imagefolder data.root=... model.name=lion_s_small`: the default model=digits group
    makes a 0.2M-parameter model of patch 2 under that name, optim=digits and aug=digits the quickstart's recipe
    without augmentation; the run says so beside the line of changes, and what to add. Not for a group asked for
    by name, nor on the digits."""
    args = ["model.name=lion_s_tiny", "epochs=1", "batch_size=8", "progress=false", "data=imagefolder",
            f"data.root={folder}", "img_size=16"]
    proc = run_train(*args, f"output_dir={tmp_path / 'a'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("the quickstart's defaults model=digits, optim=digits, aug=digits are for the 8 px digits (model=digits "
            "sizes lion_s_tiny down, as the line above says; optim=digits keeps the digits' fixed lr, unscaled by the "
            "batch, and short warm-up; aug=digits augments nothing); add model=lion optim=adamw aug=deit for the model "
            "as timm builds it and DeiT's recipe") in proc.stdout + proc.stderr
    proc = run_train(*args, "model=digits", "optim=adamw", f"output_dir={tmp_path / 'b'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the quickstart's default aug=digits is for the 8 px digits (aug=digits augments nothing); add aug=deit " \
           "for DeiT's recipe (the ImageNet experiments set it), or name it to keep it" in proc.stdout + proc.stderr
    proc = run_train(*args, "model=digits", "optim=digits", "aug=digits", f"output_dir={tmp_path / 'c'}")
    assert proc.returncode == 0 and "the quickstart's default" not in proc.stdout + proc.stderr


def test_a_sweep_job_that_fails_leaves_no_folder(tmp_path):
    """Hydra makes a job's folder before the job runs; a job failing before its first epoch removes it, as a
    single run leaves no output_dir behind. Nor does the sweep's folder stay with only Hydra's multirun.yaml in
    it, nor the folders made for it; a folder that was there stays."""
    sweep = tmp_path / "new" / "sweep"
    proc = run_train("-m", *SMALL_LION, "img_size=36,30", f"output_dir={sweep}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        f"error: job {job}: cannot build model lion_s_tiny: img_size={size} is not divisible by its patch size 8; "
        f"pass img_size=<a multiple of 8> or model.patch_size=<a divisor of {size}>"
        for job, size in ((0, 36), (1, 30))]
    assert proc.stderr.splitlines()[-1] == "every job of the sweep ended at an error (the error lines above say why)"
    assert list(tmp_path.iterdir()) == []
    # a swept config that does not exist: Hydra's error while it composes the jobs, after multirun.yaml
    proc = run_train("-m", *SMALL_LION, "model=lion,nonexistent", f"output_dir={tmp_path}")
    assert_clean_error(proc, "there is no config model=nonexistent")
    assert proc.returncode == 2 and tmp_path.is_dir() and list(tmp_path.iterdir()) == []
    # a setting that a sweep's job reads before it trains (its wandb group), of a ${...} that cannot be resolved
    proc = run_train("-m", *SMALL_LION, "logger.wandb.group=${nope}", f"output_dir={sweep}")
    assert_clean_error(proc, "error: job 0: logger.wandb.group cannot be resolved (Interpolation key 'nope' not found)")
    assert proc.returncode == 2 and list(tmp_path.iterdir()) == []


def test_a_local_sweep_goes_on_past_a_refused_job(tmp_path, trained, folder):
    """As Hydra's sweep goes on past a job that fails (and a SLURM sweep's jobs fail alone): the jobs after a
    refused one run, and the sweep ends with exit status 2 and a line naming the refused jobs."""
    proc = run_train("-m", *SMALL_LION, "data=imagefolder", f"data.root={folder}", "eval_only=true",
                     f"checkpoint={trained / 'checkpoint-last.pt'}", "img_size=36,32", f"output_dir={tmp_path}")
    assert_clean_error(proc, "error: job 0: cannot build model lion_s_tiny: img_size=36 is not divisible")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == "1 of the sweep's 2 jobs ran to the end; job 0 ended at an error (the " \
                                           "error lines above say why)"
    assert json.loads((tmp_path / "1" / "eval.json").read_text())["img_size"] == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "multirun.yaml"]


def test_an_experiment_of_ones_own_is_found_with_config_dir(tmp_path):
    """docs/training.md: an experiment YAML in a folder of the user's, found through Hydra's --config-dir."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: lion\n"
                                                       "epochs: 7\nmodel:\n  name: lion_s_tiny\n")
    proc = run_train("--config-dir", str(tmp_path), "experiment=mine", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "epochs: 7" in proc.stdout and "name: lion_s_tiny" in proc.stdout
    # one beside the group's folder, not in it: Hydra does not find it, and the line says where it goes
    (tmp_path / "experiment" / "mine.yaml").rename(tmp_path / "mine.yaml")
    proc = run_train("--config-dir", str(tmp_path), "experiment=mine", f"output_dir={tmp_path / 'run'}")
    assert_clean_error(proc, "there is no config experiment=mine; the choices for experiment are cifar100, ",
                       f"; Hydra reads experiment configs from a folder named experiment: move {tmp_path}/mine.yaml "
                       f"to {tmp_path}/experiment/mine.yaml")
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    # one without its package line (its keys land under experiment.), one that is not YAML
    (tmp_path / "experiment" / "nopkg.yaml").write_text("epochs: 7\n")
    (tmp_path / "experiment" / "broken.yaml").write_text("# @package _global_\nepochs: 7\n\tbatch_size: 8\n")
    for name, needles in (("nopkg", ["experiment is not a setting of train.py: an experiment file sets the run's "
                                     "settings only when its first line is '# @package _global_'"]),
                          ("broken", [f"cannot read the config file {tmp_path}/experiment/broken.yaml: while "
                                      f"scanning for the next token; found character '\\t' that cannot start any "
                                      f"token (line 3, column 1); fix its YAML"])):
        proc = run_train("--config-dir", str(tmp_path), f"experiment={name}", f"output_dir={tmp_path / 'run'}")
        assert_clean_error(proc, *needles)
        assert proc.returncode == 2 and not (tmp_path / "run").exists()


def test_model_deit_with_an_experiments_lion_name_names_the_softmax_twin(tmp_path):
    """An experiment sets model.name after the model group's, so experiment=... model=deit would train the
    experiment's LION model, not the baseline: one line naming the DeiT of the same size."""
    for experiment, twin in (("cifar100", "deit_small_patch16_224"),
                             ("deit_tiny_imagenet", "deit_tiny_patch16_224"),
                             ("deit_small_imagenet_distill", "deit_small_distilled_patch16_224")):
        proc = run_train(f"experiment={experiment}", "model=deit", f"output_dir={tmp_path / experiment}")
        assert proc.returncode == 2
        assert_clean_error(proc, "model=deit trains the softmax baseline", f"add model.name={twin}")
    assert list(tmp_path.iterdir()) == []


def test_under_torchrun_the_error_line_is_the_reported_root_cause(tmp_path):
    """torchrun's report of the failed processes reads each one's error file (TORCHELASTIC_ERROR_FILE): it shows
    the error line, not a link to torchrun's docs."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    error_file = tmp_path / "error.json"
    as_a_torchrun_worker = ("import os, runpy, sys; os.environ['TORCHELASTIC_ERROR_FILE'] = sys.argv[1]; "
                            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = run_python("-c", as_a_torchrun_worker, str(error_file), str(ROOT / "train.py"), *SMALL_LION, "epochs=0",
                      f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert_clean_error(proc, "epochs=0 is not allowed")
    failure = ProcessFailure(local_rank=0, pid=0, exitcode=proc.returncode, error_file=str(error_file))
    assert failure.message == proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(shutil.which("srun") is not None, reason="SLURM is installed here")
def test_slurm_launcher_without_srun_is_one_line(tmp_path):
    proc = run_train("-m", "hydra/launcher=slurm", f"output_dir={tmp_path / 'sweep'}")
    assert proc.returncode == 2
    assert_clean_error(proc, "hydra/launcher=slurm", "srun is not on this machine's PATH")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("affinity, env, workers", [
    (16, {}, 16),
    (16, {"LOCAL_WORLD_SIZE": "8"}, 2),  # torchrun's processes share the launcher's cores
    (16, {"LOCAL_WORLD_SIZE": "32"}, 1),
    (16, {"SLURM_NTASKS_PER_NODE": "4(x2)"}, 4),  # SLURM tasks without cpus_per_task share the node's
    (10, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "10"}, 10),  # srun bound each task to its 10
    (80, {"SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "10"}, 10),  # unbound: still its 10
    (4, {"SLURM_CPUS_PER_TASK": "10"}, 4),  # never more than it may run on
    (80, {"SLURM_CPUS_PER_TASK": "80", "LOCAL_WORLD_SIZE": "8"}, 10),  # torchrun in one SLURM task a node
])
def test_num_workers_auto_is_the_cores_of_this_process(monkeypatch, affinity, env, workers):
    """num_workers=auto: the cores this process may run on, shared with its node's other processes where they
    share them (configs/hydra/launcher/slurm.yaml's 8 tasks of 10 cores: 10 workers each, not 10 // 8)."""
    import os
    from lion_vit.data import resolve_num_workers
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert resolve_num_workers("auto") == workers
    assert resolve_num_workers(3) == 3


def test_wandb_mode_from_the_environment_names_the_variable(monkeypatch):
    """configs/logger/wandb.yaml reads WANDB_MODE; a value wandb's own choices lack names where it came from."""
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config")
    with pytest.raises(UserError, match=r"^logger.wandb.mode=dryrun is not allowed; .*WANDB_MODE"):
        check_settings(cfg)
