"""Checkpoints: safe loading, atomic durable writes, full disks, resume=auto, timm and fine-tuning reading them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from runs import SMALL_LION, assert_clean_error, assert_ok, read_metrics, run_train


def test_existing_run_is_not_overwritten(trained):
    before = (trained / "checkpoint-last.pt").read_bytes()
    proc = run_train(*SMALL_LION, "epochs=1", f"output_dir={trained}")
    assert_clean_error(proc, "resume=auto")
    assert (trained / "checkpoint-last.pt").read_bytes() == before


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


def test_weights_at_a_url_are_downloaded_once_each_into_torch_hubs_cache(trained, tmp_path, monkeypatch):
    """The one reader of weight files (checkpoint=, model.init_from, distill.teacher_checkpoint, from_official) takes
    them as DeiT's commands do, at a URL (file:// here, as https:// without a network): downloaded once into
    torch.hub's cache, a folder per URL (two runs' checkpoint-best.pt stay apart). An unreachable URL is one
    line and leaves no folder in the cache."""
    import shutil
    import timm
    from omegaconf import OmegaConf
    import lion_vit
    from lion_vit.engine.distill import build_teacher
    from lion_vit.weights import read_weights
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    served = tmp_path / "served"
    for run in ("a", "b"):
        (served / run).mkdir(parents=True)
        shutil.copy(trained / "checkpoint-best.pt", served / run / "checkpoint-best.pt")
    url = (served / "a" / "checkpoint-best.pt").as_uri()
    assert url.startswith("file:///")
    teacher, (size, _, _) = build_teacher(OmegaConf.create({"teacher": None, "teacher_checkpoint": url}), 3,
                                          [f"class_{k}" for k in range(3)])
    weights = torch.load(trained / "checkpoint-best.pt")["model"]
    assert size == 32 and all(torch.equal(teacher.state_dict()[k], v) for k, v in weights.items())
    (served / "a" / "checkpoint-best.pt").unlink()  # read again from the cache
    model = timm.create_model("lion_d_tiny", img_size=32, patch_size=8, depth=2, num_classes=3)
    assert len(lion_vit.init_from_vit(model, url).copied) > 20
    assert torch.equal(model.state_dict()["blocks.0.attn.qkv.weight"], weights["blocks.0.attn.qkv.weight"])
    read_weights((served / "b" / "checkpoint-best.pt").as_uri())
    cache = tmp_path / "torch_home" / "hub" / "checkpoints"
    assert sorted(p.name for p in cache.glob("*/*")) == ["checkpoint-best.pt"] * 2
    with pytest.raises(ValueError, match=r"^http://127.0.0.1:9/deit.pth cannot be downloaded \(\[Errno 111\] "
                                         r"Connection refused\); download it where it is reachable and pass the "
                                         r"file's path$"):
        read_weights("http://127.0.0.1:9/deit.pth")
    assert len(list(cache.iterdir())) == 2

    def refused(url, destination, progress):  # a cache folder this user cannot write (as root, none is)
        raise PermissionError(13, "Permission denied", destination)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refused)
    with pytest.raises(ValueError, match=r"^file:///elsewhere/deit.pth cannot be downloaded into .*torch_home/hub/"
                                         r"checkpoints/\w+ \(Permission denied\); set TORCH_HOME to a folder you "
                                         r"can write, or pass a downloaded file's path$"):
        read_weights("file:///elsewhere/deit.pth")
    assert len(list(cache.iterdir())) == 2


@pytest.mark.slow
def test_fine_tune_from_a_checkpoint_with_timm_pretrained(trained, folder, tmp_path):
    """The README's fine-tuning overrides: the backbone starts from the checkpoint, and so does its
    classifier where it has the data's number of classes (a new one where not); the run's own checkpoints
    then resume and evaluate without the initial file."""
    initial, other_head = tmp_path / "initial.pt", tmp_path / "five_classes.pt"
    initial.write_bytes((trained / "checkpoint-best.pt").read_bytes())
    state = torch.load(initial)
    state["model"].update({"head.weight": torch.zeros(5, state["model"]["head.weight"].shape[1]),
                           "head.bias": torch.zeros(5)})
    torch.save(state, other_head)
    run = [*SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none",
           f"output_dir={tmp_path / 'run'}", "optim.lr=1e-12", "optim.lr_base_batch=null", "optim.warmup_epochs=0",
           "optim.min_lr=0",
           "+model.kwargs.pretrained=true"]
    assert_clean_error(run_train(*run, "epochs=1", f"+model.kwargs.pretrained_cfg_overlay.file={tmp_path / 'no.pt'}"),
                       "cannot load the initial weights of lion_s_tiny",
                       f"model.kwargs.pretrained_cfg_overlay.file={tmp_path / 'no.pt'}: the file does not exist; "
                       f"check the path")  # (timm raises a FileNotFoundError of no message)
    other = [*run, f"output_dir={tmp_path / 'other'}", f"+model.kwargs.pretrained_cfg_overlay.file={other_head}"]
    run.append(f"+model.kwargs.pretrained_cfg_overlay.file={initial}")
    proc = run_train(*run, "epochs=1")
    assert_ok(proc)
    assert "Missing keys" not in proc.stdout + proc.stderr
    assert_ok(run_train(*other, "epochs=1"))
    pretrained = torch.load(initial)["model"]
    tuned, new_head = (torch.load(tmp_path / run / "checkpoint-last.pt")["model"] for run in ("run", "other"))
    assert all(torch.allclose(tuned[k], pretrained[k], atol=1e-6) for k in pretrained)  # the head too
    backbone = [key for key in pretrained if not key.startswith("head.")]
    assert backbone and all(torch.allclose(new_head[k], pretrained[k], atol=1e-6) for k in backbone)
    assert new_head["head.weight"].shape == pretrained["head.weight"].shape
    assert not torch.allclose(new_head["head.weight"], pretrained["head.weight"], atol=1e-3)

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


def test_checkpoints_of_deit_and_timm_train_scripts_read_with_their_arguments(tmp_path):
    """DeiT's main.py and timm's train.py save their argparse Namespace ('args') in every checkpoint: it is read,
    for evaluation, init_from and teachers alike (their runs do not resume here: the line names init_from); an
    object inside it is still refused, and not run."""
    import argparse
    from omegaconf import OmegaConf
    from lion_vit.engine.build import check_resumable
    from lion_vit.engine.checkpoint import load_checkpoint
    from lion_vit.errors import UserError
    weights = {"head.weight": torch.ones(2, 3)}
    torch.save({"model": weights, "epoch": 299, "args": argparse.Namespace(model="deit_small_patch16_224",
                                                                         lr=5e-4)}, tmp_path / "deit.pth")
    torch.save({"state_dict": weights, "arch": "vit_small_patch16_224", "args": argparse.Namespace(amp=True)},
               tmp_path / "timm.pth.tar")
    for name in ("deit.pth", "timm.pth.tar"):
        loaded = load_checkpoint(tmp_path / name, weights=True)["model"]
        assert torch.equal(loaded["head.weight"], weights["head.weight"])
    with pytest.raises(UserError, match=r"is a checkpoint of DeiT's or timm's own training script .*; start from its "
                                        f"weights with model.init_from={tmp_path / 'deit.pth'}, or evaluate it"):
        check_resumable(OmegaConf.create({"resume": str(tmp_path / "deit.pth")}),
                        load_checkpoint(tmp_path / "deit.pth", setting="resume"))
    marker = tmp_path / "ran"
    torch.save({"model": {}, "args": argparse.Namespace(payload=_WritesFileWhenUnpickled(str(marker)))},
               tmp_path / "evil.pth")
    with pytest.raises(UserError, match=r"holds a Python object \(\S+\) that torch's safe load"):
        load_checkpoint(tmp_path / "evil.pth")
    assert not marker.exists()


class _WritesFileWhenUnpickled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (Path(self.path),)


def test_weights_that_do_not_fit_name_the_first_problem():
    import timm
    from lion_vit.engine.build import load_weights
    from lion_vit.errors import UserError
    model = timm.create_model("lion_d_tiny", img_size=32, patch_size=8, depth=1, num_classes=3)
    weights = model.state_dict()
    del weights["head.bias"]
    with pytest.raises(UserError, match=r"^checkpoint does not fit lion_d_tiny: Missing key\(s\) in state_dict: \"head.bias\""):
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


def test_resume_auto_reads_checkpoints_that_counted_epochs_from_0(tmp_path):
    """A checkpoint without `format` held the finished epoch's 0-based index (epoch 2: three done); today's
    hold the epochs done (epoch 2: two). resume=auto takes the one with more epochs done."""
    from lion_vit.engine import checkpoint as ckpt
    ckpt.save_atomic({"model": {}, "epoch": 2}, tmp_path / ckpt.PREVIOUS)
    ckpt.save_atomic({"model": {}, "epoch": 2, "format": ckpt.FORMAT}, tmp_path / ckpt.LAST)
    state = ckpt.newest_readable(tmp_path)
    assert "format" not in state and ckpt.epochs_done(state) == 3


@pytest.mark.parametrize("name", ["lion_d_natural_tiny", "lion_s_tiny"])
def test_decay_parameters_saved_under_their_old_names_load(name, tmp_path):
    """Checkpoints from before the decay kinds were modules name a layer's decays `attn.decay_logit` and
    `attn.decay_proj.*`: they load into `attn.decay.logit` / `attn.decay.proj.*`, through load_state_dict and
    timm's checkpoint_path."""
    import timm

    from lion_vit.testing import randomize_decays
    settings = dict(img_size=32, patch_size=8, depth=2, num_classes=3)
    source = randomize_decays(timm.create_model(name, **settings))
    old = {key.replace(".decay.", ".decay_"): value for key, value in source.state_dict().items()}
    assert any(".attn.decay_" in key for key in old)
    model = timm.create_model(name, **settings)
    model.load_state_dict(old)
    torch.save({"model": old}, tmp_path / "old.pt")
    from_file = timm.create_model(name, checkpoint_path=str(tmp_path / "old.pt"), **settings)
    for loaded in (model, from_file):
        for key, value in source.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key


