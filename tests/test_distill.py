"""DeiT distillation (distill=soft|hard, *_distilled students) and starting LION from a softmax ViT
(model.init_from / lion_vit.init_from_vit), on the embedded digits: CPU, no network."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import timm
import torch
import torch.nn.functional as F

import lion_vit
from lion_vit.engine.distill import DistillationLoss, TeacherInput
from runs import assert_clean_error, assert_ok, kill_after_first_epoch, read_metrics, run_python, run_train

# a softmax DeiT of the digits model's width, depth and heads (configs/model/digits.yaml)
DIGITS_DEIT = ["model=deit", "model.patch_size=2", "+model.kwargs.embed_dim=64", "+model.kwargs.depth=4",
               "+model.kwargs.num_heads=4"]
QUIET = ["progress=false"]


@pytest.fixture(scope="session")  # (the slow tests run first: a module fixture would be made twice)
def teacher(tmp_path_factory):
    """The checkpoint of a softmax DeiT trained by train.py on the digits (about 70 % top-1 in 8 epochs)."""
    out = tmp_path_factory.mktemp("teacher")
    assert_ok(run_train(*DIGITS_DEIT, *QUIET, "epochs=8", f"output_dir={out}"))
    return out / "checkpoint-best.pt"


def forms_agree(checkpoint):
    """The checkpoint's model gives the same predictions (and accuracy) on the digits' validation split in
    the attention, rnn and chunk forms; returns that accuracy."""
    from lion_vit.data import build_dataset, build_loader, build_transform, on_device
    from omegaconf import OmegaConf
    state = torch.load(checkpoint, weights_only=True)
    cfg = OmegaConf.create(state["config"])
    model = timm.create_model(cfg.model.name, img_size=cfg.img_size, patch_size=cfg.model.patch_size,
                              num_classes=10, **cfg.model.kwargs).eval()
    model.load_state_dict(state["model"])
    val = build_dataset(cfg.data, "val", build_transform(cfg.data, cfg.aug, cfg.img_size, train=False))
    loader = build_loader(val, train=False, batch_size=len(val), num_workers=0, rank=0, world_size=1, seed=0)
    images, labels = next(iter(on_device(loader, cfg.data, None, torch.device("cpu"))))  # normalised there
    with torch.no_grad():
        logits = {form: model.set_attn_form(form, chunk_size=5 if form == "chunk" else None)(images)
                  for form in ("attention", "rnn", "chunk")}
    for form in ("rnn", "chunk"):
        torch.testing.assert_close(logits[form], logits["attention"], rtol=1e-4, atol=1e-4)
        assert torch.equal(logits[form].argmax(1), logits["attention"].argmax(1)), form
    return (logits["attention"].argmax(1) == labels).float().mean().item()


@pytest.mark.slow
def test_hard_distillation_trains_the_default_student_and_logs_both_losses(teacher, tmp_path):
    assert_ok(run_train(*QUIET, "distill=hard", f"distill.teacher_checkpoint={teacher}", "epochs=2",
                        f"output_dir={tmp_path}"))
    for line in read_metrics(tmp_path):  # DeiT's mix: (1 - alpha) * classification + alpha * distillation
        assert line["train_loss"] == pytest.approx(0.5 * line["train_loss_cls"] + 0.5 * line["train_loss_dist"])
    assert forms_agree(tmp_path / "checkpoint-last.pt") > 0.15  # above chance (0.1) after 2 epochs


def test_soft_distillation_into_a_student_with_a_distillation_token(teacher, tmp_path):
    assert_ok(run_train(*QUIET, "distill.type=soft", "distill.tau=2.0", "distill.alpha=0.3",
                        f"distill.teacher_checkpoint={teacher}", "model.name=lion_d_natural_tiny_distilled",
                        "epochs=2", f"output_dir={tmp_path}"))
    line = read_metrics(tmp_path)[-1]
    assert line["train_loss"] == pytest.approx(0.7 * line["train_loss_cls"] + 0.3 * line["train_loss_dist"])
    state = torch.load(tmp_path / "checkpoint-last.pt", weights_only=True)
    assert {"dist_token", "head_dist.weight"} <= set(state["model"])
    forms_agree(tmp_path / "checkpoint-last.pt")


@pytest.mark.slow
def test_killed_and_resumed_distillation_ends_with_the_weights_of_an_uninterrupted_run(teacher, tmp_path):
    args = [*QUIET, "distill=hard", f"distill.teacher_checkpoint={teacher}", "aug=deit", "img_size=8",
            "batch_size=128"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_ok(run_train(*args, "epochs=2", f"output_dir={straight}"))
    kill_after_first_epoch(*args, output_dir=resumed, epochs=2)
    assert_ok(run_train(*args, "epochs=2", f"output_dir={resumed}", "resume=auto"))
    a, b = (torch.load(run / "checkpoint-last.pt", weights_only=True)["model"] for run in (straight, resumed))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    losses = ("train_loss", "train_loss_cls", "train_loss_dist", "val_acc1")
    assert [[m[k] for k in losses] for m in read_metrics(straight)] == \
        [[m[k] for k in losses] for m in read_metrics(resumed)]


def test_init_from_a_softmax_vit_copies_its_weights_and_beats_random_init(teacher, tmp_path):
    """docs/training.md's commands: after one epoch on the digits, 32.5 % top-1 from the DeiT teacher's
    weights against 12.2 % from random weights (seed 0), with no warm-up and so no warning about it."""
    model = timm.create_model("lion_d_natural_tiny", img_size=8, patch_size=2, num_classes=10, embed_dim=64,
                              depth=4, num_heads=4)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    report = lion_vit.init_from_vit(model, str(teacher))
    source = torch.load(teacher, weights_only=True)["model"]
    assert len(report.copied) == 52 and all(torch.equal(model.state_dict()[k], source[k]) for k in report.copied)
    assert torch.equal(model.fc_norm.weight, source["norm.weight"])  # the final norm, where the pooling reads it
    assert report.fresh == [f"blocks.{i}.attn.decay.logit" for i in range(4)]
    assert all(torch.equal(model.state_dict()[k], fresh[k]) for k in report.fresh)  # as a new model's
    assert report.unused == ["cls_token"]

    accuracy = {}
    for init in ("null", str(teacher)):
        out = tmp_path / ("random" if init == "null" else "deit")
        proc = run_train(*QUIET, f"model.init_from={init}", "epochs=1", "optim.warmup_epochs=0", f"output_dir={out}")
        assert_ok(proc)
        accuracy[out.name] = read_metrics(out)[0]["val_acc1"]
    assert "init_from" in proc.stdout and "copied 52 tensors" in proc.stdout
    assert "warm-up" not in proc.stdout + proc.stderr
    assert accuracy["deit"] > accuracy["random"] + 5, accuracy


def small_vit(name, **kwargs):
    return timm.create_model(name, **{**dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                             num_classes=5), **kwargs})


def test_init_from_adapts_positional_embeddings_and_prefix_tokens(tmp_path):
    from timm.layers import resample_abs_pos_embed
    deit = small_vit("deit_tiny_distilled_patch16_224")  # class and distillation tokens, pos_embed entries for both
    path = tmp_path / "deit.pth"
    torch.save(deit.state_dict(), path)

    lit = timm.create_model("lion_lit_tiny", img_size=48, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                            num_classes=5)  # mean pooling, no class token, a 6x6 grid
    report = lion_vit.init_from_vit(lit, str(path))
    expected = resample_abs_pos_embed(deit.pos_embed[:, 2:], new_size=[6, 6], old_size=(4, 4), num_prefix_tokens=0)
    torch.testing.assert_close(lit.pos_embed, expected)
    assert dict(report.adapted)["pos_embed"] == "4x4 -> 6x6 grid, cls_token entry dropped, dist_token entry dropped"

    token = timm.create_model("lion_lit_tiny_distilled", img_size=32, patch_size=8, embed_dim=32, depth=2,
                              num_heads=2, num_classes=5, global_pool="token")
    lion_vit.init_from_vit(token, str(path))
    assert torch.equal(token.pos_embed, deit.pos_embed) and torch.equal(token.dist_token, deit.dist_token)
    assert torch.equal(token.head_dist.weight, deit.head_dist.weight) and torch.equal(token.norm.weight, deit.norm.weight)

    # register tokens: a ViT whose positional embeddings hold entries for its class token and two registers
    registers = small_vit("vit_tiny_patch16_224", reg_tokens=2)
    report = lion_vit.init_from_vit(lit, registers.state_dict())
    expected = resample_abs_pos_embed(registers.pos_embed[:, 3:], new_size=[6, 6], old_size=(4, 4), num_prefix_tokens=0)
    torch.testing.assert_close(lit.pos_embed, expected)
    assert dict(report.adapted)["pos_embed"] == ("4x4 -> 6x6 grid, cls_token entry dropped, reg_token 0 entry dropped, "
                                                 "reg_token 1 entry dropped")
    same = small_vit("lion_lit_tiny", global_pool="token", reg_tokens=2)
    lion_vit.init_from_vit(same, registers.state_dict())
    assert torch.equal(same.pos_embed, registers.pos_embed) and torch.equal(same.reg_token, registers.reg_token)

    other_classes = small_vit("lion_s_tiny", num_classes=7)
    report = lion_vit.init_from_vit(other_classes, str(path))
    assert "head.weight" in report.fresh and "blocks.0.attn.decay.proj.weight" in report.fresh
    assert dict(report.adapted)["head"] == "5 classes in the source, 7 here: fresh"

    for wider, needle in ((dict(embed_dim=64), "width 32"), (dict(depth=3), "depth 2")):
        with pytest.raises(ValueError, match=f"does not fit: the source has .*{needle}"):
            lion_vit.init_from_vit(timm.create_model("lion_d_tiny", img_size=32, patch_size=8, num_classes=5,
                                                     **{**dict(embed_dim=32, depth=2, num_heads=2), **wider}), str(path))


def test_init_from_takes_a_vit_or_its_state_dict_in_memory(tmp_path):
    """The module a researcher already holds, or its state dict (a DeiT checkpoint dict too), gives the weights the
    same file gives; its heads are read from the module. What is no ViT is one line."""
    deit = small_vit("deit_tiny_patch16_224")
    torch.save(deit.state_dict(), tmp_path / "deit.pth")
    torch.manual_seed(0)
    from_file = small_vit("lion_d_tiny")
    lion_vit.init_from_vit(from_file, str(tmp_path / "deit.pth"))
    for source, name in ((deit, "the VisionTransformer given (deit_tiny_patch16_224)"),
                         (deit.state_dict(), "the state dict given"),
                         ({"model": deit.state_dict()}, "the state dict given")):
        torch.manual_seed(0)
        model = small_vit("lion_d_tiny")
        report = lion_vit.init_from_vit(model, source)
        assert report.source == name and len(report.copied) > 20
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), from_file.state_dict().values()))
    with pytest.raises(ValueError, match="does not fit: the source has width 32, depth 2, 4 heads"):
        lion_vit.init_from_vit(small_vit("lion_d_tiny"), small_vit("deit_tiny_patch16_224", num_heads=4))
    with pytest.raises(ValueError, match=r"init_from the ResNet given \(resnet18\) is no ViT \(it has no "
                                         r"patch_embed.proj.weight\); give a timm vit_\*, deit_\* or deit3_\* model"):
        lion_vit.init_from_vit(small_vit("lion_d_tiny"), timm.create_model("resnet18", num_classes=5))
    with pytest.raises(ValueError, match="init_from the state dict given holds no state dict of tensors"):
        lion_vit.init_from_vit(small_vit("lion_d_tiny"), {})


def test_distillation_loss_follows_deits_definitions():
    torch.manual_seed(0)
    images, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 1])
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 3))
    student_cls, student_dist = torch.randn(4, 3), torch.randn(4, 3)
    teacher_logits = teacher(images)
    ce = torch.nn.CrossEntropyLoss()

    def loss(kind, alpha, tau=1.0, outputs=(student_cls, student_dist)):
        return DistillationLoss(ce, teacher, lambda x: x, kind, alpha, tau)(images, outputs, labels)

    torch.testing.assert_close(loss("hard", 1.0), F.cross_entropy(student_dist, teacher_logits.argmax(1)))
    torch.testing.assert_close(loss("hard", 0.0), ce(student_cls, labels))  # the class head takes the labels
    torch.testing.assert_close(loss("soft", 0.5, 1.0, outputs=teacher_logits.detach()), 0.5 * ce(teacher_logits, labels))
    kl = sum(F.kl_div(F.log_softmax(student_dist[i] / 2, 0), F.softmax(teacher_logits[i] / 2, 0), reduction="sum")
             for i in range(4)) * 4 / student_dist.numel()
    torch.testing.assert_close(loss("soft", 1.0, 2.0), kl)


def test_the_teacher_sees_the_batch_at_its_own_size_and_normalisation():
    raw = torch.rand(2, 3, 8, 8)
    student_mean, student_std, teacher_mean, teacher_std = [0.5] * 3, [0.5] * 3, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    to_teacher = TeacherInput((8, student_mean, student_std), (16, teacher_mean, teacher_std))
    normalised = (raw - 0.5) / 0.5
    expected = (F.interpolate(raw, size=(16, 16), mode="bicubic", align_corners=False) -
                torch.tensor(teacher_mean).view(1, 3, 1, 1)) / torch.tensor(teacher_std).view(1, 3, 1, 1)
    torch.testing.assert_close(to_teacher(normalised), expected)
    same = TeacherInput((8, student_mean, student_std), (8, student_mean, student_std))
    assert same(normalised) is normalised
    # a student at img_size=[height,width]: the teacher's square, or its own (height, width), from that grid
    wide = torch.rand(2, 3, 8, 12)
    to_square = TeacherInput(((8, 12), [0.0] * 3, [1.0] * 3), (16, [0.0] * 3, [1.0] * 3))
    torch.testing.assert_close(to_square(wide), F.interpolate(wide, size=(16, 16), mode="bicubic", align_corners=False))
    to_tall = TeacherInput(((8, 12), [0.0] * 3, [1.0] * 3), ((12, 6), [0.0] * 3, [1.0] * 3))
    torch.testing.assert_close(to_tall(wide), F.interpolate(wide, size=(12, 6), mode="bicubic", align_corners=False,
                                                            antialias=True))


def test_a_distilled_student_trains_both_heads_and_evaluates_their_mean():
    model = timm.create_model("lion_s_natural_tiny_distilled", img_size=16, patch_size=4, num_classes=3).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    model.set_distilled_training(True)
    cls_logits, dist_logits = model.train()(x)
    model.eval()
    outputs = {form: model.set_attn_form(form, chunk_size=3)(x) for form in ("attention", "rnn", "chunk")}
    for form in ("rnn", "chunk"):
        torch.testing.assert_close(outputs[form], outputs["attention"], rtol=1e-10, atol=1e-10)
    model.set_distilled_training(False)
    features = model.forward_features(x)
    torch.testing.assert_close(outputs["attention"], (model.head(model.fc_norm(features[:, 1:].mean(1))) +
                                                      model.head_dist(model.fc_norm(features[:, 0]))) / 2)
    assert model.num_prefix_tokens == 1 and features.shape[1] == 1 + 16
    model.reset_classifier(7)
    assert model(x).shape == (2, 7) and model.get_classifier()[1].out_features == 7


def test_a_timm_teacher_takes_its_weights_from_a_torch_or_safetensors_file(tmp_path):
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from lion_vit.engine.distill import build_teacher
    trained = timm.create_model("resnet18", num_classes=10)
    torch.save({"model": trained.state_dict()}, tmp_path / "teacher.pth")  # DeiT's checkpoint layout
    save_file(trained.state_dict(), tmp_path / "teacher.safetensors")
    for name in ("teacher.pth", "teacher.safetensors"):
        teacher, (size, mean, std) = build_teacher(
            OmegaConf.create({"teacher": "resnet18", "teacher_checkpoint": str(tmp_path / name)}), 10, [])
        assert torch.equal(teacher.fc.weight, trained.fc.weight) and size == 224
        assert tuple(mean) == trained.pretrained_cfg["mean"]


def test_distillation_without_a_teacher_is_refused_before_anything_is_built():
    from hydra import compose, initialize_config_dir
    from lion_vit.engine.config import check_settings
    from lion_vit.errors import UserError
    from runs import ROOT
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["distill=hard"])
        check_settings(compose("config", overrides=["distill=hard", "distill.teacher=resnet18"]))
    with pytest.raises(UserError, match="^distill.type=hard needs a teacher: set distill.teacher"):
        check_settings(cfg)


def test_bad_teachers_and_init_from_sources_are_one_line(teacher, tmp_path):
    """train.py's one error line and exit status 2, leaving no folder; the other bad sources in-process."""
    from omegaconf import OmegaConf
    from lion_vit.engine.distill import build_teacher
    from lion_vit.engine.trainer import _init_from_vit
    from lion_vit.errors import UserError
    cases = [
        (("distill=hard", "distill.teacher=not_a_model"), ("unknown teacher 'not_a_model'",)),
        (("model=lion", "img_size=32", f"model.init_from={teacher}"), ("does not fit", "width 64", "width 384")),
    ]
    runs = [(*overrides, *QUIET, "epochs=1", f"output_dir={tmp_path / f'run{i}'}") for i, (overrides, _) in enumerate(cases)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda overrides: run_train(*overrides), runs))
    for (_, needles), proc in zip(cases, procs):
        assert proc.returncode == 2
        assert_clean_error(proc, *needles)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("run")]

    not_a_deit = tmp_path / "resnet.pth"
    torch.save({"fc.weight": torch.zeros(3, 3)}, not_a_deit)
    for settings, message in (
            (dict(teacher_checkpoint=str(tmp_path / "missing.pt")), "does not exist"),
            (dict(teacher="resnet18", teacher_checkpoint=str(not_a_deit)), f"^cannot load teacher resnet18 from {not_a_deit}"),
            (dict(teacher_checkpoint=str(not_a_deit)), "holds no train.py config; also set distill.teacher"),
            (dict(teacher="lion_d_tiny", teacher_checkpoint=str(teacher)),  # (a train.py checkpoint names its model)
             f"^distill.teacher=lion_d_tiny, but {teacher} holds a deit_small_patch16_224; drop distill.teacher")):
        with pytest.raises(UserError, match=message):
            build_teacher(OmegaConf.create({"teacher": None, **settings}), 10, [str(d) for d in range(10)])
    with pytest.raises(UserError, match="^model.init_from=.*nowhere.pt: init_from file .* does not exist"):
        _init_from_vit(timm.create_model("lion_d_tiny"), str(tmp_path / "nowhere.pt"))
    torch.save({}, tmp_path / "checkpoint-best.pt")  # a run's folder named instead of a file in it
    torch.save({}, tmp_path / "model_best.pth.tar")  # (timm's train.py's)
    with pytest.raises(UserError, match=f"^model.init_from={tmp_path}: {tmp_path} is a folder, not a file "
                                        r"\(it holds checkpoint-best.pt, model_best.pth.tar, resnet.pth\)"):
        _init_from_vit(timm.create_model("lion_d_tiny"), str(tmp_path))
    with pytest.raises(UserError, match=f"^distill.teacher_checkpoint {tmp_path} is a folder, not a file"):
        build_teacher(OmegaConf.create({"teacher": None, "teacher_checkpoint": str(tmp_path)}), 10, ["0"])


