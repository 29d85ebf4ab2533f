"""Ctrl-C (and its distributed agreement) stops a run cleanly: at a step boundary, never inside a write."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runs import ENV, ROOT, SMALL_LION, assert_ok, read_metrics, run_train, two_gloo_ranks


@pytest.fixture(autouse=True)
def ctrl_c_as_in_a_terminal():
    """Ctrl-C raises KeyboardInterrupt here and in the runs started from here, as in a terminal, also
    where the suite runs in the background (`make test &` ignores SIGINT, and children inherit that)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
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


def test_ctrl_c_in_a_local_sweep_says_how_to_continue_the_sweep(folder, tmp_path):
    """A local sweep (-m) stopped in a job: the jobs after it have not run, and the sweep's command with
    resume=auto continues them all, each in its folder, where resume=auto in the job's folder would continue
    that job alone."""
    args = ["-m", *SMALL_LION, "data=imagefolder", f"data.root={folder}", "batch_size=4", "aug=none",
            f"output_dir={tmp_path}", "epochs=50", "seed=0,1"]
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    deadline = time.time() + 240
    while time.time() < deadline and not (tmp_path / "0" / "checkpoint-last.pt").exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert f"interrupted: {tmp_path / '0'} holds the checkpoint of the last finished epoch; the sweep's command " \
           f"with resume=auto output_dir={tmp_path} continues the sweep (each job in its folder, <job number>; a " \
           f"finished job trains nothing)" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "multirun.yaml"]


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
    assert [m["epoch"] for m in read_metrics(tmp_path)] == [1]  # counted from 1, as in the checkpoint
    assert torch.load(tmp_path / "checkpoint-last.pt")["epoch"] == 1


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


def _count_steps_until_stopped(rank: int, out: Path) -> None:
    """One rank of a two-process gloo group taking up to 5 steps; only rank 1 sees a Ctrl-C, in step 2."""
    from lion_vit.engine import interrupts
    steps = 0
    try:
        with interrupts.stop_between_steps(announce=False):
            for step in range(5):
                interrupts.raise_if_agreed(*interrupts.agreement(torch.device("cpu")).tolist())
                if rank == 1 and step == 2:
                    os.kill(os.getpid(), signal.SIGINT)
                steps += 1
    except KeyboardInterrupt:
        (out / f"rank{rank}").write_text(str(steps))


@pytest.mark.slow
def test_distributed_ranks_stop_before_the_same_step(tmp_path):
    """A rank that stopped alone would leave its peers waiting in the next collective (DDP's gradient
    all-reduce) for good: the ranks agree, so one rank's Ctrl-C stops every rank before the same step."""
    two_gloo_ranks(_count_steps_until_stopped, tmp_path)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["3", "3"]


def _train_until_stopped(rank: int, out: Path) -> None:
    """One rank of a two-process gloo group training an epoch of 6 steps; only rank 1 sees a Ctrl-C, in the
    forward of its third step. Writes its forwards and optimizer steps."""
    from lion_vit.engine import interrupts
    from lion_vit.engine.loop import Precision, Training, classification_loss, train_one_epoch
    forwards, updates = [], []

    class Counted(torch.nn.Linear):
        def forward(self, x):
            forwards.append(len(forwards))
            if rank == 1 and len(forwards) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return super().forward(x.flatten(1))

    model = Counted(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *args: updates.append(1))
    scheduler = type("Constant", (), {"step_update": lambda self, num_updates: None})()
    loader = [(torch.randn(2, 1, 2, 2), torch.tensor([0, 1]))] * 6
    try:
        with interrupts.stop_between_steps(announce=False):
            train_one_epoch(Training(model, optimizer, classification_loss(torch.nn.CrossEntropyLoss()), scheduler,
                                     Precision(torch.device("cpu"))), loader, 0, show_progress=False)
    except KeyboardInterrupt:
        (out / f"rank{rank}").write_text(f"{len(forwards)} {len(updates)}")


@pytest.mark.slow
def test_distributed_training_agrees_to_stop_with_the_steps_loss(tmp_path):
    """In training the ranks' agreement is read with the step's loss, after its forward (one read a step, not
    a second one before it): one rank's Ctrl-C in its third step's forward stops both ranks after the fourth
    step's forward, before its backward, with three optimizer steps each."""
    two_gloo_ranks(_train_until_stopped, tmp_path)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["4 3", "4 3"]


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