def test_optimizer_state_of_a_format_2_checkpoint_follows_its_parameters():
    """A format-2 checkpoint's optimizer state lists LION-d's decay logits where they were then, first among
    their layer's parameters (a parameter of the layer itself, not of a submodule): loaded through
    ckpt.optimizer_state, every parameter gets its own state back; format 3 loads as saved."""
    import timm
    from timm.optim import create_optimizer_v2

    import lion_vit  # noqa: F401
    from lion_vit.engine import checkpoint as ckpt
    model = timm.create_model("lion_d_natural_tiny", img_size=32, patch_size=8, depth=2, num_classes=3)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    model(torch.randn(2, 3, 32, 32)).square().sum().backward()
    optimizer.step()
    expected = {id(param): state["exp_avg"].clone() for param, state in optimizer.state.items()}

    # the order of the old layout: the logits as the layer's own parameters (torch lists those before submodules')
    attentions = list(model.lion_attentions())
    for attn in attentions:
        attn.register_parameter("decay_logit", attn.decay._parameters.pop("logit"))
    old_order = {id(param): index for index, (_, param) in enumerate(model.named_parameters())}
    for attn in attentions:
        attn.decay.register_parameter("logit", attn._parameters.pop("decay_logit"))
    saved = optimizer.state_dict()
    groups = [sorted(group["params"], key=lambda param: old_order[id(param)]) for group in optimizer.param_groups]
    index = {id(param): i for i, param in enumerate(p for group in groups for p in group)}
    old = {"state": {index[id(param)]: {key: value.clone() for key, value in state.items()}
                     for param, state in optimizer.state.items()},
           "param_groups": [dict(saved_group, params=[index[id(param)] for param in group])
                            for saved_group, group in zip(saved["param_groups"], groups)]}
    assert any(old["state"][i]["exp_avg"].shape != saved["state"][i]["exp_avg"].shape for i in saved["state"])

    for state, fmt in ((old, 2), (saved, ckpt.FORMAT)):
        fresh = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
        fresh.load_state_dict(ckpt.optimizer_state({"optimizer": state, "format": fmt}, fresh, model))
        assert {id(param) for param in fresh.state} == set(expected)
        for param, got in fresh.state.items():
            assert torch.equal(got["exp_avg"], expected[id(param)]), fmt