def test_hub_names_fail_at_once_offline(tmp_path):
    """A teacher, model.init_from, +model.kwargs.pretrained=true and lion_vit.init_from_vit named from the hub
    with the hub out of reach (runs.ENV: a closed port) and an empty cache: one line saying how to use a
    local file, without huggingface_hub's minute of retries (the 30 s timeout would end each)."""
    hub_name = "deit_tiny_patch16_224.fb_in1k"
    runs = [
        ((f"model.init_from={hub_name}",), ("model.init_from=", "not in the local cache", "127.0.0.1:9",
                                             "pass the path of a file")),
        (("distill=hard", f"distill.teacher={hub_name}"), ("cannot load teacher", "not in the local cache",
                                                          "distill.teacher_checkpoint=<path>")),
        (("model=deit", "model.name=deit_tiny_patch16_224", "img_size=16", "+model.kwargs.pretrained=true"),
         ("not in the local cache", "+model.kwargs.pretrained_cfg_overlay.file=<path>")),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda i: run_train(*runs[i][0], *QUIET, "epochs=1", f"output_dir={tmp_path / f'run{i}'}",
                                                  timeout=30), range(len(runs))))
        python = pool.submit(run_python, "-c", f"import timm, lion_vit; lion_vit.init_from_vit("
                                               f"timm.create_model('lion_d_tiny'), {hub_name!r})", timeout=30).result()
    for (_, needles), proc in zip(runs, procs):
        assert proc.returncode == 2 and "Retry" not in proc.stderr
        assert_clean_error(proc, *needles)
    assert not list(tmp_path.iterdir())  # no folder left behind
    assert f"HubUnreachable: timm's weights of {hub_name} are not in the local cache" in python.stderr
    assert "pass the path of a file of them instead" in python.stderr and "Retry" not in python.stderr
