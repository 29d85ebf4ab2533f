import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HYDRA_FULL_ERROR", "0")


@pytest.fixture
def chunks_always(monkeypatch):
    """The chunk form cuts every sequence into its chunks, however short. Without this, at the short
    lengths these tests use it runs one product over the whole sequence instead, which costs less there
    (lion_vit.ops.whole_product_is_cheaper): the tests of the chunk algorithm itself take this fixture;
    tests/test_whole_or_chunks.py tests that choice."""
    import lion_vit.ops

    monkeypatch.setattr(lion_vit.ops, "whole_product_is_cheaper", lambda *args, **kwargs: False)
