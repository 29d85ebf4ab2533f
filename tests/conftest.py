import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: workers share the cores, so each runs its share of threads
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    # numpy's OpenBLAS (Triton's interpreter computes through it) reads this once, when numpy loads; its
    # idle threads spin, taking cores from the other workers
    os.environ["OPENBLAS_NUM_THREADS"] = str(THREADS)
else:
    THREADS = None

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")
if THREADS is not None:
    torch.set_num_threads(THREADS)
if torch.cuda.is_available():  # tests/test_triton.py: exactness checks need full-precision float32 dots
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
else:  # GPU kernels run on CPU tensors under Triton's interpreter, which must be on before triton.language
    # is imported (timm imports it): every Triton kernel of the tests is then interpreted
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(items):
    """The tests marked slow run first (pytest-xdist hands the workers tests in this order): the suite then
    ends on short tests, where one that starts last would keep a worker busy while the others are idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def chunks_always(monkeypatch):
    """The chunk form cuts every sequence into its chunks, however short. Without this, at the short
    lengths these tests use it runs one product over the whole sequence instead, which costs less there
    (lion_vit.ops.dispatch.plan, whole_product_is_cheaper): the tests of the chunk algorithm itself take this fixture;
    tests/test_whole_or_chunks.py tests that choice."""
    import lion_vit.ops.dispatch

    monkeypatch.setattr(lion_vit.ops.dispatch, "whole_product_is_cheaper", lambda *args, **kwargs: False)


@pytest.fixture
def one_row_groups(monkeypatch):
    """The CPU backend (the chunk form without autograd on a CPU) runs one (batch, head) row per group,
    so that tests at small sizes exercise its groups."""
    import lion_vit.ops.cpu.rows

    monkeypatch.setattr(lion_vit.ops.cpu.rows, "GROUP_BYTES", 1)


@pytest.fixture
def knobs():
    """knobs(**changes): lion_vit.ops.tuned's settings for the rest of the test, then the code's again."""
    from contextlib import ExitStack

    from lion_vit.ops import tuned

    with ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tuned(**changes))


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """A tiny 3-class image folder (train/ and val/) that a model learns in a few steps."""
    from runs import make_image_folder
    return make_image_folder(tmp_path_factory.mktemp("imgs"))


@pytest.fixture(scope="session")
def trained(folder, tmp_path_factory):
    """A 2-epoch LION-s run shared by the evaluation, resume and checkpoint tests (copy it to change it)."""
    from runs import SMALL_LION, assert_ok, run_train
    out = tmp_path_factory.mktemp("trained")
    assert_ok(run_train(*SMALL_LION, "data=imagefolder", f"data.root={folder}", "epochs=2", "batch_size=4",
                        "aug=none", f"output_dir={out}", "optim.lr=2e-3", "optim.lr_base_batch=null",
                        "optim.warmup_epochs=0"))
    return out

