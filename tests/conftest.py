import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: one thread per worker, workers share the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if torch.cuda.is_available():  # tests/test_triton.py: exactness checks need full-precision float32 dots
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
else:  # GPU kernels run on CPU tensors under Triton's interpreter, which must be on before triton.language
    # is imported (timm imports it): every Triton kernel of the tests is then interpreted
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def chunks_always(monkeypatch):
    """The chunk form cuts every sequence into its chunks, however short. Without this, at the short
    lengths these tests use it runs one product over the whole sequence instead, which costs less there
    (lion_vit.ops.dispatch.plan, whole_product_is_cheaper): the tests of the chunk algorithm itself take this fixture;
    tests/test_whole_or_chunks.py tests that choice."""
    import lion_vit.ops.dispatch

    monkeypatch.setattr(lion_vit.ops.dispatch, "whole_product_is_cheaper", lambda *args, **kwargs: False)
